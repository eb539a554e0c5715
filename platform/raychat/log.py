"""The one logger of every training, RL and data stage: progress lines from rank 0, from every rank on request.

A process's rank is the RANK variable that torch.distributed's launchers and Ray Train's torch backend set
(0 where it is unset: the driver, a Ray actor, a plain script). RAYCHAT_LOG_ALL_RANKS=1 logs every rank, each
line prefixed with "[rank N]". Lines go to sys.stdout through write(), not print(): Ray Train patches
builtins.print on its workers to tee into its logger as well, which shows every printed line twice on the
driver. A command's result (JSON, table rows, file lists, a dry run's plan) is printed, not logged. Counts in
every user-visible line agree with their noun: plural. A training run that ends on a failure it does not retry
(out of its failure budget, a controller failure, a non-finite loss) raises RunGaveUp, whose message is the one
line the `raychat` command ends with (raychat.cli).
"""

import os
import sys
import time
from collections.abc import Callable


def plural(n: int | float, noun: str) -> str:
    """A count in a line: '1 step', '2 steps', '1,000 steps' (`noun` singular, its plural with an s; the count
    with thousands separators, as the plan's other figures); an amount of a float such as CPUs as Ray takes it:
    '0.5 CPUs', '1 CPU', '1.75 CPUs' (a whole float as an int)."""
    if isinstance(n, float) and not n.is_integer():
        return f"{n:g} {noun}s"
    return f"{int(n):,} {noun}" if n == 1 else f"{int(n):,} {noun}s"


def size(n_bytes: int) -> str:
    """An amount of data in a line: '8 bytes', '12.3 kB', '56.00 MB' (decimal units, as the report's MB; kB up
    to what rounds to 999.9 kB: 999,950 bytes is '1.00 MB', never '1000.0 kB')."""
    if n_bytes < 1000:
        return plural(n_bytes, "byte")
    return f"{n_bytes / 1e3:.1f} kB" if n_bytes < 999_950 else f"{n_bytes / 1e6:.2f} MB"


def duration(seconds: float) -> str:
    """A span of time in a progress line (an ETA): '45s', '12m05s', '3h07m' (seconds rounded; hours past 99
    keep counting: '153h20m')."""
    s = round(max(seconds, 0))
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s // 3600}h{s % 3600 // 60:02d}m"


def rank() -> int:
    return int(os.environ.get("RANK", "0"))


def log(message: str) -> None:
    """One progress line to stdout, on rank 0 only unless RAYCHAT_LOG_ALL_RANKS=1."""
    r = rank()
    if os.environ.get("RAYCHAT_LOG_ALL_RANKS") == "1":
        message = f"[rank {r}] {message}"
    elif r != 0:
        return
    sys.stdout.write(message + "\n")
    sys.stdout.flush()


class StepClock:
    """Seconds per step of a loop, for its progress line's ETA (eta = seconds_per_step x steps left): the mean
    wall time of the steps after this process's first one, whose cold start (torch.compile, first allocations,
    the data pipeline's warm-up) the steps left do not pay again; until a second step ends, the first one's.
    A step's time is the loop's whole iteration: evaluations and checkpoint saves recur, so they count.
    E.g. a first step of 10 s, then steps of 1 s: 10, 1, 1 s/step (the mean since the start: 10, 5.5, 4)."""

    def __init__(self, clock: Callable[[], float] = time.perf_counter):
        self.clock = clock
        self.started, self.warm, self.steps = clock(), 0.0, 0

    def tick(self) -> float:
        """A step ended: seconds per step (above) so far."""
        now, self.steps = self.clock(), self.steps + 1
        if self.steps == 1:
            self.warm = now
            return now - self.started
        return (now - self.warm) / (self.steps - 1)


class TenthsProgress:
    """When a long loop's progress line is due, and its ETA: each time the units done (any unit: bytes, files,
    problems) reach another tenth of `total` units, once `quiet_s` seconds have passed since it was made (a
    loop quicker than that logs no such line). The ETA is the mean rate so far x the units left: seconds
    elapsed x (total - done) / done. `clock`: seconds (time.perf_counter). E.g. total 100, quiet_s 5: 30 done
    at 2 s -> None (quiet); 35 at 6 s -> (6.0, 11.14...) (the 3rd tenth); 38 at 7 s -> None (still the 3rd
    tenth). `total` may be 0 only for a loop that never calls due (an empty folder's reading)."""

    def __init__(self, total: int, quiet_s: float, clock: Callable[[], float] = time.perf_counter):
        self.total, self.quiet_s, self.clock = total, quiet_s, clock
        self.started, self.tenths = clock(), 0

    def due(self, done: int) -> tuple[float, float] | None:
        """`done` units of `total` done so far: (seconds elapsed, ETA in seconds) when a line is due (above),
        else None. Reads the clock once."""
        elapsed, tenths = self.elapsed(), 10 * done // self.total
        if tenths <= self.tenths or elapsed < self.quiet_s:
            return None
        self.tenths = tenths
        return elapsed, elapsed * (self.total - done) / done

    def elapsed(self) -> float:
        """Seconds since this was made."""
        return self.clock() - self.started


class RunGaveUp(RuntimeError):
    """A training run (pretrain, sft, rl) ended on a failure it does not retry again: it failed more times than
    its failure budget (--max-failures) allows, Ray Train's controller failed, or a step's loss or gradient norm
    was not finite (raychat.train.step.NonFiniteError: a retry would meet it again). Its message is one line:
    the run, what failed (the error's type and first line, the failure count and budget; or the step and what was
    not finite, and the learning rates to lower), and the checkpoint the run resumes from when started again; the
    failure itself is its __cause__, a Ray error logged in full before it is raised. `raychat` prints the line
    and exits 1 (RAYCHAT_DEBUG=1: the traceback)."""
