"""The real tasks in the registry (hub file layouts, one-line errors) and the report card: categorical and
generative scores, ChatCORE and the table, worked out by hand on tiny files and tiny models."""

import json
from importlib.metadata import entry_points

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from lm_eval.api.metrics import mean_stderr as lm_eval_mean_stderr
from support.engine_fixtures import byte_tokenizer, scripted_model

from raychat.chat_template import render_conversation, render_for_completion
from raychat.checkpoint import load_model
from raychat.config import EvalConfig, from_dict
from raychat.eval.cli import task_scores
from raychat.eval.report_card import (
    LEGEND,
    NEEDS_ALL,
    NO_DATA,
    SAMPLED,
    accuracy_cell,
    card_row,
    cell,
    chat_cells,
    chatcore,
    checkpoint_row,
    format_markdown,
    measured_line,
    no_data_lines,
)
from raychat.eval.tasks import (
    accuracy_stderr,
    mean_stderr,
    prompt_messages,
    task_budget,
    task_pass_at_k,
)
from raychat.model import eval_mode
from raychat.tasks.calculator import Calculator
from raychat.tasks.hub_data import HUB_SPLITS, download_command
from raychat.tasks.registry import check_data, make_task, mixture_tasks, parse_mixture


def write_parquet(path, rows):
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.Table.from_pylist(rows), path)


def arc_row(i, key):
    return {"id": f"q{i}", "question": f"Question {i}?",
            "choices": {"text": ["red", "blue", "green", "gray"], "label": ["A", "B", "C", "D"]},
            "answerKey": key}  # fmt: skip


@pytest.fixture
def data_dir(tmp_path):
    """arc-easy in the hub repo's layout (parquet), gsm8k in nanochat's cache layout, mmlu's test as jsonl."""
    write_parquet(tmp_path / "ai2_arc/ARC-Easy/test-00000-of-00001.parquet",
                  [arc_row(0, "B"), arc_row(1, "C"), arc_row(2, "B")])  # fmt: skip
    gsm = [
        {"question": "What is 47 * 12?", "answer": "Multiply: <<47*12=564>>564\n#### 564"},
        {"question": "Tell me a story.", "answer": "#### 3"},
    ]
    write_parquet(tmp_path / "openai--gsm8k/main/test/00000.parquet", gsm)
    write_parquet(tmp_path / "openai--gsm8k/main/train/00000.parquet", gsm)
    mmlu = [{"question": "2 + 2?", "choices": ["3", "4", "5", "6"], "answer": 1, "subject": "math"}]
    (tmp_path / "mmlu/all").mkdir(parents=True)
    (tmp_path / "mmlu/all/test.jsonl").write_text(json.dumps(mmlu[0]) + "\n")
    return tmp_path


def test_the_registry_reads_both_hub_layouts(data_dir):
    arc = make_task("arc-easy", "test", None, 0, data_dir=str(data_dir))
    assert arc.name == "arc-easy" and arc.eval_type == "categorical" and len(arc) == 3
    assert sorted(arc[i]["answer"] for i in range(3)) == ["B", "B", "C"]  # seeded order, same items
    gsm = make_task("gsm8k", "test", 1, 0, data_dir=str(data_dir))
    assert len(gsm) == 1 and gsm[0]["answer"] in ("564", "3")
    mmlu = make_task("mmlu", "test", None, 0, data_dir=str(data_dir))
    assert mmlu[0]["answer"] == "B" and mmlu[0]["letters"] == ["A", "B", "C", "D"]
    # an SFT mixture naming hub tasks, a task twice = two epochs
    assert parse_mixture("gsm8k,gsm8k,calculator:3") == [("gsm8k", None), ("gsm8k", None), ("calculator", 3)]
    assert [len(t) for t in mixture_tasks("gsm8k,gsm8k,calculator:3", "train", 0, str(data_dir))] == [2, 2, 3]


def test_the_download_command_is_the_installed_hf_cli(tmp_path):
    """The speedrun's report card printed `huggingface-cli download ...` for each missing hub repo: the pinned
    huggingface_hub (2.x) has no huggingface-cli (removed in 1.0), only `hf`, installed beside raychat."""
    scripts = {e.name: e.value for e in entry_points(group="console_scripts")}
    assert scripts["hf"].startswith("huggingface_hub.") and "huggingface-cli" not in scripts
    assert download_command(HUB_SPLITS[("arc-easy", "test")], tmp_path) == (
        f"hf download allenai/ai2_arc --repo-type dataset --local-dir {tmp_path}/ai2_arc"
    )


def test_a_missing_file_is_one_line_naming_it(data_dir, monkeypatch):
    with pytest.raises(FileNotFoundError) as e:
        make_task("arc-challenge", "test", None, 0, data_dir=str(data_dir))
    message = str(e.value)
    assert "\n" not in message and f"{data_dir}/ai2_arc/ARC-Challenge/test-*.parquet" in message
    assert "hf download allenai/ai2_arc" in message
    with pytest.raises(ValueError, match=r"^--sft-tasks: task 'smoltalk' \(train split\): no data file at"):
        check_data(["smoltalk"], ("train",), str(data_dir))
    with pytest.raises(ValueError, match="humaneval' has no train split"):
        check_data(["humaneval"], ("train",), str(data_dir))
    monkeypatch.setenv("RAYCHAT_TASK_DATA", str(data_dir))  # the env default
    assert len(make_task("arc-easy", "test")) == 3


def test_bad_rows_are_one_clear_error(tmp_path):
    write_parquet(tmp_path / "mmlu/all/test-00000-of-00001.parquet",
                  [{"question": "q", "choices": ["a", "b"], "answer": 3, "subject": "s"}])  # fmt: skip
    with pytest.raises(ValueError) as e:  # when the task is read, not when the record is used
        make_task("mmlu", "test", None, 0, data_dir=str(tmp_path))
    assert str(e.value) == (
        f"{tmp_path}/mmlu/all/test-00000-of-00001.parquet row 0: answer 3 is not the index of one of the 2 choices "
        "(0..1) (1 of 1 records is bad)"
    )
    (tmp_path / "gsm8k/main").mkdir(parents=True)
    (tmp_path / "gsm8k/main/test.jsonl").write_text("")
    with pytest.raises(ValueError, match="no records"):
        make_task("gsm8k", "test", None, 0, data_dir=str(tmp_path))


class LetterModel(torch.nn.Module):
    """Logits that always rank token `favorite` first, then `second`: a model whose choice is known."""

    def __init__(self, vocab: int, favorite: int, second: int):
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros(vocab))
        with torch.no_grad():
            self.w[favorite], self.w[second] = 2.0, 1.0

    def forward(self, ids):
        return self.w.expand(ids.shape[0], ids.shape[1], -1)


def test_categorical_scores_by_hand(data_dir, small_tokenizer):
    letter = {c: small_tokenizer.encode(c)[0] for c in "ABCD"}
    model = LetterModel(small_tokenizer.vocab_size, letter["B"], letter["C"])
    cells = chat_cells(model, small_tokenizer, str(data_dir), columns=("ARC-Easy", "MMLU", "ARC-Challenge"))
    # answers B, C, B; the model says B: 2 of 3, standard error sqrt(2/3 * 1/3 / 2) = 1/3 (lm_eval's acc_stderr)
    assert cells["ARC-Easy"] == {"value": 2 / 3, "note": None, "examples": 3, "stderr": pytest.approx(1 / 3)}
    assert cells["MMLU"] == cell(1.0, examples=1)  # the answer is B; one item: no standard error
    assert cells["ARC-Challenge"] == cell(note=NO_DATA)
    # the letters restrict the choice: an item whose letters exclude B gets C (the model's second choice)
    write_parquet(data_dir / "ai2_arc/ARC-Challenge/test-00000-of-00001.parquet",
                  [{**arc_row(0, "C"), "choices": {"text": ["x", "y"], "label": ["C", "D"]}}])  # fmt: skip
    assert chat_cells(model, small_tokenizer, str(data_dir), columns=("ARC-Challenge",))["ARC-Challenge"][
        "value"
    ] == pytest.approx(1.0)


def test_sampling_asked_of_categorical_tasks_says_they_are_measured_greedily(
    data_dir, small_tokenizer, capsys
):
    """`raychat eval --tasks mmlu,arc-easy --samples 4 --temperature 0.8` scored both greedily without a word."""
    letter = {c: small_tokenizer.encode(c)[0] for c in "ABCD"}
    model = LetterModel(small_tokenizer.vocab_size, letter["B"], letter["C"])
    tasks = [("mmlu", None), ("arc-easy", None)]
    values = {"task_data_dir": str(data_dir), "tasks": "mmlu,arc-easy", "samples": 4, "temperature": 0.8}
    accuracy, chat = task_scores(model, small_tokenizer, tasks, from_dict(EvalConfig, values), (False, None))
    assert capsys.readouterr().err.splitlines()[0] == (
        "eval: mmlu, arc-easy measured greedily, as accuracy: a categorical task's answer is the letter with the "
        "highest logit, with no completion to sample (--samples 4 --temperature 0.8 sample the generative tasks "
        "only)"
    )
    # as test_categorical_scores_by_hand: MMLU's answer is B, ARC-Easy's B, C, B; greedy, so on the card
    assert accuracy["mmlu"] == {"accuracy": 1.0, "stderr": None, "examples": 1, "max_tokens": None}
    assert accuracy["arc-easy"] == {"accuracy": 2 / 3, "stderr": pytest.approx(1 / 3), "examples": 3,
                                    "max_tokens": None}  # fmt: skip
    assert chat == {"MMLU": cell(1.0, examples=1), "ARC-Easy": accuracy_cell(2 / 3, 3)}
    greedy = from_dict(EvalConfig, {"task_data_dir": str(data_dir), "tasks": "mmlu,arc-easy"})
    task_scores(model, small_tokenizer, tasks, greedy, (False, None))
    assert "measured greedily" not in capsys.readouterr().err  # nothing asked for sampling


@pytest.mark.parametrize("scores", [[1, 0, 0], [1, 1, 0, 0, 1, 0, 0, 0], [1] * 5, [0, 1]])
def test_an_accuracys_standard_error_is_lm_evals_acc_stderr(scores):
    """lm-evaluation-harness's mean_stderr of the same 0/1 item scores (1/3 at 1 of 3, as its table prints)."""
    assert accuracy_stderr(sum(scores) / len(scores), len(scores)) == pytest.approx(
        lm_eval_mean_stderr(scores)
    )
    assert accuracy_stderr(1.0, 1) is None  # one item: lm_eval's stderr is N/A


def test_gsm8k_generative_with_the_calculator(data_dir, tool_checkpoint):
    model, tokenizer, _ = load_model(tool_checkpoint)
    cells = chat_cells(model, tokenizer, str(data_dir), columns=("GSM8K",), max_tokens=40)
    # item 1: the model calls the calculator and ends with #### 564 (correct); item 2: it tells its story
    assert cells["GSM8K"] == cell(0.5, examples=2, max_tokens=40, stderr=0.5)  # sqrt(0.5 * 0.5 / 1)


def test_each_measured_line_names_the_stage_and_checkpoint_it_scored(data_dir, tool_checkpoint):
    """The speedrun logged `report card: SpellingBee 0.0000 (...)` after SFT and again after RL, two lines that
    read as one printed twice; each now names the stage and the checkpoint it scored."""
    assert measured_line("sft", "/r/sft/checkpoint_000002", "SpellingBee", cell(0.0, examples=256), 1.26) == (
        "report card, sft checkpoint /r/sft/checkpoint_000002: SpellingBee 0.0000 (256 items, 1.3 s)"
    )
    assert measured_line("", "/r/c", "MMLU", cell(2 / 3, examples=3), 0.04) == (
        "report card, checkpoint /r/c: MMLU 0.6667 (3 items, 0.0 s)"
    )
    # with its standard error: 16 of 256, sqrt(0.0625 * 0.9375 / 255) = 0.01516
    assert measured_line("rl", "/r/c", "spelling", accuracy_cell(16 / 256, 256), 2.0, what="eval") == (
        "eval, rl checkpoint /r/c: spelling 0.0625 ± 0.0152 (256 items, 2.0 s)"
    )
    lines = []
    row = checkpoint_row(tool_checkpoint, True, str(data_dir), max_problems=1, log=lines.append, stage="rl")
    measured = ("ARC-Easy", "MMLU", "GSM8K", "SpellingBee")  # the columns with data here, in the card's order
    assert [line.split(": ")[0] for line in lines] == [f"report card, rl checkpoint {tool_checkpoint}"] * 4
    assert [line.split(": ")[1].split(" ")[0] for line in lines] == list(measured)
    assert all(f" {row[c]['value']:.4f} (1 item, " in line for c, line in zip(measured, lines))


LONG_SOLUTION = (
    "First add 20 and 22 to get the sum, then check it twice by counting up from 20. " * 2 + "#### 42"
)


def gold_model(tokenizer, conversation):
    """A model that writes the gold reply of `conversation` (its rendered tokens, tool output included)."""
    ids = render_conversation(tokenizer, conversation).ids
    return scripted_model(
        tokenizer.vocab_size, dict(enumerate(ids)), tokenizer.special_id("<|assistant_end|>"), 1024
    )


def test_a_long_gold_answer_scores_the_same_from_tasks_and_from_chatcore(tmp_path):
    """`--tasks gsm8k,chatcore` filled the GSM8K cell at 48 tokens, `--tasks chatcore` at 512: a model writing
    a 168-token gold solution scored 0 one way and 1 the other. Now both use the task's own budget (512),
    recorded in the cell; --max-tokens given applies to every task and shows in the table."""
    write_parquet(tmp_path / "openai--gsm8k/main/test/00000.parquet",
                  [{"question": "What is 20 + 22?", "answer": LONG_SOLUTION}])  # fmt: skip
    tok = byte_tokenizer()
    item = make_task("gsm8k", "test", None, 0, data_dir=str(tmp_path))[0]
    gold = len(render_conversation(tok, item).ids) - len(render_for_completion(tok, prompt_messages(item)))
    assert gold == 168 and task_budget("gsm8k") == 512
    model = gold_model(tok, item)
    cfg = from_dict(EvalConfig, {"task_data_dir": str(tmp_path), "tasks": "gsm8k,chatcore:1"})
    accuracy, chat = task_scores(model, tok, [("gsm8k", None)], cfg, (True, 1))
    assert accuracy == {"gsm8k": {"accuracy": 1.0, "stderr": None, "examples": 1, "max_tokens": 512}}
    _, alone = task_scores(model, tok, [], cfg, (True, 1))  # --tasks chatcore
    assert chat["GSM8K"] == alone["GSM8K"] == cell(1.0, examples=1, max_tokens=512)
    assert chat["ARC-Easy"] == cell(note=NO_DATA)  # categorical cells carry no budget
    cut = from_dict(EvalConfig, {"task_data_dir": str(tmp_path), "tasks": "gsm8k", "max_tokens": 48})
    accuracy, chat = task_scores(model, tok, [("gsm8k", None)], cut, (True, 1))
    assert accuracy["gsm8k"] == {"accuracy": 0.0, "stderr": None, "examples": 1, "max_tokens": 48}
    assert chat["GSM8K"] == cell(0.0, examples=1, max_tokens=48)
    line = format_markdown({"sft": card_row(None, chat)}).splitlines()[2]
    assert line.split(" | ")[5] == "0.0000 (48 tok)"  # not the task's own budget: said in the table
    assert format_markdown({"sft": card_row(None, alone)}).splitlines()[2].split(" | ")[5] == "1.0000"


def test_a_sampled_score_is_kept_off_the_greedy_card_under_its_own_note(tmp_path):
    """`raychat eval --tasks gsm8k --samples 2 --temperature T` left the GSM8K cell `-`, which the legend read as
    "not measured at this stage" (of a chat checkpoint, whose chat evals the card does measure). The cell now
    reads "n/a: sampled", the legend says what each note means, and chatcore still measures the column greedily."""
    write_parquet(tmp_path / "openai--gsm8k/main/test/00000.parquet",
                  [{"question": "What is 2 + 2?", "answer": "#### 4"}])  # fmt: skip
    tok = byte_tokenizer()
    model = gold_model(tok, make_task("gsm8k", "test", None, 0, data_dir=str(tmp_path))[0])
    cfg = from_dict(
        EvalConfig, {"task_data_dir": str(tmp_path), "tasks": "gsm8k", "samples": 2, "temperature": 0.01}
    )  # logit 10 at 0.01: the gold token at every draw
    accuracy, chat = task_scores(model, tok, [("gsm8k", None)], cfg, (False, None))
    assert accuracy["gsm8k"]["pass@k"] == {"pass@1": 1.0, "pass@2": 1.0}
    assert chat == {"GSM8K": cell(note=SAMPLED)} and SAMPLED == "n/a: sampled"
    table = format_markdown({"sft": card_row(None, chat)}).splitlines()
    assert table[2] == "| sft | - | - | - | - | n/a: sampled | - | - | n/a: needs all six |"
    assert table[-1] == (
        "-: not measured (the speedrun: CORE on the base model, chat evals on chat models; raychat eval: the "
        "columns --tasks names); n/a: no data: the files are not on this machine (README: nanochat's full "
        "report card); n/a: sampled: scored by sampling (--temperature above 0), kept off this greedy card "
        "(eval.json's tasks hold it); n/a: needs all six: ChatCORE averages all six chat evals; (N tok): "
        "measured at a completion budget of N tokens, not the task's own."
    )
    _, greedy = task_scores(model, tok, [("gsm8k", None)], cfg, (True, 1))
    assert greedy["GSM8K"] == cell(1.0, examples=1, max_tokens=512)


def test_the_local_tasks_budgets_hold_every_gold_answer_at_one_token_per_byte():
    """SpellingBee's old 64 tokens cut 4 of 500 gold answers with a 512-vocab tokenizer (48: 188); every answer
    of spelling and calculator fits its own budget even at one token per byte (any BPE is shorter)."""
    tok = byte_tokenizer()
    for name in ("spelling", "calculator"):
        task = make_task(name, "test", 1000, 0)
        longest = max(len(render_conversation(tok, task[i]).ids) - len(render_for_completion(tok, prompt_messages(
            task[i]))) for i in range(len(task)))  # fmt: skip
        assert longest == {"spelling": 73, "calculator": 50}[name] and longest < task_budget(name) == 128


def test_chatcore_and_the_table_by_hand():
    values = {"ARC-Easy": 0.5, "ARC-Challenge": 0.25, "MMLU": 1.0, "GSM8K": 0.5, "HumanEval": 0.0,
              "SpellingBee": 1.0}  # fmt: skip
    chat = {c: cell(v, examples=4) for c, v in values.items()}
    # centered: (0.5-0.25)/0.75, 0, 1, 0.5, 0, 1 -> (1/3 + 0 + 1 + 0.5 + 0 + 1) / 6
    assert chatcore(chat)["value"] == pytest.approx((1 / 3 + 1 + 0.5 + 1) / 6)
    assert chatcore({**chat, "HumanEval": cell(note=NO_DATA)}) == cell(note=NEEDS_ALL)
    rows = {
        "base": card_row(cell(note=NO_DATA), wall_s=120.4, tokens_per_s=15321.7),
        "sft": card_row(None, {**chat, "MMLU": cell(note=NO_DATA)}, wall_s=30.0, tokens_per_s=None),
    }
    lines = format_markdown(rows).splitlines()
    assert lines[0] == ("| stage | CORE | ARC-Easy | ARC-Challenge | MMLU | GSM8K | HumanEval | SpellingBee | "
                        "ChatCORE | wall time (s) | tokens/s |")  # fmt: skip
    assert lines[2] == "| base | n/a: no data | - | - | - | - | - | - | - | 120 | 15,322 |"
    assert lines[3] == (
        "| sft | - | 0.5000 | 0.2500 | n/a: no data | 0.5000 | 0.0000 | 1.0000 | n/a: needs all six | 30 | n/a |"
    )
    # the speedrun's rl row puts rollout tokens/s in the column of training tokens/s: the legend says which is which
    assert lines[-1] == LEGEND + (
        " wall time (s): the stage's; tokens/s: its median step's, training tokens over all workers for "
        "pretraining (base) and SFT, completion tokens the rollout actors generated for RL."
    )
    assert (
        format_markdown({"sft": card_row(None, chat)}).splitlines()[-1] == LEGEND
    )  # raychat eval's: no times


def test_the_missing_chat_data_is_said_once_with_the_stages_that_wanted_it(tmp_path):
    no_data = {c: cell(note=NO_DATA) for c in ("ARC-Easy", "ARC-Challenge", "MMLU", "GSM8K", "HumanEval")}
    spelling = {"SpellingBee": cell(0.5, examples=4)}
    rows = {
        "base": card_row(cell(note=NO_DATA)),  # CORE's bundle is not a chat eval's file; "-" is no gap
        "sft": card_row(None, no_data | spelling),
        "rl": card_row(None, no_data | spelling),
    }
    get = f"hf download {{}} --repo-type dataset --local-dir {tmp_path}/{{}}"
    assert no_data_lines(rows, str(tmp_path)) == [
        "report card: n/a: no data for ARC-Easy, ARC-Challenge, MMLU, GSM8K, HumanEval (sft, rl); get their "
        f"files into the task data directory {tmp_path} (--task-data-dir or $RAYCHAT_TASK_DATA; layouts: "
        "raychat.tasks.hub_data):",
        "  ARC-Easy, ARC-Challenge: " + get.format("allenai/ai2_arc", "ai2_arc"),
        "  MMLU: " + get.format("cais/mmlu", "mmlu"),
        "  GSM8K: " + get.format("openai/gsm8k", "gsm8k"),
        "  HumanEval: " + get.format("openai/openai_humaneval", "openai_humaneval"),
    ]
    # stages that wanted different files are named per group; one stage (raychat eval) names none
    rows["rl"] = card_row(None, {"GSM8K": cell(note=NO_DATA), "SpellingBee": cell(note=NO_DATA)})
    assert no_data_lines(rows, str(tmp_path))[0].startswith(
        "report card: n/a: no data for ARC-Easy, ARC-Challenge, MMLU, HumanEval (sft); GSM8K (sft, rl); "
        "SpellingBee (rl); get their files"
    )
    assert no_data_lines({"eval": {"SpellingBee": cell(note=NO_DATA)}}, str(tmp_path)) == [
        f"report card: n/a: no data for SpellingBee; get their files into the task data directory {tmp_path} "
        "(--task-data-dir or $RAYCHAT_TASK_DATA; layouts: raychat.tasks.hub_data):",
        "  SpellingBee: /usr/share/dict/words: install the Debian package `wamerican`",
    ]
    assert no_data_lines({"sft": card_row(None, spelling)}, str(tmp_path)) == []


class GradedInOrder(Calculator):
    """Two calculator items whose completions are graded by a fixed list of verdicts, in the order the engine
    returns them (item 0's samples, then item 1's): the pass@k arithmetic is then known whatever is sampled."""

    def __init__(self, verdicts: list[bool]):
        super().__init__(split="test", size=2)
        self.verdicts = iter(verdicts)

    def is_correct(self, conversation, text):
        return next(self.verdicts)


def test_pass_at_k_of_sampled_completions_by_hand():
    """Item 0: 2 of 4 samples correct, item 1: none. pass@1 = (2/4 + 0) / 2 = 0.25; pass@2 = (1 - C(2,2)/C(4,2)
    + 0) / 2 = (5/6) / 2; pass@3 = pass@4 = (1 + 0) / 2 (fewer than k wrong samples: 1). The items' pass@1, 0.5
    and 0, have a standard error of sqrt(2 * 0.25**2 / 1 / 2) = 0.25."""
    tok = byte_tokenizer()
    model = scripted_model(tok.vocab_size, {}, tok.special_id("<|assistant_end|>"))
    task = GradedInOrder([True, False, False, True] + [False] * 4)
    passes, per_item = task_pass_at_k(model, tok, task, 2, samples=4, temperature=1.0, seed=0, max_tokens=4)
    assert passes == pytest.approx({"pass@1": 0.25, "pass@2": 5 / 12, "pass@3": 0.5, "pass@4": 0.5})
    assert per_item == [0.5, 0.0] and mean_stderr(per_item) == pytest.approx(0.25)
    assert mean_stderr(per_item) == pytest.approx(lm_eval_mean_stderr(per_item))
    assert mean_stderr([1.0, 0.0, 0.0]) == pytest.approx(accuracy_stderr(1 / 3, 3))  # 0/1 scores: the same


def test_scoring_leaves_the_model_in_the_mode_it_found_it_even_after_an_error():
    model = torch.nn.Linear(1, 1)  # in train mode
    with eval_mode(model):
        assert not model.training
    assert model.training
    with pytest.raises(RuntimeError, match="mid-scoring"), eval_mode(model):
        raise RuntimeError("mid-scoring")
    assert model.training
    model.eval()
    with eval_mode(model):
        pass
    assert not model.training
