"""pip's resolution of a requirement set, run in the background: `pip install --dry-run --ignore-installed
--report` (nothing downloaded beyond metadata, nothing installed).

A resolution of raychat[vllm] takes about a minute, mostly waiting on the registry (~0.5 CPU-s per wall
second on 2 cores), so tests/conftest.py starts the ones the selected tests will ask for as soon as collection
ends (`start`), at the lowest CPU priority (nice 19), and the tests wait for them (`Resolution.result`) after
the other tests ran beside them.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

TIMEOUT_S = 900
_started: dict[tuple[tuple[str, ...], str], Resolution] = {}


def normalize(name: str) -> str:
    """A distribution name as PEP 503 compares them: lower case, runs of -_. as one -."""
    return re.sub(r"[-_.]+", "-", name).lower()


class Resolution:
    """One `pip install --dry-run` subprocess of `requirements` under `constraints` (None: unconstrained)."""

    def __init__(self, requirements: list[str], constraints: Path | None):
        self._dir = Path(tempfile.mkdtemp(prefix="pip-resolve-"))
        reqs, self._report = self._dir / "requirements.txt", self._dir / "report.json"
        reqs.write_text("\n".join(requirements) + "\n")
        cmd = [sys.executable, "-m", "pip", "install", "--dry-run", "--ignore-installed", "--quiet"]
        cmd += ["--report", str(self._report), "-r", str(reqs)]
        cmd += ["-c", str(constraints)] if constraints else []
        self._stderr = (self._dir / "stderr.txt").open("w+")
        # at the lowest CPU priority: the tests running beside it keep the cores, pip gets what they leave
        self._proc = subprocess.Popen(
            ["nice", "-n", "19", *cmd], stdout=subprocess.DEVNULL, stderr=self._stderr, text=True
        )
        self._result: tuple[int, dict[str, str], str] | None = None

    def result(self) -> tuple[int, dict[str, str], str]:
        """(returncode, {normalized name: version} pip would install (empty on failure), pip's stderr); waits
        up to TIMEOUT_S for the subprocess. Raises subprocess.TimeoutExpired past it."""
        if self._result is None:
            try:
                rc = self._proc.wait(TIMEOUT_S)
            except subprocess.TimeoutExpired:
                self.stop()
                raise
            self._stderr.seek(0)
            err = self._stderr.read()
            versions = {}
            if rc == 0:
                installs = json.loads(self._report.read_text())["install"]
                versions = {normalize(i["metadata"]["name"]): i["metadata"]["version"] for i in installs}
            self._result = (rc, versions, err)
            self.stop()
        return self._result

    def stop(self) -> None:
        """End the subprocess if it still runs and remove its files."""
        if self._proc.poll() is None:
            self._proc.kill()
            self._proc.wait()
        self._stderr.close()
        shutil.rmtree(self._dir, ignore_errors=True)


def start(requirements: list[str], constraints: Path | None) -> Resolution:
    """The resolution of (requirements, constraints): the one already started this session, else a new one."""
    key = (tuple(requirements), str(constraints))
    if key not in _started:
        _started[key] = Resolution(requirements, constraints)
    return _started[key]


def stop_all() -> None:
    """End every resolution of this session (those no test waited for)."""
    for resolution in _started.values():
        resolution.stop()
    _started.clear()
