"""A writer in a process of its own that stops inside a write, where its code calls `stop()`: killed there
(SIGKILL, what a crash or an OOM kill leaves behind), or held there while the test acts and then let go (another
process writing the same target at that moment)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

PRELUDE = """
import os, signal, sys, time
FLAGS, KILL = sys.argv[1], sys.argv[2] == "kill"
def stop():
    if KILL:
        os.kill(os.getpid(), signal.SIGKILL)
    open(os.path.join(FLAGS, "stopped"), "w").close()
    while not os.path.exists(os.path.join(FLAGS, "go")):
        time.sleep(0.05)
"""


def _start(code: str, flags: Path, mode: str) -> subprocess.Popen:
    flags.mkdir(parents=True, exist_ok=True)
    return subprocess.Popen(
        [sys.executable, "-c", PRELUDE + textwrap.dedent(code), str(flags), mode],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def run_killed(code: str, flags: Path, timeout_s: float = 120) -> None:
    """Run `code` until it calls stop(), where the process kills itself; raises AssertionError if it exits any
    other way."""
    proc = _start(code, flags, "kill")
    out, _ = proc.communicate(timeout=timeout_s)
    assert proc.returncode == -9, out


class Held:
    """A writer stopped at its stop() call until go()."""

    def __init__(self, code: str, flags: Path, timeout_s: float = 120):
        self.flags, self.proc = flags, _start(code, flags, "hold")
        deadline = time.monotonic() + timeout_s
        while not (flags / "stopped").exists():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.proc.kill()
                raise AssertionError(f"the writer never reached stop(): {self.proc.communicate()[0]}")
            time.sleep(0.05)

    def go(self, timeout_s: float = 120) -> tuple[int, str]:
        """Let the writer go on; returns its exit status and output once it ends."""
        (self.flags / "go").touch()
        out, _ = self.proc.communicate(timeout=timeout_s)
        return self.proc.returncode, out


def age(path: Path, seconds: float) -> None:
    """Set the modification time of `path` and of everything below it `seconds` into the past (a leftover of
    a process killed that long ago)."""
    when = time.time() - seconds
    for p in [path, *path.rglob("*")]:
        os.utime(p, (when, when), follow_symlinks=False)
