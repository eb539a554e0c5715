"""The metrics sink every stage logs its steps to (pretraining, SFT, RL): one place, three outputs.

  1. metrics.jsonl: one JSON object per step; a resumed run first drops the lines of the steps it redoes
     (`resume_at`), so each step is there once; the speedrun report draws its curves from it
     (raychat.report.plot_stage). On a local or NFS run directory each line is appended as it comes. Object
     storage cannot append: the sink holds the file's lines (those of an earlier run of the same name read
     first) and PUTs the whole file at most every FLUSH_EVERY_S seconds, at `flush()` and at `close()`; the
     stages flush before every checkpoint commit, so the lines of every committed step are stored and a run
     resumed after a kill has each step once, with no gap.
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
import sys
import time
from collections.abc import Callable

from raychat.atomic import atomic_write_text
from raychat.storage import open_storage, read_bytes, write_bytes

TRACKERS = ("none", "tensorboard", "wandb")
FLUSH_EVERY_S = (
    30.0  # object storage: the longest a logged line waits for its PUT (one PUT of the whole file)
)


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
        run_dir: the run's directory (storage_path/run_name): a local path, an s3:// or gs:// URI, or None
            (no file; the gauges still get every step). metrics.jsonl and tracker/ go there.
        gauges: stats -> None, records the stage's Ray gauges (None: none).
        tracker: "none" | "tensorboard" | "wandb" (a local run_dir only: the trackers write files).
        run_name, config: the tracker's run name and its config (a nested dict).
    Raises:
        ValueError: an unknown tracker, or a tracker with a remote run_dir; ModuleNotFoundError: its library is
        not installed; OSError: a remote run_dir's metrics.jsonl could not be read (pyarrow's error).
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
        self.remote, self.lines, self.flushed_at, self.dirty = None, [], time.monotonic(), False
        self.failing = False  # the last periodic PUT failed (warned once)
        if run_dir is not None and not local:  # the run dir is the root: metrics.jsonl lies strictly below it
            storage = open_storage(run_dir)
            self.remote = (storage, f"{storage.path}/metrics.jsonl")
            try:
                self.lines = read_bytes(*self.remote).decode().splitlines(keepends=True)
            except FileNotFoundError:
                pass
        self.gauges = gauges
        self.tracker = None
        if tracker != "none":
            if not local:
                raise ValueError(f"--tracker {tracker} writes files: it needs a local --storage-path")
            kind = {"tensorboard": _TensorBoard, "wandb": _WandB}[tracker]
            self.tracker = kind(os.path.join(run_dir, "tracker"), run_name, config)

    def resume_at(self, step: int) -> int:
        """Drop the lines of steps after `step` (the checkpoint a run resumes from; 0 = a fresh start): they
        are trained again and logged anew. Rewrites a local metrics.jsonl atomically (a remote one at the next
        flush), without a line torn by a crash while appending; returns how many steps' lines went."""
        if self.remote:
            rows = _parse(self.lines)
            kept = [
                line for line, row in zip(self.lines, rows, strict=True) if row and row.get("step", 0) <= step
            ]
            dropped, self.lines = len(self.lines) - len(kept), kept
            self.dirty |= dropped > 0
            return dropped
        if not self.path or not os.path.exists(self.path):
            return 0
        with open(self.path) as f:
            raw = f.readlines()
        lines = [row for row in _parse(raw) if row is not None]
        kept = [line for line in lines if line.get("step", 0) <= step]
        if len(kept) < len(raw):  # also a line torn by a crash: the next append would join it
            atomic_write_text(self.path, "".join(json.dumps(line) + "\n" for line in kept))
        return len(lines) - len(kept)

    def logged(self) -> list[dict]:
        """The lines stored (a local file) or held (object storage) so far, parsed, a torn one skipped: after
        resume_at, those of the steps a resumed run keeps."""
        if self.remote:
            return [row for row in _parse(self.lines) if row is not None]
        return read_jsonl(self.path) if self.path and os.path.exists(self.path) else []

    def log(self, stats: dict) -> None:
        """Record one step: `stats` holds "step" (int) and the step's values (JSON-serializable). On object
        storage the file is PUT when FLUSH_EVERY_S have passed since the last PUT; a failed PUT is a warning
        (the lines are PUT again later; flush() before a checkpoint commit raises)."""
        if self.path:
            with open(self.path, "a") as f:
                f.write(json.dumps(stats) + "\n")
        if self.remote:
            self.lines.append(json.dumps(stats) + "\n")
            self.dirty = True
            if time.monotonic() - self.flushed_at >= FLUSH_EVERY_S:
                self._flush_or_warn()
        if self.gauges is not None:
            self.gauges(stats)
        if self.tracker is not None:
            self.tracker.log(scalars({k: v for k, v in stats.items() if k != "step"}), stats["step"])

    def flush(self) -> None:
        """Store every line logged so far: on object storage one PUT of the whole metrics.jsonl (OSError: it
        failed); on a local directory the lines are already there."""
        if self.remote and self.dirty:
            write_bytes(*self.remote, "".join(self.lines).encode())
            self.flushed_at, self.dirty = time.monotonic(), False

    def _flush_or_warn(self) -> None:
        """flush(); a failed PUT (the store's outage, a throttled request) is one warning on stderr until a PUT
        succeeds again, and is tried again FLUSH_EVERY_S later: the step goes on, and the lines stay held."""
        try:
            self.flush()
            self.failing = False
        except OSError as e:
            self.flushed_at = time.monotonic()
            if not self.failing:
                print(
                    f"warning: metrics.jsonl not stored at {self.remote[0].uri} (tried again later): {e}",
                    file=sys.stderr,
                )
            self.failing = True

    def close(self) -> None:
        """Flush and close the tracker. A failed last PUT is a warning on stderr, not an error: close runs on
        every way out of a stage, its own failure included, and the lines of every committed step are stored."""
        try:
            self.flush()
        except OSError as e:
            print(f"warning: metrics.jsonl not stored at {self.remote[0].uri}: {e}", file=sys.stderr)
        if self.tracker is not None:
            self.tracker.close()
            self.tracker = None


def read_jsonl(path: str | os.PathLike) -> list[dict]:
    """The lines of a metrics.jsonl; a torn last line (a crash while appending) is skipped."""
    with open(path) as f:
        return [row for row in _parse(f) if row is not None]


def _parse(lines) -> list[dict | None]:
    """Each line parsed (None: not valid JSON, e.g. torn)."""
    out = []
    for line in lines:
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            out.append(None)
    return out
