"""RL run configuration: one dataclass; YAML (a file, top level or an `rl:` section) and flags override.

Every field is a `--flag` of `raychat rl` with the help text below; `RLConfig.to_yaml()` writes the full
resolved config next to the run's checkpoints.
"""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from raychat.rl.objective import NORMALIZATIONS

MODES = ("sync", "async")
WEIGHT_SYNCS = ("object_store", "collective")
TASKS = ("calculator",)


def _f(default, help: str, choices=None):
    return field(default=default, metadata={"help": help, "choices": choices})


@dataclass
class RLConfig:
    # run
    checkpoint: str = _f("", "chat (SFT) checkpoint directory to start from (required)")
    out: str = _f("runs/rl", "output root; checkpoints go to OUT/RUN_NAME/checkpoint_<step>")
    run_name: str = _f("rl", "run name; running again with the same --out and --run-name resumes")
    seed: int = _f(0, "seed of the prompt order and of sampling")
    steps: int = _f(50, "learner steps (policy versions published)")
    # task
    task: str = _f("calculator", "task the prompts and rewards come from", TASKS)
    task_examples: int = _f(10_000, "training prompts (train split)")
    max_operand: int = _f(999, "calculator: operands are drawn from 0..max_operand")
    # rollouts
    prompts_per_step: int = _f(8, "prompts per learner step")
    samples_per_prompt: int = _f(8, "G: samples per prompt (the advantage group)")
    max_tokens: int = _f(48, "completion budget per sample, tokens (sampled + tool output)")
    temperature: float = _f(1.0, "rollout sampling temperature (> 0)")
    # objective
    normalization: str = _f("token", "loss normalization over the step", list(NORMALIZATIONS))
    scale_by_std: bool = _f(False, "divide advantages by the group's reward std (GRPO); off = Dr. GRPO")
    constant_length: int = _f(-1, "denominator length for --normalization constant; -1 = --max-tokens")
    clip_eps: float = _f(0.2, "importance-ratio clip epsilon (async mode)")
    # optimizer (raychat.train.optim.build_optimizers: Muon for matrices, AdamW for the rest)
    matrix_lr: float = _f(0.0002, "Muon learning rate for hidden weight matrices")
    embedding_lr: float = _f(0.001, "AdamW learning rate for the token embedding")
    unembedding_lr: float = _f(0.001, "AdamW learning rate for lm_head")
    scalar_lr: float = _f(0.001, "AdamW learning rate for norm weights")
    weight_decay: float = _f(0.0, "Muon weight decay")
    grad_clip: float = _f(1.0, "clip the global grad norm to this (0 = off)")
    micro_batch_size: int = _f(16, "sequences per learner forward/backward")
    # asynchrony
    mode: str = _f("sync", "sync: on-policy; async: rollouts run ahead of the learner", list(MODES))
    max_staleness: int = _f(1, "async: rollouts use weights at most this many versions old (k >= 1)")
    # topology
    rollout_workers: int = _f(2, "rollout actors (each holds an engine)")
    learner_workers: int = _f(1, "learner actors (data parallel; gloo on CPU, nccl on GPU)")
    cpus_per_rollout: float = _f(0.5, "CPUs each rollout actor reserves")
    cpus_per_learner: float = _f(0.5, "CPUs each learner actor reserves")
    use_gpu: bool = _f(False, "one GPU per rollout and learner actor")
    weight_sync: str = _f(
        "object_store",
        "object_store: one ray.put, every rollout gets it; collective: broadcast",
        list(WEIGHT_SYNCS),
    )
    max_restarts: int = _f(3, "restarts of a dead rollout actor (its prompts are re-issued)")
    # evaluation, checkpoints
    eval_every: int = _f(
        10, "steps between pass@k evaluations on held-out prompts (and at step 0 and the end)"
    )
    eval_examples: int = _f(64, "held-out (test split) prompts per evaluation")
    eval_samples: int = _f(8, "samples per held-out prompt; pass@k for k = 1..this")
    eval_temperature: float = _f(1.0, "sampling temperature of the evaluation")
    checkpoint_every: int = _f(10, "steps between checkpoints (and at the end)")
    keep_checkpoints: int = _f(2, "checkpoints kept (the newest)")

    def validate(self) -> None:
        """Raise ValueError naming the flag and the allowed values for any bad setting."""
        for f in dataclasses.fields(self):
            choices = f.metadata.get("choices")
            if choices and getattr(self, f.name) not in choices:
                raise ValueError(f"--{_flag(f.name)} must be one of {choices}, got {getattr(self, f.name)!r}")
        for name in (
            "steps", "prompts_per_step", "samples_per_prompt", "max_tokens", "task_examples", "max_operand",
            "micro_batch_size", "rollout_workers", "learner_workers", "eval_every", "eval_examples",
            "eval_samples", "checkpoint_every", "keep_checkpoints", "max_staleness",
        ):  # fmt: skip
            if getattr(self, name) < 1:
                raise ValueError(f"--{_flag(name)} must be >= 1, got {getattr(self, name)}")
        for name in ("temperature", "cpus_per_rollout", "cpus_per_learner"):
            if getattr(self, name) <= 0:
                raise ValueError(f"--{_flag(name)} must be > 0, got {getattr(self, name)}")
        if self.eval_temperature < 0 or self.max_restarts < 0 or self.clip_eps <= 0 or self.grad_clip < 0:
            raise ValueError(
                "--eval-temperature, --max-restarts, --grad-clip must be >= 0 and --clip-eps > 0"
            )
        if self.constant_length != -1 and self.constant_length < 1:
            raise ValueError(f"--constant-length must be >= 1 or -1, got {self.constant_length}")

    @property
    def denominator_length(self) -> int:
        """L of the constant normalization."""
        return self.max_tokens if self.constant_length == -1 else self.constant_length

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def to_yaml(self) -> str:
        return yaml.safe_dump({"rl": self.to_dict()}, sort_keys=False)

    @classmethod
    def from_yaml(cls, path: str | Path) -> RLConfig:
        """Read a YAML file (fields at top level or under `rl:`). ValueError on unknown keys."""
        return cls(**read_yaml(path))


def _flag(name: str) -> str:
    return name.replace("_", "-")


def read_yaml(path: str | Path) -> dict:
    p = Path(path)
    if not p.exists():
        raise FileNotFoundError(f"config file {p} does not exist")
    data = yaml.safe_load(p.read_text()) or {}
    section = data.get("rl", data)
    unknown = set(section) - {f.name for f in dataclasses.fields(RLConfig)}
    if unknown:
        raise ValueError(f"{p}: unknown rl settings {sorted(unknown)}")
    return section


def add_config_flags(parser: argparse.ArgumentParser) -> None:
    """--config YAML plus one --flag per RLConfig field (default None = keep the YAML's or the default)."""
    parser.add_argument("--config", default=None, help="YAML file of RLConfig fields (top level or `rl:`)")
    for f in dataclasses.fields(RLConfig):
        help = f"{f.metadata['help']} (default: {f.default})"
        if f.type in ("bool", bool):
            parser.add_argument(
                "--" + _flag(f.name), default=None, action=argparse.BooleanOptionalAction, help=help
            )
        else:
            typ = {"int": int, "float": float, "str": str}[
                f.type if isinstance(f.type, str) else f.type.__name__
            ]
            parser.add_argument(
                "--" + _flag(f.name), default=None, type=typ, choices=f.metadata.get("choices"), help=help
            )


def config_from_args(args: argparse.Namespace) -> RLConfig:
    values = read_yaml(args.config) if getattr(args, "config", None) else {}
    for f in dataclasses.fields(RLConfig):
        v = getattr(args, f.name, None)
        if v is not None:
            values[f.name] = v
    cfg = RLConfig(**values)
    cfg.validate()
    return cfg
