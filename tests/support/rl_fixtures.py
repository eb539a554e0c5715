"""Builders for the RL tests: a tiny random chat checkpoint and a small RLConfig."""

from __future__ import annotations

from pathlib import Path

from raychat.checkpoint import save_model
from raychat.checkpoint_manager import CheckpointManager
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


class BadTask:
    """A task that behaves as `task` but for a few conversations (by index): `bad_reward`'s reward raises
    ValueError, `unreadable` ones raise ValueError when an actor reads them (a bad sample inside generation).
    Picklable by value for Ray actors (tests register this module: ray.cloudpickle.register_pickle_by_value)."""

    def __init__(self, task, bad_reward=(), unreadable=()):
        self.task, self.unreadable = task, set(unreadable)
        self.bad_ids = {task[i]["id"] for i in bad_reward}

    def __len__(self) -> int:
        return len(self.task)

    def __getitem__(self, i: int) -> dict:
        if i in self.unreadable:
            raise ValueError(f"conversation {i} does not parse")
        return self.task[i]

    def reward(self, conversation: dict, completion: str) -> float:
        if conversation["id"] in self.bad_ids:
            raise ValueError(f"no reward for {conversation['id']}")
        return self.task.reward(conversation, completion)

    def is_correct(self, conversation: dict, completion: str) -> bool:
        return self.task.is_correct(conversation, completion)


class FullDisk(CheckpointManager):
    """A run's CheckpointManager on which checkpoint `full_step` cannot be written, as on a full disk: once
    prepare() has cleared its directory, the first file every upload writes there (meta.json, the first by
    name) is a symlink to /dev/full, whose every write fails with ENOSPC."""

    def __init__(self, storage, run_name: str, keep: int, full_step: int):
        super().__init__(storage, run_name, keep)
        self.full_step = full_step

    def prepare(self, step: int) -> None:
        super().prepare(step)
        if step == self.full_step:
            directory = Path(self.storage.inside(self.path(step)))
            directory.mkdir(parents=True)
            (directory / "meta.json").symlink_to("/dev/full")
