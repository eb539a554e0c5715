import ast
import hashlib
import json
import re
import shutil

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from raychat.checkpoint_manager import commit_directory
from raychat.cli import main
from raychat.config import TrainConfig, from_dict
from raychat.data.loader.sft_rows import SFTRows
from raychat.data.replay.inspect_batch import canary_conversations, inspect_canaries
from raychat.data.replay.rebuild import verify_step
from raychat.data.replay.records import (
    prune_records,
    read_step,
    replay_meta,
    step_records,
    tensor_sha256,
    write_records,
)
from raychat.tasks.registry import mixture_tasks
from raychat.tokenizer import Tokenizer

SPEC, SEED, ROW_LEN = "calculator:20,spelling:10", 3, 128


def test_tensor_hash_by_hand():
    expected = hashlib.sha256(b"labels|[2, 2]|" + np.array([1, 2, 3, 4], dtype="<i8").tobytes()).hexdigest()
    assert tensor_sha256("labels", torch.tensor([[1, 2], [3, 4]], dtype=torch.int32)) == expected
    assert tensor_sha256("labels", np.array([[1, 2], [3, 4]], dtype=np.int64)) == expected  # dtype-free
    assert tensor_sha256("input_ids", np.array([[1, 2], [3, 4]])) != expected  # the name is hashed too


@pytest.fixture
def sft_run(tmp_path, small_tokenizer):
    """A 1-rank SFT row source's replay records of steps 1..3 (2 micro-batches of 2 rows) in tmp_path/run."""
    tok = small_tokenizer
    tok.save(tmp_path / "tok")
    cfg = from_dict(
        TrainConfig,
        {"stage": "sft", "seed": SEED, "sft_tasks": SPEC, "seq_len": ROW_LEN - 1, "document_masking": True,
         "tokenizer_path": str(tmp_path / "tok")},
    )  # fmt: skip
    rows = SFTRows(mixture_tasks(SPEC, "train", SEED), SEED, tok, ROW_LEN)
    meta = replay_meta(cfg, tok.version, tok.bos_id, rows.fingerprint())
    records = [
        r
        for s in (1, 2, 3)
        for r in step_records(s, 0, 1, [rows.next_batch(2), rows.next_batch(2)], tok.bos_id, True)
    ]
    write_records(str(tmp_path / "run"), 0, records, meta)
    return tmp_path / "run", records


def test_records_are_one_parquet_row_per_packed_row(sft_run):
    run, written = sft_run
    assert sorted(p.name for p in (run / "replay").iterdir()) == ["steps_000001-000003.rank0.parquet"]
    records, meta = read_step(str(run), 2)
    assert records == [r for r in written if r["step"] == 2] and len(records) == 4
    assert [(r["micro"], r["row"]) for r in records] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert meta["stage"] == "sft" and meta["seed"] == SEED and meta["template_version"]
    assert all(len(r["doc"]) == len(r["sample_id"]) == len(r["truncation"]) >= 1 for r in records)
    assert verify_step(records, meta)[1] == []


def test_verify_names_what_differs(sft_run, small_tokenizer, tmp_path):
    run, _ = sft_run
    records, meta = read_step(str(run), 3)
    records[2]["labels_sha256"] = "0" * 64
    assert verify_step(records, meta)[1] == ["rank 0 micro 1 row 0: labels differs"]
    other = tmp_path / "other_tok"
    Tokenizer.train(["another tiny corpus of words"] * 10, vocab_size=300).save(other)
    problems = verify_step(read_step(str(run), 3)[0], meta, tokenizer_path=str(other))[1]
    assert problems and problems[0].startswith("tokenizer_version")


def test_sft_step_rebuilds_from_the_run_task_data_dir_from_any_directory(
    tmp_path, small_tokenizer, monkeypatch, capsys
):
    """An SFT run with a hub task read its files from --task-data-dir (absolute in the run's config): its steps
    rebuild from there wherever inspect-batch runs (was a FileNotFoundError naming <cwd>/runs/task_data), and
    from --data-dir once they moved."""
    tasks = tmp_path / "tasks"
    (tasks / "smol-smoltalk" / "data").mkdir(parents=True)
    conversations = [
        {
            "messages": [
                {"role": "user", "content": f"hello {i}"},
                {"role": "assistant", "content": f"fine {i}"},
            ]
        }
        for i in range(20)
    ]
    (tasks / "smol-smoltalk" / "data" / "train-0.jsonl").write_text(
        "".join(json.dumps(c) + "\n" for c in conversations)
    )
    small_tokenizer.save(tmp_path / "tok")
    cfg = from_dict(
        TrainConfig,
        {"stage": "sft", "seed": SEED, "sft_tasks": "smoltalk", "task_data_dir": str(tasks), "seq_len": 63,
         "document_masking": True, "tokenizer_path": str(tmp_path / "tok")},
    )  # fmt: skip
    rows = SFTRows(mixture_tasks("smoltalk", "train", SEED, str(tasks)), SEED, small_tokenizer, 64)
    batch = rows.next_batch(2)
    meta = replay_meta(cfg, small_tokenizer.version, small_tokenizer.bos_id, rows.fingerprint())
    write_records(
        str(tmp_path / "run"), 0, step_records(1, 0, 1, [batch], small_tokenizer.bos_id, True), meta
    )
    elsewhere = tmp_path / "elsewhere"  # no runs/task_data here, and no $RAYCHAT_TASK_DATA
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    monkeypatch.delenv("RAYCHAT_TASK_DATA", raising=False)
    records, meta = read_step(str(tmp_path / "run"), 1)
    rebuilt, problems = verify_step(records, meta)
    assert problems == [] and meta["task_data_dir"] == str(tasks)
    np.testing.assert_array_equal(rebuilt["input_ids"], batch["input_ids"])
    assert main(["inspect-batch", "--run", str(tmp_path / "run"), "--step", "1"]) == 0
    assert "rebuilt 2 rows from the data: input_ids, labels, loss_mask" in capsys.readouterr().out
    # records written before task_data_dir was recorded: $RAYCHAT_TASK_DATA, else runs/task_data, as before
    old = {k: v for k, v in meta.items() if k != "task_data_dir"}
    monkeypatch.setenv("RAYCHAT_TASK_DATA", str(tasks))
    assert verify_step(records, old)[1] == []
    # the task files moved since the run: --data-dir names where they are now
    monkeypatch.delenv("RAYCHAT_TASK_DATA")
    moved = tasks.rename(tmp_path / "moved")
    capsys.readouterr()
    assert main(["inspect-batch", "--run", str(tmp_path / "run"), "--step", "1"]) == 2
    assert f"{tasks}/smol-smoltalk/data/train-*.parquet" in capsys.readouterr().err
    assert (
        main(["inspect-batch", "--run", str(tmp_path / "run"), "--step", "1", "--data-dir", str(moved)]) == 0
    )


def test_read_step_errors_and_pruning(sft_run):
    run, _ = sft_run
    with pytest.raises(FileNotFoundError, match=r"step 9 .*\(steps: \[\(1, 3\)\]\)$"):
        read_step(str(run), 9)
    rank1 = run / "replay" / "steps_000001-000003.rank1.parquet"  # a second rank's file: the range once
    shutil.copy(run / "replay" / "steps_000001-000003.rank0.parquet", rank1)
    with pytest.raises(FileNotFoundError, match=r"\(steps: \[\(1, 3\)\]\)$"):
        read_step(str(run), 9)
    rank1.unlink()
    foreign = run / "replay" / "steps_000004-000004.rank0.parquet"  # a replay name, another table
    pq.write_table(pa.table({"step": [4], "x": [1]}), foreign)
    with pytest.raises(ValueError, match=rf"^{foreign} is not a raychat replay record \(KeyError: "):
        read_step(str(run), 4)
    pq.write_table(pa.table({"x": [1]}), foreign)  # no step column: pyarrow's FieldRef error, with the file
    with pytest.raises(
        ValueError, match=rf"^{foreign} is not a raychat replay record \(ArrowInvalid: .*step"
    ):
        read_step(str(run), 4)
    foreign.unlink()
    with pytest.raises(FileNotFoundError, match=rf"^no run directory {run}-nope$"):
        read_step(f"{run}-nope", 1)
    assert prune_records(str(run), after_step=3) == 0
    assert prune_records(str(run), after_step=2) == 1  # a restart from checkpoint 2 redoes step 3
    assert not any((run / "replay").iterdir())


def test_inspect_batch_cli_rebuilds_a_step(sft_run, capsys):
    run, _ = sft_run
    assert main(["inspect-batch", "--run", str(run), "--step", "2"]) == 0
    out = capsys.readouterr().out
    assert "step 2: 1 ranks, 4 rows of 128 tokens; stage sft" in out
    assert re.search(r"rank 0 micro 1 row 1: \S+\+\d+@0", out)
    assert (
        "rebuilt 4 rows from the data: input_ids, labels, loss_mask, position_ids, segment_ids hashes equal"
        in out
    )
    assert main(["inspect-batch", "--step", "2"]) == 2  # was exit 1 with no "error:"
    assert capsys.readouterr().err == (
        "raychat inspect-batch: error: --run and --step go together: --run RUN_DIR --step N rebuilds that step's "
        "batch  (RAYCHAT_DEBUG=1 shows the traceback)\n"
    )
    assert main(["inspect-batch", "--run", str(run), "--step", "2", "--canary", "short"]) == 2
    assert (
        "error: --canary prints canary samples; it does not go with --run and --step"
        in capsys.readouterr().err
    )
    assert main(["inspect-batch", "--data-dir", str(run), "--canary", "short"]) == 2  # was ignored
    assert "error: --data-dir goes with --run and --step" in capsys.readouterr().err


def test_inspect_batch_row_prints_the_rebuilt_row_token_by_token(sft_run, small_tokenizer, capsys):
    """--row R shows what the trainer's batch held at each position of row R: its input ids hash to the record
    written in training; each label is the next position's token, or "-" (loss_mask False) at a segment's end
    and on user tokens; positions restart at 0 with each segment, whose first token is BOS."""
    run, _ = sft_run
    records, _ = read_step(str(run), 2)
    assert main(["inspect-batch", "--run", str(run), "--step", "2", "--row", "3"]) == 0
    out = capsys.readouterr().out.splitlines()
    head = out.index(
        "row 3 (rank 0 micro 1 row 1) as trained on: input_ids, labels, loss_mask (label -: not in the loss), "
        "segment_ids, position_ids"
    )
    assert out[head + 1] == f"{'pos':>5} {'id':>6}  {'text':<22} {'seg':>3} {'position':>8}  label"
    table = out[head + 2 :]
    assert len(table) == ROW_LEN - 1
    pos, ids, text = (
        [int(ln[:5]) for ln in table],
        [int(ln[6:12]) for ln in table],
        [ln[14:36] for ln in table],
    )
    seg, position, label = (
        [int(ln[37:40]) for ln in table],
        [int(ln[41:49]) for ln in table],
        [ln[51:] for ln in table],
    )
    assert pos == list(range(ROW_LEN - 1))
    assert tensor_sha256("input_ids", torch.tensor(ids)) == records[3]["input_ids_sha256"]
    starts = [p for p in pos if p == 0 or seg[p] != seg[p - 1]]
    samples = len(records[3]["doc"])  # the row's samples, then padding (BOS tokens, a segment of its own)
    assert starts[:samples] == list(records[3]["row_offset"]) and len(starts) <= samples + 1
    assert all(label[p] == "-" for p in pos if p >= starts[samples - 1] + records[3]["length"][-1] - 1)
    for p in pos:
        start = max(s for s in starts if s <= p)
        assert position[p] == p - start
        if p in starts:
            assert ids[p] == small_tokenizer.bos_id
        if p + 1 in starts:
            assert label[p] == "-"  # no label across a segment boundary
        elif label[p] != "-" and p + 1 < len(pos):
            assert label[p] == text[p + 1].rstrip()
    assert 0 < sum(lbl != "-" for lbl in label) < len(label)  # assistant tokens are targets, user tokens not
    assert main(["inspect-batch", "--run", str(run), "--step", "2", "--row", "4"]) == 2
    assert "error: --row 4: step 2 has 4 rows; allowed: 0..3" in capsys.readouterr().err
    assert main(["inspect-batch", "--row", "0", "--canary", "short"]) == 2
    assert "error: --row goes with --run and --step" in capsys.readouterr().err


@pytest.mark.parametrize(
    "stages, why",
    [
        (["rl"], "it is an RL run (checkpoints of steps [1, 2]), and RL runs write none"),
        (["sft"], "it is an SFT run (checkpoints of steps [1, 2]) whose records are gone"),
        ([], "it holds no committed checkpoint, so it is no training run's directory"),
    ],
)
def test_inspect_batch_of_a_run_without_records_says_what_the_run_is(tmp_path, capsys, stages, why):
    """An RL run writes no replay records: inspect-batch said "no replay record of step 1 ... (steps: [])"."""
    run = tmp_path / "rl"
    run.mkdir()
    for step, stage in zip((1, 2), stages * 2):
        (run / f"checkpoint_00000{step}").mkdir()
        (run / f"checkpoint_00000{step}" / "meta.json").write_text("{}")
        commit_directory(run / f"checkpoint_00000{step}", step, stage)
    assert main(["inspect-batch", "--run", str(run), "--step", "1"]) == 2
    assert capsys.readouterr().err == (
        f"raychat inspect-batch: error: no replay record under {run}/replay: {why}; only pretraining and SFT "
        "runs write replay records, beside their checkpoints  (RAYCHAT_DEBUG=1 shows the traceback)\n"
    )


def test_inspect_batch_canaries(small_tokenizer):
    tok = small_tokenizer
    text = inspect_canaries(tok, row_len=128)
    for name in [*canary_conversations(), "packed"]:
        assert f"=== canary {name} ===" in text
    section = text.split("=== canary overlong_turn ===")[1].split("===")[0]
    assert "dropped: not trained on" in section
    overlong = text.split("=== canary overlong ===")[1].split("===")[0]
    assert "'dropped_exchanges': 0" not in overlong and "'kept_messages': [0, " in overlong  # system kept

    packed = text.split("=== canary packed ===")[1]
    lines = [ln for ln in packed.splitlines() if re.match(r"\s+\d+\s+\d+\s", ln)]
    offsets = [int(x) for x in re.search(r"at offsets \[([\d, ]+)\]", packed).group(1).split(",")]
    assert len(offsets) == 3
    for off in offsets:
        cols = lines[off].split()
        # a sample's first token: BOS, position 0, sees only itself, predicts nothing across the boundary
        assert cols[2] == "'<|bos|>'" and cols[3] == "bos" and cols[5] == "0" and cols[6] == f"{off}..{off}"
        if off > 0:
            assert lines[off - 1].split()[-1] == "-"  # the previous sample's last position has no label
    user_lines = [ln for ln in lines if ln.split()[3] == "user"]
    assert user_lines and all(ln.split()[-1] == "-" for ln in user_lines)  # user tokens are never targets
    end = [ln for ln in lines if ln.split()[-1] == "'<|assistant_end|>'"]
    assert len(end) == 3  # each sample's end marker is a target


def test_inspect_batch_cli_trains_a_tokenizer_when_none_given(capsys, tmp_path, small_tokenizer):
    assert main(["inspect-batch", "--canary", "short"]) == 0
    out = capsys.readouterr().out
    assert "trained a" in out and "=== canary short ===" in out and "canary packed" not in out
    small_tokenizer.save(tmp_path)
    assert main(["inspect-batch", "--tokenizer", str(tmp_path), "--canary", "empty", "--row-len", "16"]) == 0
    out = capsys.readouterr().out
    assert f"tokenizer {small_tokenizer.version}" in out and "row_len 16" in out


def test_inspect_batch_prints_your_own_conversations_with_the_tokens_that_carry_loss(
    capsys, tmp_path, small_tokenizer
):
    """`--sft-data` prints the user's own conversations as SFT trains on them: the labels (the tokens trained
    to predict) are exactly the assistant's text, its calculator call and each <|assistant_end|>; the system,
    user and tool tokens are never labels. An SFT user could print only the canaries."""
    tool_turn = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "3*7?"},
        {
            "role": "assistant",
            "content": [{"type": "text", "text": "Ok. "}, {"type": "python", "text": "3*7"}],
        },
        {"role": "tool", "content": "21"},
        {"role": "assistant", "content": "It is 21."},
        {"role": "user", "content": "Thanks"},
        {"role": "assistant", "content": "Bye."},
    ]
    short = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello."}]
    path = tmp_path / "chats.jsonl"
    path.write_text("".join(json.dumps({"messages": m}) + "\n" for m in (tool_turn, short, short)))
    small_tokenizer.save(tmp_path / "tok")
    argv = [
        "inspect-batch",
        "--sft-data",
        str(path),
        "--tokenizer",
        str(tmp_path / "tok"),
        "--row-len",
        "128",
    ]
    assert main([*argv, "--examples", "2"]) == 0
    out = capsys.readouterr().out
    assert "the first 2 of 3 conversations" in out
    assert f"=== {path} line 1 ===" in out and f"=== {path} line 2 ===" in out and "line 3 ===" not in out
    first = out.split(f"=== {path} line 2 ===")[0].split(f"=== {path} line 1 ===")[1]
    # (text, role, label) of each position: fixed columns (format_row), the texts and labels as repr
    rows = [
        (ast.literal_eval(ln[12:34].strip()), ln[35:44].strip(), ln[69:])
        for ln in first.splitlines()
        if re.match(r"\s+\d+\s+\d+\s", ln) and "label only" not in ln
    ]
    targets = [(text, role, ast.literal_eval(label)) for text, role, label in rows if label != "-"]
    assert "".join(t[2] for t in targets) == (
        "Ok. <|python_start|>3*7<|python_end|>It is 21.<|assistant_end|>Bye.<|assistant_end|>"
    )
    assert {t[1] for t in targets} == {"assistant", "tool"}  # <|assistant_start|>, <|output_end|> predict
    assert all(label == "-" for _, role, label in rows if role in ("system", "user", "bos"))
    tool_labelled = [(text, label) for text, role, label in targets if role == "tool"]
    assert len(tool_labelled) == 1 and tool_labelled[0][0] == "<|output_end|>"  # the tool output is no target
    assert "It is 21.".startswith(tool_labelled[0][1])

    path.write_text(
        json.dumps({"messages": short})
        + "\n"
        + json.dumps({"messages": [short[0], {"role": "bot", "content": "x"}]})
        + "\n"
    )
    assert main(argv) == 2
    assert capsys.readouterr().err == (
        f"raychat inspect-batch: error: --sft-data: {path} line 2: messages[1]: role must be one of "
        "['system', 'user', 'assistant', 'tool'], got 'bot' (1 of 2 records is bad)  "
        "(RAYCHAT_DEBUG=1 shows the traceback)\n"
    )
    assert main(["inspect-batch", "--examples", "2"]) == 2
    assert "error: --examples goes with --sft-data" in capsys.readouterr().err
    assert main([*argv, "--canary", "short"]) == 2
    assert "error: --canary prints canary samples, --sft-data your conversations" in capsys.readouterr().err
