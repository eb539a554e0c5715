"""The metrics sink every stage logs its steps to (pretraining, SFT, RL): one place, three outputs.

  1. metrics.jsonl: one JSON object per step; a resumed run first drops the lines of the steps it redoes
     (`resume_at`), so each step is there once; the speedrun report draws its curves from it
     (raychat.report.plot_stage). On a local or NFS run directory each line is appended as it comes. Object
     storage cannot append: the sink holds the file's lines (those of an earlier run of the same name read
     first) and PUTs the whole file at most every FLUSH_EVERY_S seconds, at `flush()` and at `close()`; the
     stages flush before every checkpoint commit, so the lines of every committed step are stored and a run
     resumed after a kill has each step once, with no gap. A failed write (a full disk, an unwritable file, the
     store's outage) is one warning on stderr naming the file and the error, not an error: the run goes on (a
     checkpoint matters more than its log lines), the lines are kept and written at the next flush (local: the
     next step), and a local file is cut back to its last whole line.
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
from contextlib import suppress

from raychat.atomic import atomic_write_text
from raychat.storage import Storage, open_storage, read_bytes, write_bytes

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
        self.pending: list[str] = []  # local: lines whose append failed, written at the next flush
        self.failing = False  # the last write failed (warned once until one succeeds)
        if run_dir is not None and not local:  # the run dir is the root: metrics.jsonl lies strictly below it
            storage = open_storage(run_dir)
            self.remote = (storage, f"{storage.path}/metrics.jsonl")
            try:
                self.lines = read_bytes(*self.remote).decode(errors="replace").splitlines(keepends=True)
            except FileNotFoundError:
                pass
        self.where = self.path or (f"{self.remote[0].uri}/metrics.jsonl" if self.remote else None)
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
        with open(self.path, encoding="utf-8", errors="replace") as f:
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
        """Record one step: `stats` holds "step" (int) and the step's values (JSON-serializable). A local file
        gets the line (and any kept by a failed write) appended now; object storage gets the whole file PUT when
        FLUSH_EVERY_S have passed since the last PUT. A failed write is a warning (see flush)."""
        line = json.dumps(stats) + "\n"
        if self.path:
            self.pending.append(line)
            self.flush()
        if self.remote:
            self.lines.append(line)
            self.dirty = True
            if time.monotonic() - self.flushed_at >= FLUSH_EVERY_S:
                self.flush()
        if self.gauges is not None:
            self.gauges(stats)
        if self.tracker is not None:
            self.tracker.log(scalars({k: v for k, v in stats.items() if k != "step"}), stats["step"])

    def flush(self) -> bool:
        """Store every line logged so far (the stages call it before each checkpoint commit): on object storage
        one PUT of the whole metrics.jsonl, on a local directory an append of the lines a failed write kept.
        Returns whether they are stored. A failed write (OSError: a full disk, an unwritable file, the store's
        outage) raises nothing: one warning on stderr naming the file and the error until a write succeeds
        again, the lines kept for the next flush, and the run goes on."""
        try:
            self._write()
        except OSError as e:
            if not self.failing:
                print(
                    f"warning: metrics not written to {self.where} (kept for the next flush): {e}",
                    file=sys.stderr,
                )
            self.failing = True
            return False
        self.failing = False
        return True

    def _write(self) -> None:
        """Append the kept lines (local) or PUT the whole file (object storage, when a line is new); OSError."""
        if self.pending:
            _append(self.path, "".join(self.pending))
            self.pending = []
        if self.remote and self.dirty:
            self.flushed_at = time.monotonic()
            write_bytes(*self.remote, "".join(self.lines).encode())
            self.dirty = False

    def close(self) -> None:
        """Flush and close the tracker. A failed last write is a warning on stderr (the lines held are lost), not an
        error: close runs on every way out of a stage, its own failure included, and the lines of every
        committed step were stored at the flush before its commit (or warned about there)."""
        try:
            self._write()
        except OSError as e:
            print(f"warning: metrics not written to {self.where} at close (lines lost): {e}", file=sys.stderr)
        if self.tracker is not None:
            self.tracker.close()
            self.tracker = None


def _append(path: str, text: str) -> None:
    """Append `text` to the file at `path` (created if missing); OSError: the write failed, and whatever part of
    it reached the file (a disk that filled midway) is cut off again, so the next append starts a whole line."""
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o666)
    try:
        end, data = os.lseek(fd, 0, os.SEEK_END), text.encode()
        try:
            while data:
                data = data[os.write(fd, data) :]
        except OSError:
            with suppress(OSError):  # /dev/full and the like cannot be truncated: nothing reached them
                os.ftruncate(fd, end)
            raise
    finally:
        os.close(fd)


def read_logged(storage: Storage, path: str) -> list[dict]:
    """The lines of the metrics.jsonl at `path` on `storage` (any storage root: a directory, s3://, gs://),
    parsed, a torn one skipped; [] when there is no such file. Raises OSError as raychat.storage.read_bytes."""
    try:
        text = read_bytes(storage, path).decode(errors="replace")
    except FileNotFoundError:
        return []
    return [row for row in _parse(text.splitlines()) if row is not None]


def read_jsonl(path: str | os.PathLike) -> list[dict]:
    """The lines of a metrics.jsonl; a torn last line (a crash while appending) and a line that is no JSON object
    are skipped. Bytes that are not UTF-8 (a damaged file: the sink writes ASCII JSON) read as U+FFFD, so they
    cost their line at most, not the file (a UnicodeDecodeError)."""
    with open(path, encoding="utf-8", errors="replace") as f:
        return [row for row in _parse(f) if row is not None]


def _parse(lines) -> list[dict | None]:
    """Each line parsed (None: not valid JSON, e.g. torn, or JSON but no object, e.g. a hand-edited `5`)."""
    out = []
    for line in lines:
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            row = None
        out.append(row if isinstance(row, dict) else None)
    return out
