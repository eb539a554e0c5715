"""How `raychat serve` ends: Ctrl-C (SIGINT) and SIGTERM (`kill`, `docker stop`, Kubernetes) both shut Serve down
and print one line, with no traceback (raychat.serve.cli._block). The wait loop runs in a child process over a
real local Ray with Serve started (no app: the shutdown path is the same), so the signal meets Ray's own
handlers as it does in `raychat serve`."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time

from support.cluster import RAY_STARTUP_WAIT, _kill_leftovers
from support.serve_process import free_port

SCRIPT = """
import sys, ray
from ray import serve
from raychat.serve.cli import _block
ray.init(num_cpus=1, include_dashboard=False, log_to_driver=False)
serve.start(http_options={"host": "127.0.0.1", "port": int(sys.argv[1])})
print("ready", flush=True)
sys.exit(_block())
"""


def test_serve_ends_on_sigterm_as_on_ctrl_c_with_one_line():
    """SIGTERM ends the wait loop as Ctrl-C does (Ray's own SIGTERM handler printed a native stack trace and
    left Serve up); both go the same way from there (_block)."""
    sig = signal.SIGTERM
    ray_tmp = tempfile.mkdtemp(prefix="rcsig-", dir="/tmp")  # short: Ray's socket paths
    env = {**os.environ, **RAY_STARTUP_WAIT, "RAY_TMPDIR": ray_tmp, "RAY_AUTH_MODE": "disabled"}
    env.pop("RAY_ADDRESS", None)
    proc = subprocess.Popen(
        [sys.executable, "-c", SCRIPT, str(free_port())],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, start_new_session=True,
    )  # fmt: skip
    try:
        _wait_ready(proc)
        proc.send_signal(sig)
        out, _ = proc.communicate(timeout=90)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)
        _kill_leftovers(ray_tmp)
        shutil.rmtree(ray_tmp, ignore_errors=True)
    name = signal.Signals(sig).name
    assert proc.returncode == 0, out
    assert "received" not in out and "Traceback" not in out, out
    assert out.strip().splitlines()[-1] == f"raychat serve: stopped ({name}); Serve shut down", out


def _wait_ready(proc: subprocess.Popen, timeout_s: float = 120.0) -> None:
    """Read the child's output until its "ready" line (Ray logs a line or two before it)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            raise AssertionError(f"the child exited with {proc.wait()} before it was ready")
        if line.strip() == "ready":
            return
    raise AssertionError("the child was not ready in time")
