"""The metrics sink every stage logs its steps to (pretraining, SFT, RL): one place, three outputs.

  1. metrics.jsonl: one JSON object per step, appended and flushed (local storage only); a resumed run
     first drops the lines of the steps it redoes (`resume_at`), so each step is there once; the speedrun
     report draws its curves from it (raychat.report.plot_stage).
  2. Ray gauges (raychat.metrics: raychat_train_* / raychat_rl_*) through a stage's `gauges(stats)` callable.
  3. On request (--tracker): TensorBoard event files (torch.utils.tensorboard, the `tensorboard` package) or
     Weights & Biases in offline mode (`wandb`, nothing leaves the machine; `wandb sync DIR` uploads later),
     under <run dir>/tracker/. Every numeric value is a scalar at the step; nested dicts (RL's "eval") are
     flattened as "eval/pass@1".

Both trackers are the optional extra `raychat[tracking]`; asking for one that is not installed raises
ModuleNotFoundError naming the extra.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable

from raychat.atomic import atomic_write_text

TRACKERS = ("none", "tensorboard", "wandb")


def scalars(stats: dict, prefix: str = "") -> dict[str, float]:
    """The numeric values of `stats` (bools and None left out), nested dicts flattened as "key/sub"."""
    out: dict[str, float] = {}
    for key, value in stats.items():
        if isinstance(value, dict):
            out.update(scalars(value, f"{prefix}{key}/"))
        elif isinstance(value, (int, float)) and not isinstance(value, bool):
            out[f"{prefix}{key}"] = float(value)
    return out


class _TensorBoard:
    def __init__(self, directory: str, run_name: str, config: dict | None):
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ModuleNotFoundError as e:
            raise ModuleNotFoundError("--tracker tensorboard needs pip install 'raychat[tracking]'") from e
        self.writer = SummaryWriter(log_dir=directory)
        if config:
            self.writer.add_text("config", f"```\n{json.dumps(config, indent=1, default=str)}\n```")

    def log(self, values: dict[str, float], step: int) -> None:
        for key, value in values.items():
            self.writer.add_scalar(key, value, global_step=step)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


class _WandB:
    def __init__(self, directory: str, run_name: str, config: dict | None):
        try:
            import wandb
        except ModuleNotFoundError as e:
            raise ModuleNotFoundError("--tracker wandb needs pip install 'raychat[tracking]'") from e
        os.makedirs(directory, exist_ok=True)
        self.run = wandb.init(mode="offline", dir=directory, project="raychat", name=run_name, config=config)

    def log(self, values: dict[str, float], step: int) -> None:
        self.run.log(values, step=step)

    def close(self) -> None:
        self.run.finish()


class MetricsSink:
    """Per-step metrics of one run (see the module doc). Only rank 0 of a stage builds one.

    Args:
        run_dir: the run's directory (storage_path/run_name); metrics.jsonl and tracker/ go there. A URL
            (s3://...) or None writes no files (the gauges still get every step).
        gauges: stats -> None, records the stage's Ray gauges (None: none).
        tracker: "none" | "tensorboard" | "wandb".
        run_name, config: the tracker's run name and its config (a nested dict).
    Raises:
        ValueError: an unknown tracker; ModuleNotFoundError: its library is not installed.
    """

    def __init__(
        self,
        run_dir: str | os.PathLike | None,
        gauges: Callable[[dict], None] | None = None,
        tracker: str = "none",
        run_name: str = "run",
        config: dict | None = None,
    ):
        if tracker not in TRACKERS:
            raise ValueError(f"--tracker must be one of {list(TRACKERS)}, got {tracker!r}")
        local = run_dir is not None and "://" not in str(run_dir)
        self.path = os.path.join(run_dir, "metrics.jsonl") if local else None
        if self.path:
            os.makedirs(os.path.dirname(self.path), exist_ok=True)
        self.gauges = gauges
        self.tracker = None
        if tracker != "none":
            if not local:
                raise ValueError(f"--tracker {tracker} writes files: it needs a local --storage-path")
            kind = {"tensorboard": _TensorBoard, "wandb": _WandB}[tracker]
            self.tracker = kind(os.path.join(run_dir, "tracker"), run_name, config)

    def resume_at(self, step: int) -> int:
        """Drop the lines of steps after `step` (the checkpoint a run resumes from; 0 = a fresh start): they
        are trained again and logged anew. Rewrites metrics.jsonl atomically; returns how many lines went."""
        if not self.path or not os.path.exists(self.path):
            return 0
        lines = read_jsonl(self.path)
        kept = [line for line in lines if line.get("step", 0) <= step]
        if len(kept) < len(lines):
            atomic_write_text(self.path, "".join(json.dumps(line) + "\n" for line in kept))
        return len(lines) - len(kept)

    def log(self, stats: dict) -> None:
        """Record one step: `stats` holds "step" (int) and the step's values (JSON-serializable)."""
        if self.path:
            with open(self.path, "a") as f:
                f.write(json.dumps(stats) + "\n")
        if self.gauges is not None:
            self.gauges(stats)
        if self.tracker is not None:
            self.tracker.log(scalars({k: v for k, v in stats.items() if k != "step"}), stats["step"])

    def close(self) -> None:
        if self.tracker is not None:
            self.tracker.close()
            self.tracker = None


def read_jsonl(path: str | os.PathLike) -> list[dict]:
    """The lines of a metrics.jsonl; a torn last line (a crash while appending) is skipped."""
    out = []
    with open(path) as f:
        for line in f:
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError:
                continue
    return out
