"""The checkpointer every stage shares: meta in the config's words, per-rank state, staged directories."""

from __future__ import annotations

import json

import torch

from raychat.checkpoint import read_meta, save_model
from raychat.model import GPT, ModelConfig
from raychat.train.checkpointer import Checkpointer, RunDirectory


def tiny_model(vocab: int) -> GPT:
    cfg = ModelConfig(vocab_size=vocab, n_layer=1, n_embd=32, n_head=1, n_kv_head=1, head_dim=32,
                      intermediate_size=64, max_seq_len=16)  # fmt: skip
    return GPT(cfg).init_weights(0)


def test_write_restore_and_meta(tmp_path, small_tokenizer):
    model = tiny_model(small_tokenizer.vocab_size)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.tensor([[1, 2, 3]])).sum().backward()
    opt.step()
    ck = Checkpointer("sft", {"run": {"run_name": "x"}}, small_tokenizer, {"plan": {"grad_accum": 2}})
    for rank in (0, 1):
        ck.write(tmp_path, rank, 7, model, [opt], {"rows": {"epoch": rank}}, metrics={"loss": 1.5})
    meta = read_meta(tmp_path)
    assert (meta["stage"], meta["step"], meta["metrics"], meta["plan"]) == (
        "sft",
        7,
        {"loss": 1.5},
        {"grad_accum": 2},
    )
    assert meta["config"] == {"run": {"run_name": "x"}} and "kind" not in meta
    fresh = torch.optim.AdamW(model.parameters(), lr=0.1)
    assert ck.restore(tmp_path, 1, [fresh]) == {"rows": {"epoch": 1}, "step": 7}
    assert torch.equal(fresh.state_dict()["state"][0]["exp_avg"], opt.state_dict()["state"][0]["exp_avg"])


def test_old_checkpoints_kind_reads_as_stage(tmp_path, small_tokenizer):
    save_model(tmp_path, tiny_model(small_tokenizer.vocab_size), small_tokenizer, {"kind": "rl", "step": 3})
    assert json.loads((tmp_path / "meta.json").read_text())["kind"] == "rl"
    assert read_meta(tmp_path)["stage"] == "rl"


def test_run_directory_stages_renames_and_prunes(tmp_path, small_tokenizer):
    runs, model = RunDirectory(tmp_path / "run", keep=2), tiny_model(small_tokenizer.vocab_size)
    ck = Checkpointer("rl", {}, small_tokenizer)
    for step in (1, 2, 3):
        staged = runs.staging(step)
        ck.write(staged, 0, step, model, [], {"version": step})
        assert (
            staged.name == f".tmp_checkpoint_{step:06d}"
            and not (tmp_path / "run" / f"checkpoint_{step:06d}").exists()
        )
        runs.commit(step)
    assert sorted(p.name for p in (tmp_path / "run").iterdir()) == ["checkpoint_000002", "checkpoint_000003"]
    assert runs.latest().name == "checkpoint_000003"
