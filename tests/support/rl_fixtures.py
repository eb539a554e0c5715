"""Builders for the RL tests: a tiny random chat checkpoint and a small RLConfig."""

from __future__ import annotations

from pathlib import Path

from raychat.checkpoint import save_model
from raychat.config import RLConfig, from_dict
from raychat.model import GPT, ModelConfig


def tiny_checkpoint(directory: Path, tokenizer, seed: int = 0, depth: int = 1, width: int = 64) -> str:
    """depth 1, width 64 GPT with the model's documented init (seeded), saved as a raychat checkpoint."""
    cfg = ModelConfig(
        vocab_size=tokenizer.vocab_size, n_layer=depth, n_embd=width, n_head=2, n_kv_head=2, head_dim=width // 2,
        intermediate_size=2 * width, max_seq_len=96,
    )  # fmt: skip
    model = GPT(cfg).init_weights(seed)
    save_model(directory, model, tokenizer, {"stage": "test", "step": 0}, commit=True)
    return str(directory)


def rl_config(**options) -> RLConfig:
    """An RLConfig from options by flat name (the --flag names)."""
    return from_dict(RLConfig, options)


def tiny_config(checkpoint: str, out: str, **kw) -> RLConfig:
    base = dict(
        init_from=checkpoint, storage_path=out, run_name="t", steps=2, task_examples=64, max_operand=9,
        prompts_per_step=4, samples_per_prompt=2, max_tokens=6, micro_batch_size=8, rollout_workers=2,
        learner_workers=1, cpus_per_rollout=0.5, cpus_per_learner=0.5, eval_every=100, eval_examples=4,
        eval_samples=2, checkpoint_every=1, max_restarts=2,
    )  # fmt: skip
    base.update(kw)
    return from_dict(RLConfig, base)
