"""A user's own conversations, in smoltalk's layout under --task-data-dir (README "Your own conversations"):
every record is checked as it is read, a bad one named by file, line (parquet: row) and field in one line; the
rows trained on hold exactly the assistant's tokens as targets; a tool turn renders at training as at serving."""

from __future__ import annotations

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from raychat.chat_template import render_conversation, render_for_completion
from raychat.config import TrainConfig, from_dict
from raychat.data.loader.sft_rows import SFTRows
from raychat.masks import make_batch
from raychat.serve.api import ChatRequest
from raychat.serve.openai_messages import template_messages
from raychat.speedrun import speedrun_flags
from raychat.tasks.registry import check_data, mixture_tasks
from raychat.train.sft import SFT, sft_defaults, validation_size

TOOL_TURN = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "1+2? 🎉"},
    {
        "role": "assistant",
        "content": [{"type": "text", "text": "Let me. "}, {"type": "python", "text": "1+2"}],
    },
    {"role": "tool", "content": "3"},
    {"role": "assistant", "content": "3 ✓"},
    {"role": "user", "content": ""},
    {"role": "assistant", "content": ""},
]


def write_jsonl(path, records) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records), encoding="utf-8")


def own_data(tmp_path, train, test=({"messages": TOOL_TURN},)):
    """tmp_path/task_data holding `train` and `test` as smoltalk's train.jsonl and test.jsonl."""
    d = tmp_path / "task_data" / "smol-smoltalk" / "data"
    write_jsonl(d / "train.jsonl", train)
    write_jsonl(d / "test.jsonl", test)
    return tmp_path / "task_data", d / "train.jsonl"


def test_a_tool_conversation_trains_on_exactly_its_assistant_tokens(tmp_path, small_tokenizer):
    tok = small_tokenizer
    data_dir, _ = own_data(tmp_path, [{"messages": TOOL_TURN}])
    check_data(["smoltalk"], ("train", "test"), str(data_dir))
    (task,) = mixture_tasks("smoltalk", "train", 0, str(data_dir))
    assert task[0]["messages"] == TOOL_TURN
    s = {n: tok.special_id(f"<|{n}|>") for n in ("bos", "user_start", "user_end", "assistant_start",
                                                   "assistant_end", "python_start", "python_end",
                                                   "output_start", "output_end")}  # fmt: skip
    enc = tok.encode
    # the template by hand (raychat.chat_template's docstring): the system text opens the first user turn
    ids = [s["bos"], s["user_start"], *enc("Be brief.\n\n"), *enc("1+2? 🎉"), s["user_end"], s["assistant_start"],
           *enc("Let me. "), s["python_start"], *enc("1+2"), s["python_end"],
           s["output_start"], *enc("3"), s["output_end"], *enc("3 ✓"), s["assistant_end"],
           s["user_start"], s["user_end"], s["assistant_start"], s["assistant_end"]]  # fmt: skip
    targets = [*enc("Let me. "), s["python_start"], *enc("1+2"), s["python_end"], *enc("3 ✓"),
               s["assistant_end"], s["assistant_end"]]  # fmt: skip
    rows = SFTRows([task], 0, tok, len(ids)).next_batch(1)
    assert rows["input_ids"][0].tolist() == ids
    batch = make_batch(
        *(torch.from_numpy(rows[k]) for k in ("input_ids",)), tok.bos_id,
        torch.from_numpy(rows["supervised"]), torch.from_numpy(rows["segment_ids"]), document_masking=True,
    )  # fmt: skip
    assert batch["input_ids"][0].tolist() == ids[:-1] and batch["labels"][0].tolist() == ids[1:]
    assert batch["labels"][0][batch["loss_mask"][0]].tolist() == targets


def test_a_tool_turn_renders_at_serving_as_at_training(small_tokenizer):
    """The OpenAI history of TOOL_TURN's first exchange (a client-run calculator call answered by a tool message)
    is the prompt the training ids begin with, up to the tool output the model continues after."""
    openai = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "1+2? 🎉"},
        {"role": "assistant", "content": "Let me. ", "tool_calls": [{"id": "c1", "type": "function", "function": {
            "name": "calculator", "arguments": json.dumps({"expression": "1+2"})}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "3"},
    ]  # fmt: skip
    served = render_for_completion(small_tokenizer, template_messages(ChatRequest(messages=openai).messages))
    trained = render_conversation(small_tokenizer, TOOL_TURN).ids
    assert served == trained[: len(served)] == render_for_completion(small_tokenizer, TOOL_TURN[:4])
    assert trained[len(served) - 1] == small_tokenizer.special_id("<|output_end|>")


def test_a_directory_of_jsonl_and_parquet_files(tmp_path):
    d = tmp_path / "smol-smoltalk" / "data"
    first = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}]
    second = [{"role": "user", "content": "ça va?"}, {"role": "assistant", "content": "oui"}]
    ends_with_user = [*first, {"role": "user", "content": "Bye"}]  # the last message is not supervised
    write_jsonl(d / "train-00000-of-00002.jsonl", [{"messages": first}, {"messages": ends_with_user}])
    windows = (d / "train-00000-of-00002.jsonl").read_text().replace("\n", "\r\n")
    (d / "train-00000-of-00002.jsonl").write_text("\ufeff" + windows, newline="")  # a byte order mark, CRLF
    pq.write_table(pa.table({"messages": [second]}), d / "train-00001-of-00002.parquet")
    (task,) = mixture_tasks("smoltalk", "train", 0, str(tmp_path))
    assert sorted(len(task[i]["messages"]) * task[i]["messages"][1]["content"] for i in range(len(task))) == [
        "HelloHello", "HelloHelloHello", "ouioui"
    ]  # fmt: skip


GOOD = {"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}]}
ROLES = "['system', 'user', 'assistant', 'tool']"
# a calculator call with no result right after it: the engine answers every call there at inference
# (raychat.engine.row_state forces <|output_start|> result <|output_end|> after <|python_end|>)
UNANSWERED = (
    "at inference the engine answers a call with its result right after it and the assistant goes on, so give the "
    'result right after the call, as the next message {"role": "tool", "content": RESULT} (or a {"type": '
    '"python_output", "text": RESULT} part), then the assistant\'s reply (1 of 3 records is bad)'
)
# a result with no call right before it: the engine gives one only as the answer of the call just made
NO_CALL = (
    "the engine gives a result only right after the call that asks for it, so put the call "
    '({"type": "python", "text": EXPR}) right before it, or leave the result out (1 of 3 records is bad)'
)

# a result that is not the text the engine injects for its call (raychat.calculator.calculate)
NOT_THE_ENGINES = "is not the engine's: at inference the engine answers that call with"
COMPUTED_FORMS = (
    "write the call as arithmetic it computes (integers and decimals, + - * / // %, parentheses, 1,000, or "
    "'word'.count('letters'))"
)
NEVER_GIVEN = (
    "is one the engine never gives: its calculator cannot compute that expression and answers nothing at inference, "
    f"so {COMPUTED_FORMS}, or leave the call and its result out (1 of 3 records is bad)"
)


@pytest.mark.parametrize(
    "record, error",
    [
        ({"messages": [{"role": "user", "content": "x"}, {"role": "bot", "content": "y"}]},
         f"messages[1]: role must be one of {ROLES}, got 'bot' (1 of 3 records is bad)"),
        ({"messages": [{"role": "user", "content": "x"}, {"role": "assistant"}]},
         "messages[1] lacks 'content' (a string; an assistant's may be a list of parts: [{\"type\": \"text\"|"
         "\"python\"|\"python_output\", \"text\": STR}, ...]) (1 of 3 records is bad)"),
        ({"messages": [{"content": "x"}, {"role": "assistant", "content": "y"}]},
         f"messages[0] lacks 'role' (one of {ROLES}) (1 of 3 records is bad)"),
        ({"messages": [{"role": "user", "content": "x"}, {"role": "assistant", "content": None}]},
         "messages[1] (assistant): content must be a string or a list of parts [{\"type\": \"text\"|\"python\"|"
         "\"python_output\", \"text\": STR}, ...], got NoneType (1 of 3 records is bad)"),
        ({"messages": [{"role": "assistant", "content": "x"}, {"role": "user", "content": "y"}]},
         "messages[0]: role 'assistant' not allowed at the start; allowed: ['system', 'user'] (1 of 3 records is bad)"),
        ({"messages": [{"role": "user", "content": "x"}, {"role": "assistant", "content": "y"},
                       {"role": "tool", "content": "1"}, {"role": "assistant", "content": "z"}]},
         "messages[2]: a 'tool' message must follow an assistant message ending in a python call (1 of 3 records "
         "is bad)"),
        ({"messages": [{"role": "user", "content": "x"}, {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c", "type": "function", "function": {"name": "calculator", "arguments": "{}"}}]}]},
         'messages[1].tool_calls: not read in training data; write the call as a content part {"type": "python", '
         '"text": EXPR} and its result as the next "tool" message (1 of 3 records is bad)'),
        ({"messages": [{"role": "user", "content": "x"}, {"role": "assistant", "content": [{"type": "code"}]}]},
         "messages[1].content[0]: type must be one of ['text', 'python', 'python_output'], got 'code' (1 of 3 "
         "records is bad)"),
        ({"messages": [{"role": "user", "content": "7*12?"}, {"role": "assistant", "content": [
            {"type": "text", "text": "Let me. "}, {"type": "python", "text": "7*12"}]}]},
         f"messages[1].content[1]: the python call '7*12' ends the conversation with no result after it: {UNANSWERED}"),
        ({"messages": [{"role": "user", "content": "7*12?"}, {"role": "assistant", "content": [
            {"type": "python", "text": "7*12"}]}, {"role": "user", "content": "so?"},
            {"role": "assistant", "content": "84"}]},
         "messages[1].content[0]: the python call '7*12' ends the assistant's turn with no result after it (a "
         f"'user' message follows): {UNANSWERED}"),
        ({"messages": [{"role": "user", "content": "7*12?"}, {"role": "assistant", "content": [
            {"type": "python", "text": "7*12"}, {"type": "text", "text": "It is 84."}]}]},
         f"messages[1].content[0]: the python call '7*12' is followed by a text part, not by its result: {UNANSWERED}"),
        ({"messages": [{"role": "user", "content": "7*12?"}, {"role": "assistant", "content": [
            {"type": "text", "text": "It is "}, {"type": "python_output", "text": "84"}]}]},
         f"messages[1].content[1]: a python_output part with no python call right before it: {NO_CALL}"),
        ({"messages": [{"role": "user", "content": "7*12?"}, {"role": "assistant", "content": [
            {"type": "python", "text": "7*12"}]}, {"role": "tool", "content": "84"}, {"role": "assistant",
            "content": [{"type": "python_output", "text": "84"}, {"type": "text", "text": "84"}]}]},
         f"messages[3].content[0]: a python_output part with no python call right before it: {NO_CALL}"),
        ({"messages": [{"role": "user", "content": "47 * 12?"}, {"role": "assistant", "content": [
            {"type": "text", "text": "Let me. "}, {"type": "python", "text": "47 * 12"},
            {"type": "python_output", "text": "564.0"}, {"type": "text", "text": "564"}]}]},
         f"messages[1].content[2]: the result '564.0' of the python call '47 * 12' {NOT_THE_ENGINES} '564', so "
         "write '564' (1 of 3 records is bad)"),
        ({"messages": [{"role": "user", "content": "7/2?"}, {"role": "assistant", "content": [
            {"type": "python", "text": "7/2"}]}, {"role": "tool", "content": "3"},
            {"role": "assistant", "content": "3"}]},
         f"messages[2].content: the result '3' of the python call '7/2' {NOT_THE_ENGINES} '3.5', so write '3.5' "
         "(1 of 3 records is bad)"),
        ({"messages": [{"role": "user", "content": "2 to the 10th?"}, {"role": "assistant", "content": [
            {"type": "python", "text": "2**10"}, {"type": "python_output", "text": "1024"},
            {"type": "text", "text": "1024"}]}]},
         f"messages[1].content[1]: the result '1024' of the python call '2**10' {NEVER_GIVEN}"),
        ({"messages": [{"role": "user", "content": "2 to the 10th?"}, {"role": "assistant", "content": [
            {"type": "python", "text": "2**10"}, {"type": "text", "text": "It is 1024."}]}]},
         "messages[1].content[0]: the python call '2**10' is one the engine's calculator cannot compute (it answers "
         f"nothing at inference): {COMPUTED_FORMS}, with its result right after it, or leave the call out (1 of 3 "
         "records is bad)"),
        ({"messages": [{"role": "user", "content": "only a question"}]},
         "messages: no 'assistant' message (nothing to train on) (1 of 3 records is bad)"),
        ({"conversation": []}, "lacks column(s) ['messages']; expected ['messages'] (1 of 3 records is bad)"),
        ([1, 2], "each line is one JSON object, got a list (1 of 3 records is bad)"),
    ],
)  # fmt: skip
def test_a_bad_record_is_named_by_file_line_and_field(tmp_path, record, error):
    data_dir, train = own_data(tmp_path, [GOOD, record, GOOD])
    with pytest.raises(ValueError) as e:
        check_data(["smoltalk"], ("train",), str(data_dir))
    assert str(e.value) == f"--sft-tasks: {train} line 2: {error}"


def test_results_the_engine_gives_are_accepted(tmp_path):
    """Each result is the engine's text for its call, worked out by hand: 47*12 = 564; 84/2 = 42 exactly (an
    int); 1/3 to 12 significant digits; 1,000 + 1 with a thousands separator; 'strawberry' holds 3 r's; a tool
    message answering a call as a python_output part does."""
    calls = [("47 * 12", "564"), ("84/2", "42"), ("1/3", "0.333333333333"), ("1,000 + 1", "1001"),
             ("'strawberry'.count('r')", "3")]  # fmt: skip
    records = [
        {"messages": [{"role": "user", "content": "?"}, {"role": "assistant", "content": [
            {"type": "python", "text": call}, {"type": "python_output", "text": result}]}]}
        for call, result in calls
    ]  # fmt: skip
    records.append({"messages": TOOL_TURN})
    data_dir, _ = own_data(tmp_path, records)
    check_data(["smoltalk"], ("train",), str(data_dir))
    (task,) = mixture_tasks("smoltalk", "train", 0, str(data_dir))
    results = sorted(  # the python_output parts and tool messages trained on, as written
        p["text"] if isinstance(p, dict) else m["content"]
        for i in range(len(task))
        for m in task[i]["messages"]
        for p in (m["content"] if isinstance(m["content"], list) else [None] if m["role"] == "tool" else [])
        if p is None or p["type"] == "python_output"
    )
    assert results == ["0.333333333333", "1001", "3", "3", "42", "564"]


def test_a_line_that_is_not_json_and_a_bad_parquet_row(tmp_path):
    data_dir, train = own_data(tmp_path, [GOOD, GOOD])
    train.write_text(train.read_text() + '{"messages": [\n')
    with pytest.raises(ValueError) as e:
        check_data(["smoltalk"], ("train",), str(data_dir))
    assert str(e.value) == (
        f"--sft-tasks: {train} line 3: not JSON (Expecting value: line 1 column 15 (char 14)); each line is one "
        "JSON object (1 of 3 records is bad)"
    )
    train.unlink()
    bad = [{"role": "user", "content": "x"}, {"role": "user", "content": "y"}]
    pq.write_table(pa.table({"messages": [GOOD["messages"], bad, bad]}), train.with_suffix(".parquet"))
    with pytest.raises(ValueError) as e:
        check_data(["smoltalk"], ("train",), str(data_dir))
    assert str(e.value) == (
        f"--sft-tasks: {train.with_suffix('.parquet')} row 1: messages[1]: role 'user' not allowed after 'user'; "
        "allowed: ['assistant'] (2 of 3 records are bad)"
    )


def test_a_conversation_longer_than_the_row_is_skipped_with_a_count(tmp_path, small_tokenizer, capsys):
    long = {"messages": [{"role": "user", "content": "word " * 200}, {"role": "assistant", "content": "ok"}]}
    data_dir, train = own_data(tmp_path, [GOOD, long, GOOD])
    (task,) = mixture_tasks("smoltalk", "train", 0, str(data_dir))
    source = SFTRows([task], 0, small_tokenizer, 16, buffer_size=1)
    hello = render_conversation(small_tokenizer, GOOD).ids
    rows = [source.next_batch(1)["input_ids"][0].tolist() for _ in range(3)]  # an epoch: 3 conversations
    assert all(row[: len(hello)] == hello for row in rows)  # the rows hold the good ones only
    assert capsys.readouterr().out.splitlines()[0] == (
        f"sft data: 1 conversation skipped so far by rank 0 (latest: {train} line 2: the most recent exchange "
        "does not fit in max_tokens=16; a longer --seq-len keeps more)"
    )
    # the speedrun's SFT (sft(flags=speedrun_flags(...)) builds SFT(flags.option("seq_len"))) names its preset's
    # key: its tiny preset printed these lines telling its user to raise --seq-len, a flag it does not take
    cfg = from_dict(TrainConfig, {"sft_tasks": "smoltalk", "task_data_dir": str(data_dir), "seq_len": 15,
                                  "sft_test_size": 0}, base=sft_defaults())  # fmt: skip
    source = SFT(speedrun_flags("tiny", "sft").option("seq_len")).row_source(cfg, small_tokenizer, 0, 1)
    source.packer.buffer_size = 1
    [source.next_batch(1) for _ in range(3)]
    assert capsys.readouterr().out.splitlines()[0] == (
        f"sft data: 1 conversation skipped so far by rank 0 (latest: {train} line 2: the most recent exchange "
        "does not fit in max_tokens=16; a longer train.seq_len keeps more)"
    )


@pytest.mark.parametrize("eval_tokens, conversations", [(65536, 2048), (4096, 128), (100, 64)])
def test_eval_tokens_sets_the_held_out_conversations_of_each_task(eval_tokens, conversations):
    """What `raychat sft --help` says of --eval-tokens: eval_tokens // 32 conversations, at least 64."""
    cfg = from_dict(TrainConfig, {"eval_tokens": eval_tokens}, base=sft_defaults())
    assert validation_size(cfg) == conversations
