import copy
import re

import numpy as np

from raychat.cli import main
from raychat.data.inspect_batch import canary_conversations, inspect_canaries
from raychat.data.replay import ReplayRecord, make_replay_record, rebuild_rows, verify_replay
from raychat.data.sample_packing import SamplePacker, render_samples
from raychat.tasks import Calculator, Spelling, TaskMixture
from raychat.tokenizer import Tokenizer


def _batch(tok, row_len=64):
    mixture = TaskMixture([Calculator(size=20, seed=0), Spelling(size=20, seed=0)], seed=7)
    convs = {mixture[i]["id"]: mixture[i] for i in range(len(mixture))}
    packer = SamplePacker.from_items(
        render_samples(tok, convs.items(), row_len), row_len, tok.bos_id, buffer_size=8
    )
    rows = packer.next_batch(4)
    return mixture, convs, rows


def test_batch_is_rebuilt_bit_for_bit_from_its_record(tmp_path, small_tokenizer):
    tok = small_tokenizer
    mixture, convs, rows = _batch(tok)
    record = make_replay_record(rows, tok, step=3, seed=7, mixture=mixture.describe(), pad_id=tok.bos_id)
    path = record.save(tmp_path / "replay" / "step3.json")
    loaded = ReplayRecord.load(path)
    assert loaded == record and loaded.rows[0]["sample_ids"] == rows["sample_ids"][0]
    assert loaded.template_version and loaded.tokenizer_version == tok.version and loaded.mixture["seed"] == 7
    rebuilt = rebuild_rows(loaded, convs.__getitem__, tok)
    for k in ("input_ids", "supervised", "segment_ids"):
        np.testing.assert_array_equal(rebuilt[k], rows[k])
    assert verify_replay(loaded, convs.__getitem__, tok) == []


def test_replay_detects_changed_data_and_versions(small_tokenizer):
    tok = small_tokenizer
    mixture, convs, rows = _batch(tok)
    record = make_replay_record(rows, tok, step=0, seed=7, mixture=mixture.describe(), pad_id=tok.bos_id)
    changed = copy.deepcopy(convs)
    victim = rows["sample_ids"][0][0]
    msg = changed[victim]["messages"][0]
    msg["content"] = msg["content"][:-1] + (
        "?" if msg["content"][-1] != "?" else "."
    )  # same length, new token
    problems = verify_replay(record, changed.__getitem__, tok)
    assert problems and any("hash differs" in p or victim in p for p in problems)
    other = Tokenizer.train(["another tiny corpus of words"] * 10, vocab_size=300)
    assert any("tokenizer_version" in p for p in verify_replay(record, convs.__getitem__, other))
    tampered = copy.deepcopy(record)
    tampered.hashes["labels"] = "0" * 64
    assert verify_replay(tampered, convs.__getitem__, tok) == ["labels hash differs"]


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
