"""Where a command's CPU time goes, by process kind: run it, sample every process it starts (its descendants,
Ray's daemons and workers among them) once a second, and sum each one's last seen user + system CPU seconds
under its kind.

    python bench/suite_cpu.py [--interval 1] [--top 25] [--out FILE] -- make test

Kinds: a Ray worker by its process title (`ray::RayTrainWorker`, `ray::ServeReplica:app:Deployment`: the last
one it had that is not `ray::IDLE`), a Ray daemon by its program (raylet, gcs_server, the dashboard and its
agent, the log monitor, the autoscaler's monitor), a pytest-xdist worker, else the program and its first
arguments (script paths by their file name). Prints a markdown table (CPU-s, share of what was attributed,
processes), then the machine's busy CPU-s over the same wall time, then one JSON line. What was attributed is
a lower bound: a process's CPU after its last sample (up to one interval of it, all of a process that lived
less than one) is missed. Exits with the command's exit status (128 + N if signal N ended it, as a shell
does). A measurement, not a test.
"""

from __future__ import annotations

import argparse
import json
import os
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
    their process title as they take work): its last Ray title that is not IDLE, else its last line. Family is
    one of FAMILIES."""
    ray_titles = [t.split()[0].split(".")[0] for t in titles if t.startswith("ray::")]
    if ray_titles:
        busy = [t for t in ray_titles if t != "ray::IDLE"]
        name = busy[-1] if busy else "ray::IDLE"
        family = "Ray daemon" if name in ("ray::DashboardAgent", "ray::RuntimeEnvAgent") else "Ray worker"
        return name, family
    last = titles[-1]  # a child seen between fork and exec showed its parent's line first
    for name, marker in DAEMONS.items():
        if marker in last:
            return name, "pytest" if name == "pytest-xdist worker" else "Ray daemon"
    argv = last.split()
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
    """The last CPU seconds and the command lines of every process descending from `root`. A process is
    (pid, create_time), so a reused pid is a new process; it descends from root when its parent, created
    before it, does."""

    def __init__(self, root: int):
        self.root = root
        self.included: set[tuple[int, float]] = set()
        self.cpu: dict[tuple[int, float], float] = {}
        self.titles: dict[tuple[int, float], list[str]] = {}

    def sample(self) -> None:
        procs = [
            p.info
            for p in psutil.process_iter(["pid", "ppid", "cmdline", "cpu_times", "create_time", "name"])
        ]
        by_pid = {i["pid"]: i for i in procs if i["create_time"] is not None}
        keys = {pid: (pid, i["create_time"]) for pid, i in by_pid.items()}
        if self.root in keys:
            self.included.add(keys[self.root])
        grew = True
        while grew:  # until no new generation joins (a child may be listed before its parent)
            grew = False
            for pid, i in by_pid.items():
                parent = by_pid.get(i["ppid"])
                if keys[pid] in self.included or parent is None or keys[parent["pid"]] not in self.included:
                    continue
                if parent["create_time"] <= i["create_time"]:
                    self.included.add(keys[pid])
                    grew = True
        for pid, i in by_pid.items():
            if keys[pid] not in self.included or i["cpu_times"] is None:
                continue
            self.cpu[keys[pid]] = i["cpu_times"].user + i["cpu_times"].system
            seen = self.titles.setdefault(keys[pid], [])
            # its name (the 15-character comm) only while no command line was read: an exiting process has none
            cmd = " ".join(i["cmdline"] or [])[:200] or ("" if seen else i["name"] or "")
            if cmd and cmd not in seen:
                seen.append(cmd)

    def by_kind(self) -> tuple[Counter, Counter, Counter]:
        """(CPU-s by kind, processes by kind, CPU-s by family)."""
        cpu, count, family_of = Counter(), Counter(), {}
        for key, seconds in self.cpu.items():
            name, family_of[name] = kind_of(self.titles.get(key) or [""])
            cpu[name] += seconds
            count[name] += 1
        # a process whose command line could not be read is named by its 15-character comm: "ray::RayTrainWo";
        # counted under the one kind it cuts (one that cuts several, or none, stays as it is)
        for short in [k for k in cpu if k.startswith("ray::") and len(k) == COMM_LEN]:
            full = [k for k in cpu if k != short and k.startswith(short)]
            if len(full) == 1:
                cpu[full[0]] += cpu.pop(short)
                count[full[0]] += count.pop(short)
        family = Counter()
        for name, seconds in cpu.items():
            family[family_of[name]] += seconds
        return cpu, count, family


def busy_cpu_s() -> float:
    """CPU seconds the machine's CPUs spent busy since boot (not idle, waiting on I/O, stolen, or in guests,
    which user time already counts)."""
    t = psutil.cpu_times()
    spare = ("idle", "iowait", "steal", "guest", "guest_nice")
    return sum(t) - sum(getattr(t, f, 0.0) for f in spare)


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
    while proc.poll() is None:
        try:
            sampler.sample()
            time.sleep(args.interval)
        except KeyboardInterrupt:  # the terminal's Ctrl-C reached the command too: report once it has ended
            pass
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
    return 128 - proc.returncode if proc.returncode < 0 else proc.returncode  # killed by a signal: as a shell


if __name__ == "__main__":
    sys.exit(main())
