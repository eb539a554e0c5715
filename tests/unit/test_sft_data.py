"""--sft-data: a user's own conversations named by path (README "Your own conversations"): which files are trained
on and which held out, the exact conversations carved off when there is no test file, every record checked
before any work (one line naming file, line and field), the config's refusals, and the data's sha256 in the
resume fingerprint."""

from __future__ import annotations

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml

from raychat.config import ConfigError, SpeedrunConfig, TrainConfig, from_dict
from raychat.data.loader.row_source import same_stream
from raychat.data.loader.sft_rows import SFTRows, changed_task_files
from raychat.data.replay.rebuild import verify_step
from raychat.data.replay.records import read_step, replay_meta, step_records, write_records
from raychat.tasks.registry import mixture_tasks
from raychat.tasks.sft_data import held_out_count, sft_data_files, sft_data_split
from raychat.train.sft import check_validation_rows, sft_data_line, sft_defaults, validation_tasks


def chat(i: int) -> dict:
    return {"messages": [{"role": "user", "content": f"q{i}"}, {"role": "assistant", "content": f"a{i}"}]}


def write_jsonl(path, records) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")


def questions(task) -> list[str]:
    return [task[i]["messages"][0]["content"] for i in range(len(task))]


def test_a_file_without_a_test_file_holds_out_a_seeded_fraction(tmp_path):
    """10 conversations, --sft-test-size 0.2: ceil(0.2 * 10) = 2 held out, the first two of numpy's PCG64
    permutation of seed 42, [5 6 0 7 3 2 4 9 1 8]; the other 8 trained on, in that order; whatever the run's seed."""
    mine = tmp_path / "mine.jsonl"
    write_jsonl(mine, [chat(i) for i in range(10)])
    split = sft_data_split(str(mine), 0.2)
    assert split.carved and questions(split.test) == ["q5", "q6"]
    assert questions(split.train) == ["q0", "q7", "q3", "q2", "q4", "q9", "q1", "q8"]
    assert split.train[0]["where"] == f"{mine} line 1" and split.test[0]["where"] == f"{mine} line 6"
    assert questions(sft_data_split(str(mine), 0.2, size=1).test) == ["q5"]  # SFT's validation size caps it
    assert questions(sft_data_split(str(mine), 3).test) == ["q5", "q6", "q0"]  # a whole count
    none = sft_data_split(str(mine), 0)
    assert none.test is None and len(none.train) == 10
    (train,) = mixture_tasks("", "train", seed=7, sft_data=str(mine), sft_test_size=0.2)
    assert train.name == "sft-data" and questions(train) == questions(split.train)
    assert [t.name for t in mixture_tasks("calculator:5", "test", sft_data=str(mine), sft_test_size=0.2)] == [
        "calculator-test", "sft-data"
    ]  # fmt: skip


@pytest.mark.parametrize(
    "n, test_size, held",
    [(10, 0.05, 1), (30, 0.1, 3), (31, 0.1, 4), (100, 0.05, 5), (10, 4.0, 4), (10, 0.0, 0), (2, 0.5, 1)],
)
def test_how_many_are_held_out(n, test_size, held):
    """ceil(test_size * n) in decimal (0.1 * 30 is 3.0000000000000004 in floats: 4), a count as it is."""
    assert held_out_count(n, test_size) == held


@pytest.mark.parametrize(
    "n, test_size, error",
    [
        (1, 0.05, "--sft-test-size 0.05: holds out 1 of the 1 conversations of --sft-data, leaving none to train on"),
        (10, 10.0, "--sft-test-size 10: holds out 10 of the 10 conversations of --sft-data, leaving none to train on"),
        (4, 0.9, "--sft-test-size 0.9: holds out 4 of the 4 conversations of --sft-data, leaving none to train on"),
    ],
)  # fmt: skip
def test_a_test_size_that_leaves_nothing_to_train_on(n, test_size, error):
    with pytest.raises(ValueError) as e:
        held_out_count(n, test_size)
    assert str(e.value) == (
        f"{error} (a smaller --sft-test-size, 0 for none, or a test file beside the data)"
    )


def test_test_files_are_the_held_out_split(tmp_path):
    """A directory's test* files, and those beside a named train* file, are held out whole; a file of another
    name takes none from beside it; --sft-test-size is not applied."""
    d = tmp_path / "data"
    write_jsonl(d / "train.jsonl", [chat(i) for i in range(4)])
    write_jsonl(d / "test.jsonl", [chat(10), chat(11)])
    pq.write_table(pa.table({"messages": [chat(5)["messages"]]}), d / "train-extra.parquet")
    write_jsonl(d / "other.jsonl", [chat(6)])
    (d / "notes.txt").write_text("not data")
    assert sft_data_files(str(d)) == (
        (d / "other.jsonl", d / "train-extra.parquet", d / "train.jsonl"), (d / "test.jsonl",)
    )  # fmt: skip
    assert sft_data_files(str(d / "train.jsonl")) == ((d / "train.jsonl",), (d / "test.jsonl",))
    assert sft_data_files(f"{d / 'other.jsonl'}, {d / 'test.jsonl'}") == (
        (d / "other.jsonl",),
        (d / "test.jsonl",),
    )
    assert sft_data_files(str(d / "other.jsonl")) == ((d / "other.jsonl",), ())
    split = sft_data_split(str(d), 0.5)
    assert not split.carved and len(split.train) == 6 and sorted(questions(split.test)) == ["q10", "q11"]


@pytest.mark.parametrize(
    "name, error",
    [
        ("missing.jsonl", "--sft-data: {d}/missing.jsonl: no such file or directory"),
        ("notes.txt", "--sft-data: {d}/notes.txt: suffix must be one of ['.parquet', '.jsonl', '.json']"),
        ("empty", "--sft-data: directory {d}/empty holds no .parquet/.jsonl/.json file"),
        ("test.jsonl", "--sft-data: '{d}/test.jsonl' names no file to train on (test.jsonl and test-* files are "
                       "held out)"),
    ],
)  # fmt: skip
def test_a_path_with_nothing_to_train_on(tmp_path, name, error):
    d = tmp_path
    (d / "notes.txt").write_text("x")
    (d / "empty").mkdir()
    write_jsonl(d / "test.jsonl", [chat(0)])
    with pytest.raises(ValueError) as e:
        sft_data_split(str(d / name), 0.05)
    assert str(e.value) == error.format(d=d)


def test_every_record_is_checked_before_any_work_test_files_too(tmp_path):
    """smoltalk's record checks: the first bad record by file and line, the field, the count of bad ones."""
    d = tmp_path / "data"
    bad = {"messages": [{"role": "user", "content": "x"}, {"role": "bot", "content": "y"}]}
    write_jsonl(d / "train.jsonl", [chat(0), bad, chat(1), bad])
    write_jsonl(d / "test.jsonl", [chat(2)])
    with pytest.raises(ValueError) as e:
        sft_data_split(str(d), 0.05)
    assert str(e.value) == (
        f"--sft-data: {d}/train.jsonl line 2: messages[1]: role must be one of ['system', 'user', 'assistant', "
        "'tool'], got 'bot' (2 of 4 records are bad)"
    )
    write_jsonl(d / "train.jsonl", [chat(0)])
    (d / "test.jsonl").write_text(json.dumps(chat(2)) + "\n" + '{"messages": []\n')
    with pytest.raises(ValueError) as e:
        sft_data_split(str(d), 0.05)
    assert str(e.value) == (
        f"--sft-data: {d}/test.jsonl line 2: not JSON (Expecting ',' delimiter: line 1 column 16 (char 15)); "
        "each line is one JSON object (1 of 2 records is bad)"
    )


def test_the_first_bad_line_in_file_order_is_named_whatever_its_fault(tmp_path):
    """One pass over every record: a bad role on line 2 is named before a line 4 that is not JSON (a JSON pass
    ran first and named line 4), and every fault counts; a record without `messages` likewise."""
    d = tmp_path / "data"
    bad_role = {"messages": [{"role": "user", "content": "x"}, {"role": "bot", "content": "y"}]}
    write_jsonl(d / "train.jsonl", [chat(0), bad_role, chat(1)])
    (d / "train.jsonl").write_text((d / "train.jsonl").read_text() + '{"messages": [\n' + json.dumps(chat(2)))
    with pytest.raises(ValueError) as e:
        sft_data_split(str(d), 0.05)
    assert str(e.value) == (
        f"--sft-data: {d}/train.jsonl line 2: messages[1]: role must be one of ['system', 'user', 'assistant', "
        "'tool'], got 'bot' (2 of 5 records are bad)"
    )
    write_jsonl(d / "train.jsonl", [chat(0), {"conversation": []}, chat(1), [1], bad_role])
    with pytest.raises(ValueError) as e:
        sft_data_split(str(d), 0.05)
    assert str(e.value) == (
        f"--sft-data: {d}/train.jsonl line 2: lacks column(s) ['messages']; expected ['messages'] (3 of 5 "
        "records are bad)"
    )


def test_the_line_that_says_how_the_data_splits(tmp_path):
    mine = tmp_path / "mine.jsonl"
    write_jsonl(mine, [chat(i) for i in range(10)])
    cfg = from_dict(TrainConfig, {"sft_data": str(mine), "sft_tasks": ""}, base=sft_defaults())
    assert sft_data_line(cfg) == (
        "sft data: --sft-data: 9 conversations to train on, 1 held out for sft-data_val_bpb (--sft-test-size "
        "0.05 of 10, in seed 42's order)"
    )
    ((name, task),) = validation_tasks(cfg, 64)
    assert name == "sft-data" and questions(task) == ["q5"]
    cfg = from_dict(TrainConfig, {"sft_test_size": 0}, base=cfg)
    assert sft_data_line(cfg) == (
        "sft data: --sft-data: 10 conversations to train on, none held out (--sft-test-size 0: no "
        "sft-data_val_bpb)"
    )
    assert validation_tasks(cfg, 64) == []
    write_jsonl(tmp_path / "train.jsonl", [chat(1)])
    write_jsonl(tmp_path / "test-00000-of-00001.jsonl", [chat(2), chat(3)])
    cfg = from_dict(TrainConfig, {"sft_data": f"{mine},{tmp_path / 'train.jsonl'}"}, base=cfg)
    assert sft_data_line(cfg) == (
        "sft data: --sft-data: 11 conversations to train on, 2 held out for sft-data_val_bpb (from "
        "test-00000-of-00001.jsonl)"
    )


@pytest.mark.parametrize(
    "values, error",
    [
        ({"sft_tasks": ""}, "--sft-tasks: '': no task; the form is name[:count],...; tasks: calculator, "),
        ({"sft_data": "s3://bucket/mine.jsonl"},
         "--sft-data must be local or NFS paths (every worker reads the files), got 's3://bucket/mine.jsonl'"),
        ({"sft_data": "mine.jsonl", "sft_test_size": 2.5},
         "--sft-test-size must be a fraction in (0, 1), a whole count >= 1 or 0, got 2.5"),
        ({"sft_test_size": -0.1}, "--sft-test-size must be >= 0, got -0.1"),
    ],
)  # fmt: skip
def test_the_config_refuses(values, error):
    with pytest.raises(ConfigError) as e:
        from_dict(TrainConfig, values, base=sft_defaults())
    assert str(e.value).startswith(error)


def test_the_data_sha256_is_in_the_resume_fingerprint(tmp_path, small_tokenizer):
    """Another conversation under the same file name is another stream, named as sft-data's file."""
    mine = tmp_path / "mine.jsonl"
    write_jsonl(mine, [chat(i) for i in range(10)])

    def fingerprint():
        tasks = mixture_tasks("calculator:5", "train", 0, sft_data=str(mine), sft_test_size=0.2)
        return SFTRows(tasks, 0, small_tokenizer, 32).fingerprint()

    was = fingerprint()
    assert same_stream(was, fingerprint())
    write_jsonl(mine, [chat(i) for i in range(9)] + [chat(99)])
    now = fingerprint()
    assert not same_stream(was, now) and was["examples"] == now["examples"] == 13
    assert changed_task_files(was, now) == ["task sft-data's file mine.jsonl"]


def test_a_preset_sets_the_speedruns_sft_data(tmp_path):
    preset = tmp_path / "mine.yaml"
    preset.write_text(yaml.safe_dump({"sft": {"num_iterations": 2, "sft_data": "/data/mine.jsonl",
                                              "sft_test_size": 4}}))  # fmt: skip
    sft = SpeedrunConfig.from_preset(str(preset), str(tmp_path / "out")).sft
    assert (sft.data.sft_data, sft.data.sft_test_size, sft.data.sft_tasks) == (
        "/data/mine.jsonl", 4.0, "calculator:4000,chatterbot,spelling:2000"
    )  # fmt: skip


def test_held_out_conversations_that_fill_no_row_are_refused_naming_sft_data(tmp_path, small_tokenizer):
    small_tokenizer.save(tmp_path / "tok")
    write_jsonl(tmp_path / "train.jsonl", [chat(0)])
    long = {"messages": [{"role": "user", "content": "word " * 100}, {"role": "assistant", "content": "ok"}]}
    write_jsonl(tmp_path / "test.jsonl", [long])
    cfg = from_dict(
        TrainConfig,
        {"sft_data": str(tmp_path / "train.jsonl"), "tokenizer_path": str(tmp_path / "tok"), "seq_len": 64},
        base=sft_defaults(),
    )
    with pytest.raises(ValueError) as e:
        check_validation_rows(cfg)
    assert str(e.value) == (
        "--sft-data: task sft-data's held-out conversations (1) fill no row of 65 tokens: the last exchange of "
        "each is longer (a longer --seq-len, up to the --init-from checkpoint's max_seq_len, or shorter held-out "
        "conversations keep some)"
    )


def test_a_step_trained_on_sft_data_replays(tmp_path, small_tokenizer):
    """The replay records name --sft-data and --sft-test-size, so a step's rows are rebuilt from the same
    conversations, bit for bit (raychat.data.replay)."""
    small_tokenizer.save(tmp_path / "tok")
    mine = tmp_path / "mine.jsonl"
    write_jsonl(mine, [chat(i) for i in range(10)])
    cfg = from_dict(
        TrainConfig,
        {"stage": "sft", "sft_tasks": "calculator:6", "sft_data": str(mine), "sft_test_size": 2, "seq_len": 47,
         "document_masking": True, "tokenizer_path": str(tmp_path / "tok")},
    )  # fmt: skip
    d = cfg.data
    rows = SFTRows(mixture_tasks(d.sft_tasks, "train", 0, None, d.sft_data, 2), 0, small_tokenizer, 48)
    meta = replay_meta(cfg, small_tokenizer.version, small_tokenizer.bos_id, rows.fingerprint())
    assert (meta["sft_data"], meta["sft_test_size"], rows.fingerprint()["examples"]) == (str(mine), 2.0, 14)
    records = step_records(1, 0, 1, [rows.next_batch(4)], small_tokenizer.bos_id, True)
    write_records(str(tmp_path / "run"), 0, records, meta)
    assert verify_step(*read_step(str(tmp_path / "run"), 1))[1] == []
    write_jsonl(mine, [chat(i) for i in range(11)])  # another split: the records no longer match
    assert verify_step(*read_step(str(tmp_path / "run"), 1))[1] != []


def test_empty_files_are_named_as_paths_not_as_a_python_list(tmp_path):
    """An empty --sft-data file was refused as "[PosixPath('.../empty.jsonl')]: no records"."""
    (tmp_path / "a.jsonl").write_text("")
    (tmp_path / "b.jsonl").write_text("\n\n")
    with pytest.raises(ValueError) as e:
        sft_data_split(str(tmp_path / "a.jsonl"), 0.05)
    assert str(e.value) == f"--sft-data: {tmp_path}/a.jsonl: no records (an empty file)"
    with pytest.raises(ValueError) as e:
        sft_data_split(f"{tmp_path}/a.jsonl,{tmp_path}/b.jsonl", 0.05)
    assert (
        str(e.value)
        == f"--sft-data: {tmp_path}/a.jsonl, {tmp_path}/b.jsonl: no records (every file is empty)"
    )


def test_the_run_says_how_many_conversations_tokens_and_bytes_sft_data_val_bpb_scores(
    tmp_path, small_tokenizer
):
    """The default --sft-test-size 0.05 holds out 1 of 20 conversations: its BPB is over a few bytes, so the
    run says how much it covers. Two held-out conversations whose answers, 'a2' and 'Très bien', are all that
    is scored (their tokens as the tokenizer encodes them; 2 + 10 UTF-8 bytes, è being 2; <|assistant_end|>
    has none): the bytes BPB divides by."""
    small_tokenizer.save(tmp_path / "tok")
    write_jsonl(tmp_path / "train.jsonl", [chat(0), chat(1)])
    fine = {
        "messages": [{"role": "user", "content": "Ça va?"}, {"role": "assistant", "content": "Très bien"}]
    }
    write_jsonl(tmp_path / "test.jsonl", [chat(2), fine])
    cfg = from_dict(
        TrainConfig,
        {"sft_data": str(tmp_path / "train.jsonl"), "tokenizer_path": str(tmp_path / "tok"), "seq_len": 64},
        base=sft_defaults(),
    )
    tokens = len(small_tokenizer.encode("a2")) + len(small_tokenizer.encode("Très bien"))
    assert check_validation_rows(cfg) == (
        f"sft data: sft-data_val_bpb scores 2 held-out conversations: {tokens} tokens, 12 bytes"
    )
    write_jsonl(tmp_path / "mine" / "chats.jsonl", [chat(i) for i in range(20)])
    cfg = from_dict(TrainConfig, {"sft_data": str(tmp_path / "mine" / "chats.jsonl")}, base=cfg)
    assert questions(sft_data_split(cfg.data.sft_data, 0.05).test) == ["q15"]  # ceil(0.05 x 20) = 1 held out
    assert check_validation_rows(cfg) == (
        "sft data: sft-data_val_bpb scores 1 held-out conversation: "
        f"{len(small_tokenizer.encode('a15'))} tokens, 3 bytes"
    )
    cfg = from_dict(TrainConfig, {"sft_test_size": 0}, base=cfg)
    assert check_validation_rows(cfg) is None  # nothing held out: no sft-data_val_bpb


def test_a_line_that_is_not_utf8_is_that_lines_fault_counted_like_any_bad_record(tmp_path):
    """One Latin-1 byte (é as 0xe9) in line 2 raised UnicodeDecodeError for the whole file, naming neither the
    file nor the line, and no other record was checked. Byte 47 of the line: the 46 characters of
    `{"messages": [{"role": "user", "content": "caf` come before it."""
    path = tmp_path / "mine.jsonl"
    line = b'{"messages": [{"role": "user", "content": "caf\xe9"}, {"role": "assistant", "content": "x"}]}\n'
    path.write_bytes((json.dumps(chat(0)) + "\n").encode() + line + (json.dumps(chat(1)) + "\n").encode())
    with pytest.raises(ValueError) as e:
        sft_data_split(str(path), 0.05)
    assert str(e.value) == (
        f"--sft-data: {path} line 2: not UTF-8 (byte 0xe9 at byte 47 of the line: invalid continuation byte); "
        "each line is one JSON object in UTF-8 (1 of 3 records is bad)"
    )
    # a line of only Unicode whitespace (no-break and ideographic spaces) is blank, as a line of ASCII spaces is
    path.write_bytes((json.dumps(chat(0)) + "\n\u00a0\u3000\n" + json.dumps(chat(1)) + "\n").encode())
    split = sft_data_split(str(path), 0.5)
    assert (len(split.train), len(split.test)) == (1, 1)
