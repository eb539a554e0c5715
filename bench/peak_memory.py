"""Peak memory of a command and every process it starts (Ray's raylet, workers, actors included).

/usr/bin/time -v reports the largest single process only; a Ray job spreads over ~20 processes, so this
samples the sum of their resident set sizes (RSS) and proportional set sizes (PSS, shared pages divided
among the sharers) from /proc every --interval seconds, and reports the peaks.

    python bench/peak_memory.py --out bench/results/speedrun_memory.md -- raychat speedrun --preset cpu
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

from _common import machine


def session_pids(sid: int) -> list[int]:
    pids = []
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                if os.getsid(int(d)) == sid:
                    pids.append(int(d))
            except (ProcessLookupError, PermissionError):
                pass
    return pids


def memory_kb(pid: int) -> tuple[int, int]:
    """(RSS, PSS) in kB from /proc/<pid>/smaps_rollup; (0, 0) if the process is gone."""
    rss = pss = 0
    try:
        for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
            if line.startswith("Rss:"):
                rss = int(line.split()[1])
            elif line.startswith("Pss:"):
                pss = int(line.split()[1])
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        pass
    return rss, pss


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--interval", type=float, default=0.5, help="seconds between samples")
    p.add_argument("--out", help="append a markdown result here")
    p.add_argument("command", nargs=argparse.REMAINDER, help="-- then the command")
    a = p.parse_args()
    cmd = a.command[1:] if a.command[:1] == ["--"] else a.command
    if not cmd:
        p.error("give the command after --")
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, start_new_session=True)
    peak_rss = peak_pss = peak_procs = 0
    while proc.poll() is None:
        pids = session_pids(proc.pid)
        mem = [memory_kb(pid) for pid in pids]
        peak_rss = max(peak_rss, sum(m[0] for m in mem))
        peak_pss = max(peak_pss, sum(m[1] for m in mem))
        peak_procs = max(peak_procs, len(pids))
        time.sleep(a.interval)
    wall = time.perf_counter() - t0
    line = (
        f"| `{' '.join(cmd)}` | {wall:.0f} s | {peak_pss / 1024**2:.2f} GiB | {peak_rss / 1024**2:.2f} GiB | "
        f"{peak_procs} | exit {proc.returncode} |"
    )
    print(
        f"wall {wall:.0f} s, peak PSS {peak_pss / 1024**2:.2f} GiB, peak RSS {peak_rss / 1024**2:.2f} GiB, "
        f"{peak_procs} processes, exit {proc.returncode}"
    )
    if a.out:
        out = Path(a.out)
        if not out.exists():
            out.write_text(
                f"Machine: {machine()}.\n\n"
                "| command | wall | peak PSS (sum) | peak RSS (sum) | processes | result |\n|---|---|---|---|---|---|\n"
            )
        with out.open("a") as f:
            f.write(line + "\n")
    return proc.returncode


if __name__ == "__main__":
    sys.exit(main())
