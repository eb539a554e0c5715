"""Where a command's CPU time goes, by process kind: run it, sample every process it starts (its descendants,
Ray's daemons and workers among them) once a second, and sum each one's last seen user + system CPU seconds
under its kind.

    python bench/suite_cpu.py [--interval 1] [--top 25] [--out FILE] -- make test

Kinds: a Ray worker by its process title (`ray::RayTrainWorker`, `ray::ServeReplica:app:Deployment`: the last
one it had that is not `ray::IDLE`), a Ray daemon by its program (raylet, gcs_server, the dashboard and its
agent, the log monitor, the autoscaler's monitor), a pytest-xdist worker, else the program and its first
arguments (script paths by their file name). Prints a markdown table (CPU-s, share of what was attributed, processes), then the machine's busy
CPU-s over the same wall time (what the sampling attributed is a lower bound: a process that lived less than
one interval is missed), then one JSON line. Exits with the command's exit status. A measurement, not a test.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import psutil

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import append_result, machine, markdown_table, uptime  # noqa: E402

DAEMONS = {
    "raylet": "ray/core/src/ray/raylet/raylet",
    "gcs_server": "ray/core/src/ray/gcs/gcs_server",
    "dashboard": "ray/dashboard/dashboard.py",
    "dashboard module": "ray-dashboard-",
    "dashboard agent": "ray/dashboard/agent.py",
    "log monitor": "ray/_private/log_monitor.py",
    "autoscaler monitor": "ray/autoscaler/_private/monitor.py",
    "ray start": "bin/ray start",
    "pytest-xdist worker": "exec(eval(sys.stdin",
}
FAMILIES = ("Ray daemon", "Ray worker", "pytest", "other")
COMM_LEN = 15  # the kernel's length of a process name (comm) without its NUL


def kind_of(titles: list[str]) -> tuple[str, str]:
    """(kind, family) of a process from the command lines it was seen with, oldest first (Ray workers change
    their process title as they take work). Family is one of FAMILIES."""
    ray_titles = [t.split()[0].split(".")[0] for t in titles if t.startswith("ray::")]
    if ray_titles:
        busy = [t for t in ray_titles if t != "ray::IDLE"]
        name = busy[-1] if busy else "ray::IDLE"
        family = "Ray daemon" if name in ("ray::DashboardAgent", "ray::RuntimeEnvAgent") else "Ray worker"
        return name, family
    joined = " ".join(titles)
    for name, marker in DAEMONS.items():
        if marker in joined:
            return name, "pytest" if name == "pytest-xdist worker" else "Ray daemon"
    argv = titles[0].split()
    if not argv:
        return "?", "other"
    words = [os.path.basename(argv[0])]
    for a in argv[1:]:  # "python3 -m raychat.cli serve", "python3 pytest", "python pretrain.py"
        if a == "-c":
            words.append(a)
            break
        if len(words) == 4 or (a.startswith("-") and a != "-m"):
            break
        words.append(os.path.basename(a))
    name = " ".join(words)
    return name, "pytest" if "pytest" in name else "other"


class Sampler:
    """The last CPU seconds and the command lines of every process descending from `root`."""

    def __init__(self, root: int):
        self.included = {root}
        self.cpu: dict[tuple[int, float], float] = {}
        self.titles: dict[tuple[int, float], list[str]] = {}

    def sample(self) -> None:
        procs = list(psutil.process_iter(["pid", "ppid", "cmdline", "cpu_times", "create_time", "name"]))
        for _ in range(2):  # a child listed before its parent is found on the second pass
            for p in procs:
                if p.info["ppid"] in self.included:
                    self.included.add(p.info["pid"])
        for p in procs:
            if p.info["pid"] not in self.included or p.info["cpu_times"] is None:
                continue
            key = (p.info["pid"], p.info["create_time"])
            cmd = " ".join(p.info["cmdline"] or [p.info["name"] or ""])[:200]
            t = p.info["cpu_times"]
            self.cpu[key] = t.user + t.system
            seen = self.titles.setdefault(key, [])
            if cmd and cmd not in seen:
                seen.append(cmd)

    def by_kind(self) -> tuple[Counter, Counter, Counter]:
        """(CPU-s by kind, processes by kind, CPU-s by family)."""
        cpu, count, family = Counter(), Counter(), Counter()
        for key, seconds in self.cpu.items():
            name, fam = kind_of(self.titles.get(key) or [""])
            cpu[name] += seconds
            count[name] += 1
            family[fam] += seconds
        # a process whose command line could not be read is named by its 15-character comm: "ray::RayTrainWo"
        for short in [k for k in cpu if k.startswith("ray::") and len(k) == COMM_LEN]:
            full = [k for k in cpu if k != short and k.startswith(short)]
            if full:
                into = max(full, key=cpu.__getitem__)
                cpu[into] += cpu.pop(short)
                count[into] += count.pop(short)
        return cpu, count, family


def busy_cpu_s() -> float:
    t = psutil.cpu_times()
    return sum(t) - t.idle - getattr(t, "iowait", 0.0)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--interval", type=float, default=1.0, help="seconds between samples")
    ap.add_argument("--top", type=int, default=25, help="kinds listed in the table")
    ap.add_argument("--out", default=None, help="append the markdown result here")
    ap.add_argument("command", nargs=argparse.REMAINDER, help="the command, after --")
    args = ap.parse_args()
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        ap.error("give the command to measure after --, e.g. -- make test")
    before, busy0, t0 = uptime(), busy_cpu_s(), time.monotonic()
    proc = subprocess.Popen(command)
    sampler = Sampler(proc.pid)
    try:
        while proc.poll() is None:
            sampler.sample()
            time.sleep(args.interval)
    except KeyboardInterrupt:
        proc.send_signal(signal.SIGINT)
        proc.wait()
    wall, busy = time.monotonic() - t0, busy_cpu_s() - busy0
    cpu, count, family = sampler.by_kind()
    total = sum(cpu.values()) or 1e-9
    rows = [
        {"kind": k, "CPU-s": round(v, 1), "share": f"{v / total:.1%}", "processes": count[k]}
        for k, v in cpu.most_common(args.top)
    ]
    fam_rows = [
        {"family": f, "CPU-s": round(family[f], 1), "share": f"{family[f] / total:.1%}"} for f in FAMILIES
    ]
    text = "\n\n".join([
        f"Command: `{' '.join(command)}` (exit status {proc.returncode}), sampled every {args.interval:g} s.",
        f"Machine: {machine()}. Load: `{before}` before, `{uptime()}` after.",
        f"Wall {wall:.0f} s; the machine's busy CPU {busy:.0f} CPU-s ({busy / wall:.2f} of {os.cpu_count()} "
        f"CPUs); attributed to the command's {len(sampler.cpu)} processes: {total:.0f} CPU-s.",
        markdown_table(fam_rows),
        markdown_table(rows),
    ])  # fmt: skip
    print(text)
    if args.out:
        append_result(args.out, text)
    print(json.dumps({
        "bench": "suite_cpu", "returncode": proc.returncode, "wall_s": round(wall, 1),
        "busy_cpu_s": round(busy, 1), "attributed_cpu_s": round(total, 1), "processes": len(sampler.cpu),
        "families": {f: round(family[f], 1) for f in FAMILIES},
        "kinds": {k: round(v, 1) for k, v in cpu.most_common(args.top)},
    }))  # fmt: skip
    return proc.returncode


if __name__ == "__main__":
    sys.exit(main())
