import json
from collections import Counter

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from raychat.calculator import calculate
from raychat.chat_template import render_conversation
from raychat.tasks import (
    GSM8K,
    Calculator,
    ChatterbotConversations,
    HumanEval,
    MultipleChoice,
    SmolTalk,
    Spelling,
    Task,
    TaskMixture,
    TaskSequence,
    extract_answer,
    mixture_report,
)
from raychat.tasks.loaders import conversation_error
from raychat.tasks.registry import (
    EVAL_TASK_NAMES,
    HUB_TASKS,
    LOCAL_TASKS,
    TASK_NAMES,
    TASKS,
    graded,
    held_out,
    parse_mixture,
)
from raychat.tasks.spelling import split_of as word_split


class Numbers(Task):
    """A task whose example i says str(i): for mixture and slicing arithmetic."""

    eval_type = "generative"

    def __init__(self, name, n, **kw):
        self.name, self.n = name, n
        super().__init__(**kw)

    def num_examples(self):
        return self.n

    def get_example(self, index):
        return {
            "id": self._id(index),
            "messages": [{"role": "user", "content": "n?"}, {"role": "assistant", "content": str(index)}],
        }


def test_slicing_maps_to_physical_indices():
    t = Numbers("n", 10, start=2, stop=9, step=3)
    assert len(t) == 3  # 2, 5, 8
    assert [t[i]["id"] for i in range(3)] == ["n/2", "n/5", "n/8"]
    assert t[-1]["id"] == "n/8"
    with pytest.raises(IndexError):
        t[3]
    with pytest.raises(ValueError, match="step >= 1"):
        Numbers("n", 10, step=0)


def test_mixture_weights_by_repetition_and_explicit_and_deterministic_shuffle():
    a, b = Numbers("a", 4), Numbers("b", 6)
    m = TaskMixture([a, a, b], seed=3)
    assert Counter(c["source"] for c in (m[i] for i in range(len(m)))) == {"a": 8, "b": 6}
    w = TaskMixture([a, b], weights=[2, 0.5], seed=3)
    ids = [w[i]["id"] for i in range(len(w))]
    assert len(ids) == 2 * 4 + 3 and Counter(i[0] for i in ids) == {"a": 8, "b": 3}
    assert len({i for i in ids if i.startswith("b")}) == 3  # the half of b is 3 distinct examples
    assert [TaskMixture([a, b], seed=3)[i]["id"] for i in range(10)] == [
        m2["id"] for m2 in (TaskMixture([a, b], seed=3)[i] for i in range(10))
    ]
    orders = {tuple(TaskMixture([a, b], seed=s)[i]["id"] for i in range(10)) for s in range(3)}
    assert len(orders) == 3  # the seed changes the order
    with pytest.raises(ValueError, match="weights must be 2 numbers >= 0"):
        TaskMixture([a, b], weights=[1])


def test_task_sequence_is_a_curriculum_in_order():
    s = TaskSequence([Numbers("a", 2), Numbers("b", 3, start=1)])
    assert [s[i]["id"] for i in range(len(s))] == ["a/0", "a/1", "b/1", "b/2"]


def test_calculator_uses_tool_calls_and_held_out_split(small_tokenizer):
    train, test = Calculator("train", size=300, seed=0), Calculator("test", size=30, seed=0)
    ex = train[0]
    expr = ex["messages"][1]["content"][1]["text"]
    a, op, b = expr.split()
    expected = {"+": int(a) + int(b), "-": int(a) - int(b), "*": int(a) * int(b)}[op]
    assert ex["answer"] == str(expected)
    assert ex["messages"][1]["content"][2] == {"type": "python_output", "text": str(expected)}
    assert train.is_correct(ex, f"blah #### {expected}") and not train.is_correct(ex, f"#### {expected + 1}")
    for i in range(300):  # every result is the engine's for its call, and the user-file check accepts it
        call, output = (p["text"] for p in train[i]["messages"][1]["content"][1:3])
        assert calculate(call) == output and conversation_error(train[i]["messages"]) is None
    train_exprs = {train.problem(i)[0] for i in range(300)}
    test_exprs = {test.problem(i)[0] for i in range(30)}
    assert not train_exprs & test_exprs
    assert (
        Calculator("train", size=5, seed=0)[3] == train[3]
        and Calculator("train", size=5, seed=1)[3] != train[3]
    )
    r = render_conversation(small_tokenizer, ex)
    sup = small_tokenizer.decode([i for i, s in zip(r.ids, r.supervised) if s])
    assert sup == f"Let me compute it. <|python_start|>{expr}<|python_end|>#### {expected}<|assistant_end|>"


def test_spelling_from_a_word_list(tmp_path):
    words = ["apple", "Banana", "it's", "kiwi", "pepper", "x", "naïve"]
    (tmp_path / "words").write_text("\n".join(words))
    usable = ["apple", "kiwi", "pepper"]  # lowercase ASCII, 2-12 letters
    train = [w for w in usable if word_split(w) == "train"]
    task = Spelling("train", seed=0, words_path=str(tmp_path / "words"))
    assert sorted(task.words) == sorted(train) and len(task) == len(train)
    spell = task[0]
    assert spell["answer"] == "-".join(task.words[0])
    count = task[1]
    letter = count["messages"][0]["content"].split('"')[1]
    assert count["answer"] == str(task.words[1 % len(task.words)].count(letter))
    assert task.is_correct(count, f"#### {count['answer']}")
    with pytest.raises(FileNotFoundError, match="wamerican"):
        Spelling(words_path=str(tmp_path / "missing"))


def test_spelling_real_word_list_counts_letters():
    task = Spelling("train", size=50, seed=0)
    for i in range(1, 50, 2):
        ex = task[i]
        word, letter = ex["messages"][0]["content"].split('"')[3], ex["messages"][0]["content"].split('"')[1]
        assert ex["answer"] == str(word.count(letter)) and word_split(word) == "train"
        parts = ex["messages"][1]["content"]
        call, output = (next(p["text"] for p in parts if p["type"] == t) for t in ("python", "python_output"))
        assert calculate(call) == output == ex["answer"]  # the engine computes what SFT trains on


def test_chatterbot_real_corpus_and_format(tmp_path):
    real = ChatterbotConversations()
    assert len(real) > 1000
    first = real[0]
    assert first["id"] == "chatterbot/english/ai/0"
    assert first["messages"][0] == {"role": "user", "content": "What is AI?"}
    (tmp_path / "english").mkdir()
    (tmp_path / "english" / "t.yml").write_text(
        "categories: [t]\nconversations:\n- - Hello\n  - Hi\n  - Bye\n- - only one\n- - {a: 1}\n  - x\n- - Q\n  - A\n"
    )
    t = ChatterbotConversations(data_dir=str(tmp_path))
    assert len(t) == 2  # trailing "Bye" dropped, single line and non-string skipped
    assert [m["content"] for m in t[0]["messages"]] == ["Hello", "Hi"]
    assert t[1]["id"] == "chatterbot/english/t/3"
    with pytest.raises(ValueError, match="language must be one of"):
        ChatterbotConversations(language="klingon", data_dir=str(tmp_path))


def test_smoltalk_parquet(tmp_path, small_tokenizer):
    msgs = [
        [
            {"role": "system", "content": "S"},
            {"role": "user", "content": "Q"},
            {"role": "assistant", "content": "A"},
        ]
    ]
    pq.write_table(pa.table({"messages": msgs}), tmp_path / "train.parquet")
    t = SmolTalk(tmp_path)
    assert len(t) == 1 and t[0]["messages"] == msgs[0]
    assert render_conversation(small_tokenizer, t[0]).num_targets == len(small_tokenizer.encode("A")) + 1
    pq.write_table(pa.table({"text": ["x"]}), tmp_path / "bad.parquet")
    with pytest.raises(ValueError, match=r"lacks column\(s\) \['messages'\]"):
        SmolTalk(tmp_path / "bad.parquet")


GSM8K_ROW = {
    "question": "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. "
    "How many clips did Natalia sell altogether in April and May?",
    "answer": "Natalia sold 48/2 = <<48/2=24>>24 clips in May.\n"
    "Natalia sold 48+24 = <<48+24=72>>72 clips altogether in April and May.\n#### 72",
}


def test_gsm8k_jsonl_turns_calculator_annotations_into_tool_calls(tmp_path):
    (tmp_path / "test.jsonl").write_text(json.dumps(GSM8K_ROW) + "\n")
    t = GSM8K(tmp_path / "test.jsonl")
    ex = t[0]
    assert ex["answer"] == "72"
    assert ex["messages"][1]["content"] == [
        {"type": "text", "text": "Natalia sold 48/2 = "},
        {"type": "python", "text": "48/2"},
        {"type": "python_output", "text": "24"},
        {"type": "text", "text": "24 clips in May.\nNatalia sold 48+24 = "},
        {"type": "python", "text": "48+24"},
        {"type": "python_output", "text": "72"},
        {"type": "text", "text": "72 clips altogether in April and May.\n#### 72"},
    ]
    assert t.is_correct(ex, "so #### 72") and not t.is_correct(ex, "#### 71") and not t.is_correct(ex, "72")
    assert extract_answer("#### 1,234") == "1234"


def test_gsm8k_trains_on_the_engines_results_and_leaves_out_calls_it_cannot_compute(tmp_path):
    """GSM8K's hand-written results ("144.00", ".4", "3/4": openai/gsm8k's own records) become the text the engine
    injects for their call at inference, worked out by hand: 8*18 = 144, 2*20*.01 = 0.4, 3/4 = 0.75. An
    annotation the engine cannot compute ("2**3": a power) is left out, call and result, its text around it
    joined; the record still loads (one odd record never fails a hub dataset) and still has its answer."""
    answer = (
        "8*18 = <<8*18=144.00>>144.00 and 2*20*.01 = <<2*20*.01=.4>>.4 and 3/4 = <<3/4=3/4>>3/4 of it.\n"
        "2**3 = <<2**3=8>>8 apples.\n#### 8"
    )
    (tmp_path / "train.jsonl").write_text(json.dumps({"question": "q", "answer": answer}) + "\n")
    ex = GSM8K(tmp_path / "train.jsonl")[0]
    assert ex["answer"] == "8"
    assert ex["messages"][1]["content"] == [
        {"type": "text", "text": "8*18 = "},
        {"type": "python", "text": "8*18"},
        {"type": "python_output", "text": "144"},
        {"type": "text", "text": "144.00 and 2*20*.01 = "},
        {"type": "python", "text": "2*20*.01"},
        {"type": "python_output", "text": "0.4"},
        {"type": "text", "text": ".4 and 3/4 = "},
        {"type": "python", "text": "3/4"},
        {"type": "python_output", "text": "0.75"},
        {"type": "text", "text": "3/4 of it.\n2**3 = 8 apples.\n#### 8"},
    ]
    assert conversation_error(ex["messages"]) is None  # what a user's file is checked with accepts it


def test_multiple_choice_mmlu_parquet_and_arc_jsonl(tmp_path):
    pq.write_table(
        pa.table(
            {"question": ["2+2?"], "subject": ["math"], "choices": [["3", "4", "5", "6"]], "answer": [1]}
        ),
        tmp_path / "mmlu.parquet",
    )
    mmlu = MultipleChoice(tmp_path / "mmlu.parquet", format="mmlu")
    ex = mmlu[0]
    assert mmlu.eval_type == "categorical" and ex["letters"] == ["A", "B", "C", "D"] and ex["answer"] == "B"
    assert ex["messages"][0]["content"] == (
        "Multiple Choice question: 2+2?\n- 3=A\n- 4=B\n- 5=C\n- 6=D\nRespond only with the letter of the correct answer."
    )
    assert mmlu.is_correct(ex, "B") and not mmlu.is_correct(ex, "A")
    arc = {
        "id": "Mercury_1",
        "question": "Which is red?",
        "choices": {"text": ["Mars", "Venus", "Earth"], "label": ["1", "2", "3"]},
        "answerKey": "1",
    }
    (tmp_path / "arc.jsonl").write_text(json.dumps(arc) + "\n")
    t = MultipleChoice(tmp_path / "arc.jsonl", format="arc")
    assert t[0]["letters"] == ["1", "2", "3"] and t[0]["answer"] == "1"
    with pytest.raises(ValueError, match="format must be one of"):
        MultipleChoice(tmp_path / "arc.jsonl", format="hellaswag")


def test_hub_task_errors_name_the_file_and_line_not_the_shuffled_index(tmp_path):
    """GSM8K, MMLU and ARC said `gsm8k record 7` where 7 was the index in the seeded order, which names no line
    of any file. Every record is now checked when the task is read, as SmolTalk's are (located_records with a
    check): the first bad record in file order whatever its fault, by file and line (JSON lines, 1-based) or
    row (parquet, 0-based) whatever the seed, with how many records are bad. A bad answer was found only when
    its record was used, and without a count."""
    gsm = tmp_path / "gsm8k.jsonl"
    rows = [GSM8K_ROW] * 3 + [{**GSM8K_ROW, "answer": "72 clips"}] + [GSM8K_ROW] * 2 + [{"question": "q"}]
    gsm.write_text("".join(json.dumps(r) + "\n" for r in [*rows, GSM8K_ROW]))
    with pytest.raises(ValueError) as e:  # line 7's missing column is counted, line 4 named
        GSM8K(gsm, seed=1)
    assert str(e.value) == f"{gsm} line 4: answer has no final '#### <number>' (2 of 8 records are bad)"

    mmlu = tmp_path / "mmlu.parquet"
    answers = [0, 1, 2, 3, 4, 1]  # row 4's answer is past the 4 choices
    pq.write_table(pa.table({"question": [f"q{i}" for i in range(6)], "choices": [["a", "b", "c", "d"]] * 6,
                             "answer": answers}), mmlu)  # fmt: skip
    with pytest.raises(ValueError) as e:
        MultipleChoice(mmlu, format="mmlu", seed=3)
    assert (
        str(e.value)
        == f"{mmlu} row 4: answer 4 is not the index of one of the 4 choices (0..3) (1 of 6 records is bad)"
    )
    for choices, said in (
        (None, "None"),
        (list("abcdefghijk"), str(list("abcdefghijk"))),
        ([1, 2], "[1, 2]"),
    ):
        bad = {"question": "q", "choices": choices, "answer": 0}  # a TypeError or a letter past J before
        (tmp_path / "mmlu.jsonl").write_text(json.dumps(bad) + "\n")
        with pytest.raises(ValueError) as e:
            MultipleChoice(tmp_path / "mmlu.jsonl", format="mmlu")
        expected = f"line 1: choices {said} are not a list of 1..10 strings (1 of 1 records is bad)"
        assert str(e.value) == f"{tmp_path / 'mmlu.jsonl'} {expected}"

    arc = {
        "question": "Which is red?",
        "choices": {"text": ["Mars", "Venus"], "label": ["A", "B"]},
        "answerKey": "A",
    }
    (tmp_path / "arc").mkdir()
    first, second = tmp_path / "arc" / "a.jsonl", tmp_path / "arc" / "b.jsonl"
    first.write_text(json.dumps(arc) + "\n")
    second.write_text("\n" + json.dumps(arc) + "\n" + json.dumps({**arc, "answerKey": "C"}) + "\n")
    with pytest.raises(ValueError) as e:
        MultipleChoice(tmp_path / "arc", format="arc", seed=0)
    assert str(e.value) == f"{second} line 3: answerKey 'C' not in labels ['A', 'B'] (1 of 3 records is bad)"
    third = tmp_path / "arc" / "c.jsonl"
    third.write_text(json.dumps({"question": "q", "choices": arc["choices"]}) + "\n")
    with pytest.raises(
        ValueError
    ) as e:  # b.jsonl comes first, whatever the fault: a column was checked first
        MultipleChoice(tmp_path / "arc", format="arc", seed=0)
    assert str(e.value) == f"{second} line 3: answerKey 'C' not in labels ['A', 'B'] (2 of 4 records are bad)"
    second.write_text("\n" + json.dumps(arc) + "\n" + json.dumps({**arc, "answerKey": "B"}) + "\n")
    with pytest.raises(ValueError) as e:
        MultipleChoice(tmp_path / "arc", format="arc", seed=0)
    assert str(e.value) == (
        f"{third} line 1: lacks column(s) ['answerKey']; expected ['question', 'choices', 'answerKey'] (1 of 4 "
        "records is bad)"
    )
    third.unlink()
    for choices, message in [
        ({"text": ["Mars", "Venus"]}, "choices lacks field(s) ['label']"),
        ({"label": ["A", "B"]}, "choices lacks field(s) ['text']"),
        (["Mars", "Venus"], "choices is a list"),
        ({"text": "Mars", "label": "A"}, "choices' text and label must be lists"),
    ]:  # each was a KeyError or TypeError naming no file (or, a string, a wrong prompt)
        second.write_text(json.dumps(arc) + "\n\n" + json.dumps({**arc, "choices": choices}) + "\n")
        with pytest.raises(ValueError) as e:
            MultipleChoice(tmp_path / "arc", format="arc", seed=0)
        assert str(e.value) == (
            f'{second} line 3: {message}; expected {{"text": [...], "label": [...]}} (1 of 3 records is bad)'
        )
    second.write_text(json.dumps({**arc, "choices": {"text": ["Mars", "Venus"], "label": ["A"]}}) + "\n")
    with pytest.raises(ValueError) as e:  # was: Venus silently dropped from the prompt
        MultipleChoice(tmp_path / "arc", format="arc", seed=0)
    assert str(e.value) == (
        f"{second} line 1: choices has 2 texts and 1 label; one label per text (1 of 2 records is bad)"
    )
    second.write_text(json.dumps(arc) + "\n[1]\n")  # a line that is no object is one more bad record
    assert len(MultipleChoice(first, format="arc")) == 1
    with pytest.raises(ValueError) as e:
        MultipleChoice(tmp_path / "arc", format="arc", seed=0)
    assert (
        str(e.value) == f"{second} line 2: each line is one JSON object, got a list (1 of 3 records is bad)"
    )
    pq.write_table(pa.table({"question": ["q", "q"], "answerKey": ["A", "A"],
                             "choices": [arc["choices"], {"text": ["Mars"], "label": None}]}), tmp_path / "arc.parquet")  # fmt: skip
    with pytest.raises(ValueError) as e:  # parquet: the row, 0-based
        MultipleChoice(tmp_path / "arc.parquet", format="arc")
    assert str(e.value) == (
        f"{tmp_path / 'arc.parquet'} row 1: choices' text and label must be lists; "
        'expected {"text": [...], "label": [...]} (1 of 2 records is bad)'
    )
    nested = [{"train": {"question": "q", "choices": ["a", "b"], "answer": 0}}, {"train": {"question": "q"}},
              {"train": {"question": "q", "choices": ["a"], "answer": 1}}]  # fmt: skip
    (tmp_path / "aux.jsonl").write_text("".join(json.dumps(r) + "\n" for r in nested))
    with pytest.raises(ValueError) as e:  # cais/mmlu's auxiliary_train rows, nested in `train`
        MultipleChoice(tmp_path / "aux.jsonl", format="mmlu", seed=5)
    assert str(e.value) == (
        f"{tmp_path / 'aux.jsonl'} line 2: lacks column(s) ['choices', 'answer']; expected ['question', "
        "'choices', 'answer'] (2 of 3 records are bad)"
    )
    (tmp_path / "aux.jsonl").write_text(json.dumps(nested[0]) + "\n")
    (good,) = MultipleChoice(tmp_path / "aux.jsonl", format="mmlu")
    assert good["answer"] == "A" and good["letters"] == ["A", "B"]


HUMANEVAL_ROW = {
    "task_id": "HumanEval/0",
    "prompt": 'def add(a, b):\n    """a + b"""\n',
    "canonical_solution": "    return a + b\n",
    "test": "\n\nMETADATA = {}\n\n\ndef check(candidate):\n    assert candidate(2, 3) == 5\n",
    "entry_point": "add",
}


def test_humaneval_records_are_checked_as_they_are_read(tmp_path):
    """HumanEval's records were not checked: a null prompt was a TypeError while its example was built, and an
    entry_point that is no name or a test without check(candidate) made every program fail, scoring each
    completion 0 without a word. As GSM8K's, MMLU's and ARC's: the first bad record in file order, its field
    and what is allowed, and how many records are bad."""
    path = tmp_path / "test.jsonl"
    rows = [HUMANEVAL_ROW, {**HUMANEVAL_ROW, "entry_point": "add numbers"}, HUMANEVAL_ROW,
            {**HUMANEVAL_ROW, "test": "assert True\n"}, {**HUMANEVAL_ROW, "prompt": None}]  # fmt: skip
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    with pytest.raises(ValueError) as e:  # line 2 named whatever the seed; lines 4 and 5 counted
        HumanEval(path, seed=3)
    assert str(e.value) == (
        f"{path} line 2: entry_point 'add numbers' is not a Python identifier (the program calls "
        "check(<entry_point>)) (3 of 5 records are bad)"
    )
    nested = "def helper():\n    def check(candidate):\n        pass\n"  # no top-level check(): a NameError
    for bad, fault in [
        ({"prompt": None}, "prompt must be a string, got null"),
        ({"task_id": 0}, "task_id must be a string, got int"),
        ({"canonical_solution": ["    return a + b"]}, "canonical_solution must be a string, got list"),
        ({"entry_point": "def"}, "entry_point 'def' is not a Python identifier (the program calls "
                                 "check(<entry_point>))"),
        ({"test": nested}, "test defines no check(candidate) at its top level (the program calls "
                           "check(<entry_point>))"),
    ]:  # fmt: skip
        path.write_text(json.dumps(HUMANEVAL_ROW) + "\n" + json.dumps({**HUMANEVAL_ROW, **bad}) + "\n")
        with pytest.raises(ValueError) as e:
            HumanEval(path)
        assert str(e.value) == f"{path} line 2: {fault} (1 of 2 records is bad)"
    path.write_text(json.dumps({k: v for k, v in HUMANEVAL_ROW.items() if k != "test"}) + "\n")
    with pytest.raises(ValueError) as e:
        HumanEval(path)
    assert str(e.value) == (
        f"{path} line 1: lacks column(s) ['test']; expected ['task_id', 'prompt', 'canonical_solution', 'test', "
        "'entry_point'] (1 of 1 records is bad)"
    )
    parquet = tmp_path / "test-00000-of-00001.parquet"
    pq.write_table(pa.Table.from_pylist([HUMANEVAL_ROW, {**HUMANEVAL_ROW, "entry_point": None}]), parquet)
    with pytest.raises(ValueError) as e:  # parquet: the row, 0-based
        HumanEval(parquet)
    assert str(e.value) == f"{parquet} row 1: entry_point must be a string, got null (1 of 2 records is bad)"
    pq.write_table(
        pa.Table.from_pylist([HUMANEVAL_ROW, {**HUMANEVAL_ROW, "task_id": "HumanEval/1"}]), parquet
    )
    task = HumanEval(parquet)
    assert [task[i]["id"] for i in range(2)] == ["HumanEval/0", "HumanEval/1"]
    assert task[0]["entry_point"] == "add" and task[0]["test"] == HUMANEVAL_ROW["test"]


def test_mixture_report_shares(small_tokenizer):
    a, b = Numbers("a", 3), Numbers("b", 1)
    report = mixture_report(small_tokenizer, TaskMixture([a, b], seed=0))
    lens = {
        name: [len(render_conversation(small_tokenizer, t[i])) for i in range(len(t))]
        for name, t in (("a", a), ("b", b))
    }
    total = sum(map(sum, lens.values()))
    assert report["sources"]["a"]["sample_share"] == pytest.approx(0.75)
    assert report["sources"]["b"]["token_share"] == pytest.approx(sum(lens["b"]) / total)
    assert report["tokens"] == total
    assert "token-level" in report["loss_normalization"]


def test_the_names_task_specs_are_checked_against_are_the_registrys():
    """The configs check --sft-tasks / --tasks against TASK_NAMES without importing the tasks."""
    assert TASK_NAMES == tuple(TASKS)
    # eval's --tasks: those with a held-out split and a checker (not chatterbot, smoltalk)
    assert EVAL_TASK_NAMES == tuple(n for n in TASK_NAMES if held_out(n) and graded(n))
    # `raychat submit`'s task data note (raychat.commands.task_data_note): the tasks that read no files
    assert set(TASK_NAMES) - set(LOCAL_TASKS) == set(HUB_TASKS)
    assert set(LOCAL_TASKS) < set(TASK_NAMES)
    assert parse_mixture(" calculator : 5 ,spelling,, calculator") == [
        ("calculator", 5), ("spelling", None), ("calculator", None)
    ]  # fmt: skip


def test_hub_task_fields_that_are_no_string_are_refused_as_they_are_read(tmp_path):
    """A null question (GSM8K, MMLU, ARC) was read, and failed only when rendered, after Ray started ("message
    0 (user): content must be a string, got NoneType", naming no file); a null ARC choice was rendered as
    "- None=A"; integer ARC labels and answerKey loaded, and no reply was ever correct (a reply is a str)."""
    f = tmp_path / "records.jsonl"
    gsm = [GSM8K_ROW, {**GSM8K_ROW, "question": None}]
    f.write_text("".join(json.dumps(r) + "\n" for r in gsm))
    with pytest.raises(ValueError) as e:
        GSM8K(f)
    assert str(e.value) == f"{f} line 2: question must be a string, got NoneType (1 of 2 records is bad)"

    mmlu = {"question": "2+2?", "choices": ["3", "4"], "answer": 1}
    f.write_text(json.dumps(mmlu) + "\n" + json.dumps({"train": {**mmlu, "question": 4}}) + "\n")
    with pytest.raises(ValueError) as e:
        MultipleChoice(f, format="mmlu")
    assert str(e.value) == f"{f} line 2: question must be a string, got int (1 of 2 records is bad)"

    arc = {
        "question": "Which is red?",
        "choices": {"text": ["Mars", "Venus"], "label": ["A", "B"]},
        "answerKey": "A",
    }
    for bad, said in [
        ({"question": None}, "question must be a string, got NoneType"),
        ({"choices": {"text": ["Mars", None], "label": ["A", "B"]}}, "choices.text[1] must be a string, got NoneType"),
        ({"choices": {"text": ["Mars", "Venus"], "label": [1, 2]}, "answerKey": 1},
         "choices.label[0] must be a string, got int"),
        ({"answerKey": 0}, "answerKey must be a string, got int"),
    ]:  # fmt: skip
        f.write_text(json.dumps(arc) + "\n" + json.dumps({**arc, **bad}) + "\n" + json.dumps(arc) + "\n")
        with pytest.raises(ValueError) as e:
            MultipleChoice(f, format="arc")
        assert str(e.value) == f"{f} line 2: {said} (1 of 3 records is bad)"
