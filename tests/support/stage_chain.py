"""The chain of stages as Ray jobs on a real cluster, as the KubeRay manifests run it.

Each RayJob of the cpu-dev overlay (k8s/overlays/cpu-dev rendered by kustomize; the `tiny` preset) in the order
they chain (raychat.ops.k8s.CHAIN: data, tokenizer, pretrain, sft, rl, eval, export) has an entrypoint of one
command, `python jobs/<stage>.py ARGS`. With the PVC mount (/mnt/checkpoints) mapped to a local directory,
every such command is submitted with `raychat submit <stage> ARGS` (working_dir +
py_modules: the code of this checkout), one Ray job each, in order, each followed to its end; the entrypoint
that `raychat submit` reports must be that command exactly.

Used by tests/cluster/test_stage_jobs.py and bench/cluster_chain.py (which times each job's start-up).
"""

from __future__ import annotations

import re
import shlex
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from raychat.ops import k8s
from support.kustomize import kustomize_build

REPO = Path(__file__).resolve().parents[2]
CPU_DEV = REPO / "k8s" / "overlays" / "cpu-dev"
RAYCHAT = [sys.executable, "-m", "raychat.cli"]
# the first step line of a Ray Train worker (raychat.train.trainer.Trainer.log_step) or of RL (raychat.rl.loop)
FIRST_STEP = re.compile(r"\bstep\s+1/\d+ \||\bstep=1/\d+ ")
JOB_TIMEOUT_S = 900


@dataclass
class JobRun:
    """One submitted command: what ran, how it ended, its output and times (seconds since submission)."""

    rayjob: str  # the RayJob it came from, e.g. raychat-pretrain
    job_id: str
    command: str  # the command of the manifest, mount mapped
    submitted: str = ""  # the entrypoint `raychat submit` reported
    returncode: int | None = None
    output: str = ""
    wall_s: float = 0.0
    first_step_s: float | None = None
    lines: list[tuple[float, str]] = field(default_factory=list)


def manifest_commands(mount_dir: Path) -> list[tuple[str, str]]:
    """[(RayJob name, command)] of the cpu-dev overlay's RayJobs in chain order, the PVC mount path replaced
    by mount_dir."""
    docs = kustomize_build(CPU_DEV)
    entrypoints = {d["metadata"]["name"]: d["spec"]["entrypoint"] for d in docs if d["kind"] == "RayJob"}
    out = []
    for stage in k8s.CHAIN:
        name = f"raychat-{stage}"
        out.append((name, entrypoints[name].replace(k8s.CHECKPOINTS_MOUNT, str(mount_dir))))
    return out


def submit_command(command: str, rayjob: str, job_id: str, address: str, token_file: Path) -> JobRun:
    """`raychat submit ... <stage> ARGS` (see submit) of the command `python jobs/<stage>.py ARGS`."""
    python, script, *args = shlex.split(command)
    stage = Path(script).stem
    assert (python, script) == ("python", f"jobs/{stage}.py"), command
    return submit([stage, *args], job_id, address, token_file, rayjob=rayjob, command=command)


def submit(
    stage_args: list[str],
    job_id: str,
    address: str,
    token_file: Path,
    options: tuple[str, ...] = (),
    rayjob: str = "",
    command: str = "",
) -> JobRun:
    """`raychat submit --address A --token-file T --job-id ID [options] <stage> ARGS`, followed to the job's
    end (the exit code is the job's status); the output lines are timed from the submission."""
    run = JobRun(rayjob, job_id, command)
    argv = [*RAYCHAT, "submit", "--address", address, "--token-file", str(token_file), "--job-id", job_id]
    t0 = time.monotonic()
    proc = subprocess.Popen(
        [*argv, *options, *stage_args], cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    deadline = t0 + JOB_TIMEOUT_S
    try:
        for line in proc.stdout:
            now = time.monotonic() - t0
            run.lines.append((now, line))
            if run.first_step_s is None and FIRST_STEP.search(line):
                run.first_step_s = now
            if line.startswith(f"submitted {job_id}: "):
                run.submitted = line[len(f"submitted {job_id}: ") :].rstrip("\n")
            if time.monotonic() > deadline:
                raise TimeoutError(f"job {job_id} still running after {JOB_TIMEOUT_S} s")
        run.returncode = proc.wait(60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    run.wall_s = time.monotonic() - t0
    run.output = "".join(line for _, line in run.lines)
    return run


def run_chain(mount_dir: Path, address: str, token_file: Path, prefix: str = "chain") -> list[JobRun]:
    """Every command of manifest_commands(mount_dir), in order; stops after the first that fails."""
    runs = []
    for i, (rayjob, command) in enumerate(manifest_commands(mount_dir)):
        stage = Path(shlex.split(command)[1]).stem
        runs.append(submit_command(command, rayjob, f"{prefix}-{i}-{stage}", address, token_file))
        if runs[-1].returncode != 0:
            break
    return runs
