"""A raychat command in a process of its own over a Ray temp dir of its own, SIGTERMed at a chosen moment (e.g.
while its ray.init runs: wait_ray_starting), and what it left: its output, exit status and the processes still
naming that temp dir (tests/ray/test_serve_signals.py, tests/ray/test_training_sigterm.py)."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import tempfile
import time
from pathlib import Path

from support.cluster import RAY_STARTUP_WAIT, _cmdline, _kill_leftovers


def signalled(command: list[str], wait, **env_extra: str) -> tuple[str, int, list[int]]:
    """Run `command` (environment: this one without RAY_ADDRESS, plus `env_extra`) over a Ray temp dir of its
    own, SIGTERM it once wait(proc, ray_tmp) returned; its output (stdout and stderr together), exit status and
    the processes still naming its Ray temp dir 30 s after it exited, [] as soon as none is (killed after)."""
    ray_tmp = tempfile.mkdtemp(prefix="rcsig-", dir="/tmp")  # short: Ray's socket paths
    env = {**os.environ, **RAY_STARTUP_WAIT, "RAY_TMPDIR": ray_tmp, "RAY_AUTH_MODE": "disabled", **env_extra}
    env.pop("RAY_ADDRESS", None)
    proc = subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, start_new_session=True
    )
    try:
        wait(proc, ray_tmp)
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=90)
        # a node process killed as its parent exits is gone within moments (30 s on a loaded machine)
        deadline = time.monotonic() + 30
        while (left := naming(ray_tmp)) and time.monotonic() < deadline:
            time.sleep(0.1)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)
        _kill_leftovers(ray_tmp)
        shutil.rmtree(ray_tmp, ignore_errors=True)
    return out, proc.returncode, left


def naming(marker: str) -> list[int]:
    """Ids of the processes whose command line contains `marker`."""
    pids = [int(e.name) for e in Path("/proc").iterdir() if e.name.isdigit()]
    return [pid for pid in pids if marker in " ".join(_cmdline(pid))]


def wait_ray_starting(proc: subprocess.Popen, ray_tmp: str, timeout_s: float = 120.0) -> None:
    """Wait until the child's ray.init has created its session directory under `ray_tmp` (ray.init is under
    way: its node processes are starting; Ray's core worker installs its native SIGTERM handler later in it)."""
    deadline = time.monotonic() + timeout_s
    while not list(Path(ray_tmp).glob("ray/session_*")):
        if proc.poll() is not None:
            raise AssertionError(f"the child exited with {proc.returncode} first: {proc.stdout.read()}")
        if time.monotonic() > deadline:
            raise AssertionError("the child's Ray did not start in time")
        time.sleep(0.01)
