"""How `raychat serve` ends: Ctrl-C (SIGINT) and SIGTERM (`kill`, `docker stop`, Kubernetes) both shut Serve down
and print one line, with no traceback (raychat.serve.cli._block), and so does SIGTERM while it is still starting
(raychat.serve.cli.main). The wait loop runs in a child process over a real local Ray with Serve started (no
app: the shutdown path is the same), so the signal meets Ray's own handlers as it does in `raychat serve`; the
start-up case is a real `raychat serve` signalled while its local Ray is being started (ray.init), which
ends it long before any Serve start-up. A second `raychat serve` on the port that Serve listens on is refused
in one line before its Ray starts (raychat.serve.cli.check_port_free): Serve's proxies share a port
(SO_REUSEPORT).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from support.cluster import RAY_STARTUP_WAIT, _kill_leftovers
from support.serve_helpers import write_tiny_checkpoint
from support.signalled import signalled, wait_ray_starting

from raychat.ports import free_ports

# "ready" is printed by _block's first sleep, after _block installed its handler: printed before _block, a
# SIGTERM could come first and meet the core worker's native handler (abort, exit -6)
SCRIPT = """
import sys, time, types, ray
from ray import serve
from raychat.serve import cli
ray.init(num_cpus=1, include_dashboard=False, log_to_driver=False)
serve.start(http_options={"host": "127.0.0.1", "port": int(sys.argv[1])})
def sleep_when_ready(seconds):
    print("ready", flush=True)
    time.sleep(seconds)
cli.time = types.SimpleNamespace(sleep=sleep_when_ready)  # cli's own name only: Ray's threads sleep too
sys.exit(cli._block())
"""


def test_serve_ends_on_sigterm_as_on_ctrl_c_with_one_line(tmp_path):
    """SIGTERM ends the wait loop as Ctrl-C does (Ray's own SIGTERM handler printed a native stack trace and
    left Serve up); both go the same way from there (_block). SIGTERM during start-up, inside ray.init (its
    Ray session directory exists, so Ray's handler is in place), ends the command the same way in one line,
    exit 0, with every process of its Ray gone (it hung: Ray's handler raised SystemExit within ray.init)."""
    checkpoint = write_tiny_checkpoint(tmp_path / "ckpt")
    command = [sys.executable, "-m", "raychat.cli", "serve", "--checkpoint", str(checkpoint)]
    out, code, left = signalled(command + ["--port", str(free_ports(1)[0])], wait_ray_starting)
    assert code == 0, out
    assert "Traceback" not in out and "SIGTERM received" not in out, out
    assert (
        out.strip().splitlines()[-1] == "raychat serve: stopped (SIGTERM) while starting; Serve shut down"
    ), out
    assert left == [], out

    port, second = free_ports(1)[0], []

    def ready_then_serve_on_its_port(proc: subprocess.Popen, ray_tmp: str) -> None:
        _wait_ready(proc, ray_tmp)
        second.append(_run_on_own_ray([*command, "--port", str(port)]))

    out, code, left = signalled([sys.executable, "-c", SCRIPT, str(port)], ready_then_serve_on_its_port)
    assert code == 0, out
    assert "received" not in out and "Traceback" not in out, out
    assert out.strip().splitlines()[-1] == "raychat serve: stopped (SIGTERM); Serve shut down", out
    # a second `raychat serve` on the port whose Serve proxy (SO_REUSEPORT) listens: it started beside it;
    # refused now before its Ray starts (no session directory in its Ray temp dir)
    ((out2, code2, ray_started),) = second
    assert code2 == 2 and not ray_started, out2
    assert out2.strip().splitlines()[-1] == (
        f"raychat serve: error: --port {port}: 127.0.0.1:{port} is in use (another raychat serve, or another "
        "program, listens there); pick another --port  (RAYCHAT_DEBUG=1 shows the traceback)"
    ), out2


def _run_on_own_ray(command: list[str]) -> tuple[str, int, bool]:
    """Run `command` to its end over a Ray temp dir of its own; its output, exit status and whether it started
    a Ray there (a session directory)."""
    ray_tmp = tempfile.mkdtemp(prefix="rcsig-", dir="/tmp")
    env = {**os.environ, **RAY_STARTUP_WAIT, "RAY_TMPDIR": ray_tmp, "RAY_AUTH_MODE": "disabled"}
    env.pop("RAY_ADDRESS", None)
    try:
        done = subprocess.run(command, capture_output=True, text=True, env=env, timeout=180)
        started = bool(list(Path(ray_tmp).glob("ray/session_*")))
    finally:
        _kill_leftovers(ray_tmp)
        shutil.rmtree(ray_tmp, ignore_errors=True)
    return done.stdout + done.stderr, done.returncode, started


def _wait_ready(proc: subprocess.Popen, _ray_tmp: str, timeout_s: float = 120.0) -> None:
    """Read the child's output until its "ready" line (Ray logs a line or two before it)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            raise AssertionError(f"the child exited with {proc.wait()} before it was ready")
        if line.strip() == "ready":
            return
    raise AssertionError("the child was not ready in time")
