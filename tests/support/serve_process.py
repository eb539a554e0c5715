"""A real `raychat serve` in a process of its own (its own local Ray cluster, a free port, a private Ray temp
dir), for tests and benchmarks that talk to it over HTTP like any client. Stopped with Ctrl-C (SIGINT) like a
user would, then killed with its whole process group if it does not exit."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import requests

from raychat.ports import free_ports
from support.cluster import RAY_STARTUP_WAIT, _kill_leftovers, remove_sessions, start_with_retry


class ServeProcess:
    """`python -m raychat.cli serve --checkpoint DIR --port P ARGS...`; `url` once /health answers 200. A start
    whose local Ray node hit Ray's startup timeout is cleaned up and started again (start_with_retry).

    Args:
        checkpoint: raychat checkpoint directory.
        args: more `raychat serve` flags.
        log: file that receives the server's stdout and stderr.
        start_timeout_s: seconds to wait for /health.
    Raises:
        RuntimeError: the server exited or did not become healthy in time (the log's tail is in the message).
    """

    def __init__(self, checkpoint, args=(), log: Path | None = None, start_timeout_s: float = 240.0):
        (self.port,) = free_ports(1)
        self.url = f"http://127.0.0.1:{self.port}"
        self.ray_tmp = tempfile.mkdtemp(prefix="rcserve-", dir="/tmp")  # short: Ray's socket paths
        self.log_path = Path(log or Path(self.ray_tmp) / "serve.log")
        self._log = open(self.log_path, "w")  # noqa: SIM115 - closed in stop()
        command = [sys.executable, "-m", "raychat.cli", "serve", "--checkpoint", str(checkpoint),
                   "--port", str(self.port), *args]  # fmt: skip
        try:
            start_with_retry(
                lambda: self._start(command, start_timeout_s), self._clean_failed, "raychat serve"
            )
        except BaseException:
            self.stop()
            raise

    def _start(self, command: list[str], timeout_s: float) -> None:
        env = {**os.environ, **RAY_STARTUP_WAIT, "RAY_TMPDIR": self.ray_tmp, "RAY_AUTH_MODE": "disabled",
               "PYTHONUNBUFFERED": "1"}  # fmt: skip
        env.pop("RAY_ADDRESS", None)
        self._log.flush()
        self._log_start = self.log_path.stat().st_size  # an earlier attempt's output stays above it
        self.proc = subprocess.Popen(
            command, stdout=self._log, stderr=subprocess.STDOUT, env=env, start_new_session=True,
            preexec_fn=sigint_as_default,
        )  # fmt: skip
        self._wait_healthy(timeout_s)

    def _end(self, timeout_s: float = 30.0) -> None:
        """Ctrl-C (SIGINT) the server, SIGKILL its process group after timeout_s, then any process still naming
        its Ray temp dir."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                pass
        try:  # whatever the session left (raylet, workers of this cluster): they share its process group
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait(10)
        _kill_leftovers(self.ray_tmp)

    def _clean_failed(self) -> None:
        self._end()
        remove_sessions(Path(self.ray_tmp))

    def _wait_healthy(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"raychat serve exited with {self.proc.returncode}:\n{self.log_tail()}")
            try:
                if requests.get(f"{self.url}/health", timeout=2).status_code == 200:
                    return
            except requests.RequestException:
                pass
            time.sleep(0.5)
        raise RuntimeError(f"raychat serve not healthy after {timeout_s} s:\n{self.log_tail()}")

    def log_tail(self, lines: int = 40) -> str:
        self._log.flush()
        output = self.log_path.read_bytes()[self._log_start :].decode(errors="replace")
        return "\n".join(output.splitlines()[-lines:])

    def stop(self, timeout_s: float = 30.0) -> None:
        self._end(timeout_s)
        self._log.close()
        shutil.rmtree(self.ray_tmp, ignore_errors=True)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.stop()


def sigint_as_default() -> None:
    """preexec_fn of a child a test stops with SIGINT (Ctrl-C): SIGINT's default action, not the SIG_IGN that a
    non-interactive shell gives a background job (`cmd &`) and every process under it inherits, with which
    Python installs no KeyboardInterrupt handler and the child never sees the Ctrl-C."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)
