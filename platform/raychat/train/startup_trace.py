"""The start-up trace of a training job: with RAYCHAT_STARTUP_TRACE=<file> the job's driver and every Ray Train
worker append one line per start-up event to that file, `startup <event> <unix time s> pid=<pid> rank=<RANK>`;
the first event of a process is preceded by `process_start` (its start time from /proc, Linux; 10 ms ticks).
Unset (the default): nothing is written. bench/job_startup_cluster.py builds the timeline of a pretraining job
on the fixture cluster from these lines (its nodes share this machine's file system); bench/run_end.py times a
run's end from the last two events, `worker_fn_end` (a worker's training function returned) and
`fit_returned` (the driver's trainer.fit() returned).
"""

from __future__ import annotations

import os
import time

TRACE_ENV = "RAYCHAT_STARTUP_TRACE"
_started: set[int] = set()  # pids that have written their process_start


def process_start_time() -> float:
    """This process's start, unix seconds: boot time (now - /proc/uptime) + /proc/self/stat field 22
    (starttime, clock ticks since boot; proc(5)). Raises OSError where there is no /proc."""
    with open("/proc/self/stat") as f:
        ticks = int(f.read().rsplit(")", 1)[1].split()[19])  # fields after "(comm)" start at field 3
    with open("/proc/uptime") as f:
        boot = time.time() - float(f.read().split()[0])
    return boot + ticks / os.sysconf("SC_CLK_TCK")


def mark(event: str) -> None:
    """Append `startup <event> <now>` to $RAYCHAT_STARTUP_TRACE (nothing when unset)."""
    path = os.environ.get(TRACE_ENV)
    if not path:
        return
    who = f"pid={os.getpid()} rank={os.environ.get('RANK', '-')}"
    lines = []
    if os.getpid() not in _started:
        _started.add(os.getpid())
        try:
            lines.append(f"startup process_start {process_start_time():.3f} {who}\n")
        except OSError:
            pass
    lines.append(f"startup {event} {time.time():.3f} {who}\n")
    with open(path, "a") as f:
        f.write("".join(lines))
