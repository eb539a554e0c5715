"""The checkpointer every stage shares: meta in the config's words, one optimizer file, compact per-rank state
that every rank of a new world reads, nothing unpickled but tensors and plain containers."""

from __future__ import annotations

import json
import pickle
import sys

import numpy as np
import pytest
import torch

from raychat.checkpoint import load_optimizers, load_rng, load_tree, read_meta, save_tree
from raychat.model import GPT, ModelConfig
from raychat.train.checkpointer import Checkpointer, restore_rows


def tiny_model(vocab: int) -> GPT:
    cfg = ModelConfig(vocab_size=vocab, n_layer=1, n_embd=32, n_head=1, n_kv_head=1, head_dim=32,
                      intermediate_size=64, max_seq_len=16)  # fmt: skip
    return GPT(cfg).init_weights(0)


def trained(vocab: int):
    model = tiny_model(vocab)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.tensor([[1, 2, 3]])).sum().backward()
    opt.step()
    return model, opt


def test_write_restore_and_meta(tmp_path, small_tokenizer):
    model, opt = trained(small_tokenizer.vocab_size)
    ck = Checkpointer("sft", {"run": {"run_name": "x"}}, small_tokenizer, {"plan": {"grad_accum": 2}})
    for rank in (0, 1):
        ck.write(tmp_path, rank, 2, 7, model, [opt], {"rows": {"epoch": rank}}, metrics={"loss": 1.5})
    # one optimizer file for the two ranks; per rank only its RNG and its data state
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "meta.json", "model.safetensors", "optim.pt", "rng_rank0.pt", "rng_rank1.pt",
        "state_rank0.npz", "state_rank1.npz", "tokenizer.json",
    ]  # fmt: skip
    meta = read_meta(tmp_path)
    assert (meta["stage"], meta["step"], meta["world_size"], meta["metrics"], meta["plan"]) == (
        "sft",
        7,
        2,
        {"loss": 1.5},
        {"grad_accum": 2},
    )
    assert meta["config"] == {"run": {"run_name": "x"}} and "kind" not in meta
    fresh = torch.optim.AdamW(model.parameters(), lr=0.1)
    states = ck.restore(tmp_path, 1, [fresh])
    assert states == [{"rows": {"epoch": 0}, "step": 7}, {"rows": {"epoch": 1}, "step": 7}]
    assert torch.equal(fresh.state_dict()["state"][0]["exp_avg"], opt.state_dict()["state"][0]["exp_avg"])


def test_restore_opens_only_what_the_rank_needs(tmp_path, small_tokenizer):
    """Every `open` of the process is seen by an audit hook (PEP 578): rank 1 of a new world opens the one
    optimizer file, its own RNG and the data states of all old ranks (to re-deal them), nothing else."""
    model, opt = trained(small_tokenizer.vocab_size)
    ck = Checkpointer("pretrain", {}, small_tokenizer)
    for rank in (0, 1, 2):
        ck.write(tmp_path, rank, 3, 5, model, [opt], {"rows": {"position": 10 * rank}})
    opened: list[str] = []
    watching = [True]

    def hook(event, args):
        if watching[0] and event == "open" and isinstance(args[0], str) and args[0].startswith(str(tmp_path)):
            opened.append(args[0].rsplit("/", 1)[-1])

    sys.addaudithook(hook)  # cannot be removed: it stops listening when the test ends
    try:
        states = ck.restore(tmp_path, 1, [torch.optim.AdamW(model.parameters(), lr=0.1)])
    finally:
        watching[0] = False
    assert sorted(opened) == [
        "optim.pt",
        "rng_rank1.pt",
        "state_rank0.npz",
        "state_rank1.npz",
        "state_rank2.npz",
    ]
    assert [s["rows"]["position"] for s in states] == [0, 10, 20]


def test_tree_is_compact_and_round_trips(tmp_path):
    # 256 buffered documents of 100 five-digit token ids
    buffer = [[10_000 + (97 * i + 31 * j) % 50_000 for j in range(100)] for i in range(256)]
    tree = {
        "epoch": 2, "cursor": np.arange(6, dtype=np.int64).reshape(2, 3), "buffer": buffer,
        "stats": {"placed": 12, "dropped": 0.5, "name": "best-fit"}, "short": [1, 2, 3], "big": [2**40] * 9,
        "items": [{"tokens": list(range(20)), "id": "a"}],
    }  # fmt: skip
    save_tree(tmp_path / "s.npz", tree)
    back = load_tree(tmp_path / "s.npz")
    assert back["buffer"] == buffer and back["items"] == tree["items"] and back["big"] == [2**40] * 9
    assert back["cursor"].dtype == np.int64 and back["cursor"].tolist() == [[0, 1, 2], [3, 4, 5]]
    assert {k: back[k] for k in ("epoch", "stats", "short")} == {
        k: tree[k] for k in ("epoch", "stats", "short")
    }
    # 25,600 tokens as int32: 102,400 bytes, plus the lengths (256 x int64 = 2,048) and the zip's and .npy
    # headers (under 3 KB); as JSON each document is "[" + 100 x 5 digits + 99 x ", " + "]" = 700 bytes, and
    # the list 256 x 700 + 255 x ", " + "[]" = 179,712 bytes
    size = (tmp_path / "s.npz").stat().st_size
    assert 102_400 + 2048 < size < 102_400 + 2048 + 3000
    assert len(json.dumps(buffer)) == 179_712 > 1.6 * size
    with pytest.raises(TypeError, match="object array"):
        save_tree(tmp_path / "o.npz", {"x": np.array([None])})


class RedealingRows:
    def __init__(self):
        self.states = None

    def load_state_dicts(self, states):
        self.states = states


def test_restore_rows_hands_every_old_rank_state_to_the_row_source():
    states = [{"rows": {"position": 3}, "step": 4}, {"rows": {"position": 5}, "step": 4}]
    rows = RedealingRows()
    restore_rows(rows, states)  # 2 -> any number of workers: every new rank gets every old rank's state
    assert rows.states == [{"position": 3}, {"position": 5}]


class WritesAFile:
    """Unpickling this would create `path` (what a hostile optim.pt on a shared volume could do)."""

    def __init__(self, path):
        self.path = str(path)

    def __reduce__(self):
        return (open, (self.path, "w"))


def test_optimizer_and_rng_state_never_unpickle_code(tmp_path, small_tokenizer):
    model, opt = trained(small_tokenizer.vocab_size)
    Checkpointer("pretrain", {}, small_tokenizer).write(tmp_path, 0, 1, 3, model, [opt], {"rows": {}})
    fresh = torch.optim.AdamW(model.parameters(), lr=0.1)
    load_optimizers(tmp_path, [fresh])  # real state loads with weights_only=True
    assert torch.equal(fresh.state_dict()["state"][0]["exp_avg"], opt.state_dict()["state"][0]["exp_avg"])
    assert load_rng(tmp_path, 0) is True
    planted = tmp_path / "planted"
    torch.save([WritesAFile(planted)], tmp_path / "optim.pt")
    torch.save({"torch": WritesAFile(planted), "python": None}, tmp_path / "rng_rank0.pt")
    with pytest.raises(pickle.UnpicklingError, match="Weights only load failed"):
        load_optimizers(tmp_path, [fresh])
    with pytest.raises(pickle.UnpicklingError, match="Weights only load failed"):
        load_rng(tmp_path, 0)
    assert not planted.exists()
