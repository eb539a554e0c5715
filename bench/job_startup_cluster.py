"""Where a pretraining job's start-up goes on the fixture cluster: a timeline from submission to the first step,
for the code of another tree ("before", e.g. `git worktree add /tmp/before HEAD` plus the trace) and of this
checkout ("after"), in ABBA order on one cluster.

The cluster and the commands are bench/cluster_chain.py's (tests/support/cluster.py's LocalCluster: a head with
0 CPUs + workers a and b with 2 CPUs each; tests/support/stage_chain.py: the cpu-dev RayJobs' commands, the PVC
mapped to a temp dir): the data and tokenizer jobs run once, then the pretraining command is submitted
--repeats x 2 times with `raychat submit --env RAYCHAT_STARTUP_TRACE=<file>` (a new --run-name each, so none
resumes), its `raychat submit` run with PYTHONPATH=<tree>/platform, which makes that tree the uploaded code.
Timeline sources, all in seconds after the submission (`raychat submit` started):
  - `raychat submit`'s own output lines (its "submitted" line, the first step line), as they arrive;
  - the Jobs API's start_time (the job record created);
  - raychat.train.startup_trace lines of the driver and of each Ray Train worker (process start from /proc);
  - Ray's task events (state API): the Ray Train controller's and each worker actor's __init__ (running,
    done), the first Ray Data read+tokenize task, and every other task of the job (first running / last done).
Before the timed runs, one untimed run of each tree puts its runtime_env package on every node.
CPU: the machine's busy CPU seconds from submission to the first step line (/proc/stat: a shared machine, so
other users' work is in it) and the CPU seconds of each process started meanwhile, by kind (psutil).
Also: the losses of each run's step lines (the same seed: they must be equal in every run).

  RAY_TMPDIR=/tmp/ray-bench .venv/bin/python bench/job_startup_cluster.py --before /tmp/before \
      --out bench/results/job_startup_cluster.md
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import re
import shlex
import statistics
import sys
import tempfile
import threading
import time
from collections import defaultdict
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))

import psutil  # noqa: E402
from _common import machine  # noqa: E402
from ray.job_submission import JobSubmissionClient  # noqa: E402
from ray.util.state.api import StateApiClient  # noqa: E402
from ray.util.state.common import ListApiOptions, StateResource  # noqa: E402
from support.cluster import CLUSTER_WORKERS, LocalCluster, short_temp_dir  # noqa: E402
from support.stage_chain import manifest_commands, submit, submit_command  # noqa: E402

TRACE = re.compile(r"^startup (\S+) ([\d.]+) pid=(\d+) rank=(\S+)$")
LOSS = re.compile(r"\bstep\s+(\d+)/\d+ \| loss ([\d.]+)")
DRIVER_EVENTS = ("process_start", "driver_imports_done", "plan_printed", "ray_connected", "fit_called")
WORKER_EVENTS = (
    "process_start", "worker_fn_start", "model_built", "validators_built", "train_start", "first_batch",
    "first_step_done",
)  # fmt: skip
ROWS = [
    ("submit_line", '`raychat submit` prints "submitted" (its imports + runtime_env package upload)'),
    ("job_start_time", "Jobs API start_time (job record created)"),
    ("driver.process_start", "driver process started (job supervisor ran the entrypoint)"),
    ("driver.driver_imports_done", "driver imports done (raychat.train.pretrain.main entered)"),
    ("driver.plan_printed", "run plan printed (paths resolved, tokenizer loaded)"),
    ("driver.ray_connected", "ray.init connected, capacity read"),
    ("driver.fit_called", "TorchTrainer.fit() called"),
    ("controller.running", "Ray Train controller: __init__ running"),
    ("controller.finished", "Ray Train controller: __init__ done"),
    ("workers.running", "worker actors: __init__ running (min / max)"),
    ("workers.finished", "worker actors: __init__ done (min / max)"),
    ("worker.process_start", "worker processes started (from /proc, min / max)"),
    ("worker.worker_fn_start", "train fn entered: imports + gloo group up (min / max)"),
    ("worker.model_built", "model built (min / max)"),
    ("worker.validators_built", "row source + optimizers + validators built (min / max)"),
    ("worker.train_start", "Trainer.train() starts (min / max)"),
    ("data.running", "first Ray Data read+tokenize task running"),
    ("data.finished", "first Ray Data read+tokenize task done"),
    ("worker.first_batch", "first batch of rows in hand (Ray Data start -> first rows; min / max)"),
    ("worker.first_step_done", "first optimizer step done (min / max)"),
    ("first_step_line", "first step line reaches `raychat submit`"),
]


def load() -> str:
    return " ".join(f"{x:.1f}" for x in os.getloadavg())


def read_trace(path: Path) -> dict[str, list[float]]:
    """{"driver.<event>" | "worker.<event>": [unix times]} from a startup trace file."""
    ranks, events = {}, []
    for line in path.read_text().splitlines() if path.exists() else []:
        m = TRACE.match(line)
        if m:
            event, t, pid = m.group(1), float(m.group(2)), m.group(3)
            events.append((event, t, pid))
            if event == "worker_fn_start" or event == "driver_imports_done":
                ranks[pid] = "worker" if event == "worker_fn_start" else "driver"
    out = defaultdict(list)
    for event, t, pid in events:
        if pid in ranks:
            out[f"{ranks[pid]}.{event}"].append(t)
    return out


def task_times(address: str, job_id: str) -> dict[str, list[float]]:
    """Creation-task times of the Ray Train controller and worker actors and the first Ray Data task
    (Ray's task events: the last PENDING_NODE_ASSIGNMENT -> SUBMITTED_TO_WORKER is the lease of a process)."""
    client = StateApiClient(address, headers={"Authorization": f"Bearer {os.environ['RAY_AUTH_TOKEN']}"})
    options = ListApiOptions(limit=10000, filters=[("job_id", "=", job_id)], detail=True)
    tasks = client.list(StateResource.TASKS, options=options, raise_on_missing_output=False)
    out = defaultdict(list)
    for t in tasks:
        t = t if isinstance(t, dict) else dataclasses.asdict(t)
        name = t.get("func_or_class_name") or t.get("name") or ""
        states = {e["state"]: e["created_ms"] / 1000 for e in t.get("events") or []}
        key = (
            "controller" if name.startswith("TrainController.__init__")
            else "workers" if name.startswith("RayTrainWorker.__init__")
            else "data" if any(k in (t.get("name") or "") for k in ("ReadShare", "MapBatches"))
            else f"task {name}"
        )  # fmt: skip
        for state, suffix in (("RUNNING", "running"), ("FINISHED", "finished")):
            if state in states:
                out[f"{key}.{suffix}"].append(states[state])
    for key in ("data.running", "data.finished"):
        if out[key]:
            out[key] = [min(out[key])]  # the first Ray Data task's
    return out


OTHER = "other processes started meanwhile (not the job's: other users' work, shells)"


def process_kind(cmdline: list[str]) -> str:
    """What a process of the job is, from its command line (Ray workers set theirs to ray::<Class.method>)."""
    text = " ".join(cmdline)
    if "jobs/pretrain.py" in text:
        return "job driver (python jobs/pretrain.py)"
    if "raychat.cli submit" in text:
        return "`raychat submit` (the client)"
    if text.startswith("ray::"):
        return "ray::" + text[5:].split()[0].split(".")[0]
    return OTHER


class CpuSampler:
    """Every 0.25 s in a thread: the machine's busy and total CPU time (/proc/stat, all cores) and the CPU time
    (user + system) of every process started since the sampler was (psutil; its start times are to the second,
    so from 1 s before), with what it is (process_kind; the first name other than ray::IDLE a Ray worker
    showed)."""

    def __init__(self):
        self.t0 = time.time()
        self.samples: list[tuple[float, float, float]] = []  # (unix time, busy s, total s)
        self.procs: dict[int, tuple[str, list[tuple[float, float]]]] = {}  # pid -> (kind, [(time, cpu s)])
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self.run, daemon=True)
        self.thread.start()

    def run(self):
        tick = os.sysconf("SC_CLK_TCK")
        while not self.stop.is_set():
            now = time.time()
            with open("/proc/stat") as f:
                v = [int(x) for x in f.readline().split()[1:]]
            idle = v[3] + v[4]  # idle + iowait
            self.samples.append((now, (sum(v) - idle) / tick, sum(v) / tick))
            for proc in psutil.process_iter(["create_time", "cmdline", "cpu_times"]):
                info = proc.info
                if not info["create_time"] or info["create_time"] < self.t0 - 1.0 or not info["cpu_times"]:
                    continue
                kind, seen = self.procs.get(proc.pid, (OTHER, []))
                if kind in ("ray::IDLE", OTHER):  # a Ray worker names itself after it started
                    kind = process_kind(info["cmdline"] or [])
                seen.append((now, info["cpu_times"].user + info["cpu_times"].system))
                self.procs[proc.pid] = (kind, seen)
            self.stop.wait(0.25)

    def window(self, t1: float) -> tuple[float, float, dict[str, tuple[int, float]]]:
        """Between the start and unix time t1: (busy CPU seconds of the machine, busy fraction of all
        cores, {process kind: (processes, their CPU seconds)})."""
        self.stop.set()
        self.thread.join()
        a = min(self.samples, key=lambda s: abs(s[0] - self.t0))
        b = min(self.samples, key=lambda s: abs(s[0] - t1))
        kinds: dict[str, tuple[int, float]] = {}
        for kind, seen in self.procs.values():
            before = [cpu for t, cpu in seen if t <= t1]
            if before:
                n, total = kinds.get(kind, (0, 0.0))
                kinds[kind] = (n + 1, total + before[-1])
        return b[1] - a[1], (b[1] - a[1]) / max(b[2] - a[2], 1e-9), kinds


def one_run(label, tree, args_, i, cluster, client, workdir) -> dict:
    trace = workdir / f"trace-{i}.txt"
    stage, *stage_args = args_
    stage_args = [a if a != "pretrain" else f"su{i}-{label}" for a in stage_args]  # the --run-name value
    os.environ["PYTHONPATH"] = str(Path(tree) / "platform")
    job_id = f"su{i}-{label}"
    print(f"run {i}: {label} ({tree}) load {load()}", flush=True)
    t0, cpu = time.time(), CpuSampler()
    run = submit([stage, *stage_args], job_id, cluster.dashboard_url, cluster.token_file,
                 options=("--env", f"RAYCHAT_STARTUP_TRACE={trace}"))  # fmt: skip
    os.environ.pop("PYTHONPATH")
    info = client.get_job_info(job_id)
    times = defaultdict(list, {k: [v - t0 for v in vs] for k, vs in read_trace(trace).items()})
    for k, vs in task_times(cluster.dashboard_url, info.job_id).items():
        times[k] = [v - t0 for v in vs]
    times["job_start_time"] = [info.start_time / 1000 - t0]
    submitted = next((t for t, line in run.lines if line.startswith(f"submitted {job_id}")), None)
    times["submit_line"] = [submitted] if submitted is not None else []
    times["first_step_line"] = [run.first_step_s] if run.first_step_s is not None else []
    busy = cpu.window(t0 + (run.first_step_s or run.wall_s))
    losses = sorted({(int(s), float(v)) for s, v in LOSS.findall(run.output)})
    print(f"  exit {run.returncode}, first step {run.first_step_s}, wall {run.wall_s:.1f}, losses {losses}",
          flush=True)  # fmt: skip
    if run.returncode != 0:
        print(run.output[-3000:])
    return {"label": label, "times": dict(times), "losses": losses, "rc": run.returncode, "wall": run.wall_s,
            "load": load(), "busy": busy}  # fmt: skip


def cell(vs: list[float]) -> str:
    if not vs:
        return ""
    return f"{min(vs):.1f}" if len(vs) == 1 or max(vs) - min(vs) < 0.05 else f"{min(vs):.1f} / {max(vs):.1f}"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--before", required=True, help="the tree whose code is 'before' (its platform/raychat)")
    p.add_argument("--repeats", type=int, default=2, help="ABBA pairs")
    p.add_argument("--out", required=True)
    a = p.parse_args()
    os.environ["RAY_AUTH_MODE"] = "token"
    load_before = load()
    cluster = LocalCluster(short_temp_dir("rcs"))
    runs = []
    try:
        cluster.start(CLUSTER_WORKERS)
        os.environ["RAY_AUTH_TOKEN"] = cluster.token
        client = JobSubmissionClient(
            cluster.dashboard_url, headers={"Authorization": f"Bearer {cluster.token}"}
        )
        with tempfile.TemporaryDirectory(prefix="raychat-pvc-") as mount:
            commands = manifest_commands(Path(mount))
            for n, (rayjob, command) in enumerate(commands[:2]):  # data, tokenizer
                stage = Path(shlex.split(command)[1]).stem
                r = submit_command(
                    command, rayjob, f"su-{n}-{stage}", cluster.dashboard_url, cluster.token_file
                )
                assert r.returncode == 0, r.output[-3000:]
            rayjob, command = commands[2]
            assert "jobs/pretrain.py" in command, command
            stage_args = ["pretrain", *shlex.split(command)[2:]]
            order = [("before", a.before), ("after", str(REPO))]
            for label, tree in order:  # each tree's runtime_env package on every node, before timing
                one_run(f"warm{label}", tree, stage_args, 90, cluster, client, Path(mount))
            i = 0
            for k in range(a.repeats):
                for label, tree in order if k % 2 == 0 else order[::-1]:
                    runs.append(one_run(label, tree, stage_args, i, cluster, client, Path(mount)))
                    i += 1
    finally:
        cluster.stop()
    first = {lab: [r["times"]["first_step_line"][0] for r in runs if r["label"] == lab and r["times"].get("first_step_line")]
             for lab in ("before", "after")}  # fmt: skip
    losses = {tuple(r["losses"]) for r in runs}
    header = " | ".join(f"{r['label']} {n + 1}" for n, r in enumerate(runs))
    lines = [
        "# Pretraining start-up on the fixture cluster: a timeline, before vs after (issue 24 item 4)",
        "",
        f"Command: `RAY_TMPDIR={os.environ.get('RAY_TMPDIR', '')} .venv/bin/python bench/job_startup_cluster.py "
        f"--before {a.before} --repeats {a.repeats} --out {a.out}`",
        f"Machine: {machine()}. Load average (1, 5, 15 min) before: {load_before}; after: {load()}; per run: "
        + ", ".join(f"{r['label']} {r['load']}" for r in runs)
        + ".",
        "",
        "Seconds after `raychat submit` started (runs in the order they ran; `x / y` = first / last rank or "
        "process).",
        "",
        f"| event | {header} |",
        "|---|" + "---:|" * len(runs),
    ]
    for key, text in ROWS:
        lines.append(f"| {text} | " + " | ".join(cell(r["times"].get(key, [])) for r in runs) + " |")
    lines += [
        "| exit code | " + " | ".join(str(r["rc"]) for r in runs) + " |",
        "| job wall s | " + " | ".join(f"{r['wall']:.1f}" for r in runs) + " |",
        "| machine CPU s busy, submission -> first step line (all processes, 2 cores) | "
        + " | ".join(f"{r['busy'][0]:.1f}" for r in runs)
        + " |",
        "| the same, as a fraction of the 2 cores | "
        + " | ".join(f"{r['busy'][1]:.0%}" for r in runs)
        + " |",
        "",
    ]
    kinds = sorted(
        {k for r in runs for k in r["busy"][2]},
        key=lambda k: -sum(r["busy"][2].get(k, (0, 0))[1] for r in runs),
    )
    kinds = [k for k in kinds if k != OTHER] + [OTHER]
    lines += [
        "CPU seconds (user + system) of the processes started after the submission, by kind, up to the first "
        "step line (`n x` processes; psutil every 0.25 s, so a process that lived less than that is missed):",
        "",
        f"| process | {header} |",
        "|---|" + "---:|" * len(runs),
    ]
    for kind in kinds:
        cells = [r["busy"][2].get(kind) for r in runs]
        lines.append(f"| {kind} | " + " | ".join(f"{c[0]} x, {c[1]:.1f}" if c else "" for c in cells) + " |")
    lines.append(
        "| the job's processes (all but the last row) | "
        + " | ".join(f"{sum(c[1] for k, c in r['busy'][2].items() if k != OTHER):.1f}" for r in runs)
        + " |"
    )
    lines += ["", "Other Ray tasks of the job (first running / last finished):", ""]
    lines += [f"| task | {header} |", "|---|" + "---:|" * len(runs)]
    others = sorted({k.rsplit(".", 1)[0] for r in runs for k in r["times"] if k.startswith("task ")})
    for name in others:
        cells = []
        for r in runs:
            run_s, fin = r["times"].get(f"{name}.running", []), r["times"].get(f"{name}.finished", [])
            cells.append(f"{min(run_s):.1f}" if run_s else "")
            cells[-1] += f" / {max(fin):.1f}" if fin else ""
        lines.append(f"| {name[5:]} | " + " | ".join(cells) + " |")
    lines.append("")
    if first["before"] and first["after"]:
        b, f = statistics.median(first["before"]), statistics.median(first["after"])
        lines.append(
            f"Submission -> first pretraining step line, median: before {b:.1f} s, after {f:.1f} s: "
            f"**{b / f:.2f}x** ({', '.join(f'{x:.1f}' for x in first['before'])} vs "
            f"{', '.join(f'{x:.1f}' for x in first['after'])})."
        )
    lines.append(f"Losses of every run equal: {len(losses) == 1} ({sorted(losses)[0] if losses else ''}).")
    lines.append("")
    report = "\n".join(lines)
    Path(a.out).write_text(report)
    print(report)
    return 0 if all(r["rc"] == 0 for r in runs) and len(losses) == 1 else 1


if __name__ == "__main__":
    sys.exit(main())
