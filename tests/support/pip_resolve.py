"""pip's resolution of a requirement set, run in the background: `pip install --dry-run --ignore-installed
--report` (nothing downloaded beyond metadata, nothing installed).

A resolution of raychat[vllm] takes about a minute, mostly waiting on the registry (~0.5 CPU-s per wall
second on 2 cores), so tests/conftest.py starts the ones the selected tests will ask for as soon as collection
ends (`start`), at the lowest CPU priority (nice 19), and the tests wait for them (`Resolution.result`) after
the other tests ran beside them.

Under pytest-xdist every worker collects every test, so each would start the same resolutions: given a
directory the workers share (`shared_root`), the first worker to create a resolution's directory runs pip, and
the subprocess itself writes its exit status there when it ends, so another worker reads the same result.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from raychat.atomic import atomic_write_text

TIMEOUT_S = 900
_started: dict[tuple[tuple[str, ...], str], Resolution] = {}


def normalize(name: str) -> str:
    """A distribution name as PEP 503 compares them: lower case, runs of -_. as one -."""
    return re.sub(r"[-_.]+", "-", name).lower()


class Resolution:
    """One `pip install --dry-run` of `requirements` under `constraints` (None: unconstrained). With
    `shared_root`, the resolution of that set in the directory <shared_root>/pip-resolve-<key>: started here if
    this process created the directory, else read from there when the process that did has run it."""

    def __init__(self, requirements: list[str], constraints: Path | None, shared_root: Path | None = None):
        if shared_root is None:
            self._dir, self._owner = Path(tempfile.mkdtemp(prefix="pip-resolve-")), True
        else:
            key = hashlib.sha256(json.dumps([requirements, str(constraints)]).encode()).hexdigest()[:16]
            self._dir = shared_root / f"pip-resolve-{key}"
            try:
                self._dir.mkdir(parents=True)
                self._owner = True
            except FileExistsError:
                self._owner = False
        self._shared = shared_root is not None
        self._report, self._rc, self._stderr = (self._dir / n for n in ("report.json", "rc", "stderr.txt"))
        self._proc: subprocess.Popen | None = None
        self._result: tuple[int, dict[str, str], str] | None = None
        if self._owner:
            reqs = self._dir / "requirements.txt"
            reqs.write_text("\n".join(requirements) + "\n")
            cmd = [sys.executable, "-m", "pip", "install", "--dry-run", "--ignore-installed", "--quiet"]
            cmd += ["--report", str(self._report), "-r", str(reqs)]
            cmd += ["-c", str(constraints)] if constraints else []
            # at the lowest CPU priority: the tests running beside it keep the cores, pip gets what they leave;
            # the exit status is written (atomically: a rename) by the subprocess, for whichever process reads it
            script = f'{shlex.join(cmd)} 2>{shlex.quote(str(self._stderr))}; echo $? > "$0.tmp" && mv "$0.tmp" "$0"'
            self._proc = subprocess.Popen(
                ["nice", "-n", "19", "sh", "-c", script, str(self._rc)],
                stdout=subprocess.DEVNULL,
                start_new_session=True,  # sh and its pip: one process group, stopped together
            )
            atomic_write_text(self._dir / "pid", str(self._proc.pid))

    def result(self) -> tuple[int, dict[str, str], str]:
        """(returncode, {normalized name: version} pip would install (empty on failure), pip's stderr); waits
        up to TIMEOUT_S for it. Raises subprocess.TimeoutExpired past it, RuntimeError when another process's
        resolution was stopped before it ended."""
        if self._result is None:
            deadline = time.monotonic() + TIMEOUT_S
            while not self._rc.exists():
                pid = self._dir / "pid"
                if self._proc is None and pid.exists() and not _alive(int(pid.read_text())):
                    if self._rc.exists():
                        break
                    raise RuntimeError(f"the pip resolution in {self._dir} was stopped before it ended")
                if time.monotonic() > deadline:
                    self.stop(wait=False)
                    raise subprocess.TimeoutExpired(f"pip resolution in {self._dir}", TIMEOUT_S)
                time.sleep(0.5)
            rc = int(self._rc.read_text())
            versions = {}
            if rc == 0:
                installs = json.loads(self._report.read_text())["install"]
                versions = {normalize(i["metadata"]["name"]): i["metadata"]["version"] for i in installs}
            self._result = (rc, versions, self._stderr.read_text())
            self.stop()
        return self._result

    def stop(self, wait: bool = True) -> None:
        """End the subprocess if it still runs and remove the files. A shared resolution started here is one
        another worker may still wait for: with `wait`, it is waited for (up to TIMEOUT_S) instead of ended, and
        its files stay (the workers' shared directory is pytest's temp dir, which pytest prunes)."""
        if self._proc is not None and self._proc.poll() is None:
            if self._shared and wait:
                try:
                    self._proc.wait(TIMEOUT_S)
                except subprocess.TimeoutExpired:
                    pass
            if self._proc.poll() is None:
                os.killpg(self._proc.pid, signal.SIGKILL)
                self._proc.wait()
        if not self._shared:
            shutil.rmtree(self._dir, ignore_errors=True)


def _alive(pid: int) -> bool:
    """Whether process `pid` exists (a zombie counts: its parent has not reaped it yet)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # it exists, another user's
        pass
    return True


def start(requirements: list[str], constraints: Path | None, shared_root: Path | None = None) -> Resolution:
    """The resolution of (requirements, constraints): the one already started this session, else a new one
    (in `shared_root` when given, see Resolution)."""
    key = (tuple(requirements), str(constraints))
    if key not in _started:
        _started[key] = Resolution(requirements, constraints, shared_root)
    return _started[key]


def stop_all(wait: bool = True) -> None:
    """End every resolution of this session (those no test waited for); `wait`: see Resolution.stop."""
    for resolution in _started.values():
        resolution.stop(wait)
    _started.clear()
