"""Which Python runs a Ray job's entrypoint, and one clear line when that Python cannot run raychat.

Ray runs a job's entrypoint (`python jobs/<stage>.py ARGS`) through a shell on the node of the job's driver
(the head, unless --num-cpus/--num-gpus reserve one elsewhere), so `python` is whatever that node's PATH
finds first, not necessarily the Python that runs Ray there. A head started as `.venv/bin/ray start` from a
shell without the venv on PATH runs the job with the machine's global Python, and the job dies on its first
third-party import. `raychat submit --python PATH` names the interpreter instead; this module turns the
import failure into a message that says so and names the Python the cluster's Ray workers run.

Standard library only: it must import in exactly the Python that lacks raychat's dependencies.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

RAYLET_LIB = "/ray/_raylet.so"
JOB_ENV_VAR = "RAY_JOB_CONFIG_JSON_ENV_VAR"  # set by Ray's job supervisor in every job entrypoint


def _parent(pid: int) -> int:
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return 0
    return int(fields[1])  # the field after the state: ppid (proc(5))


def _python_of_raylet_lib(pid: int) -> str | None:
    """<prefix>/bin/python(3) of the environment whose ray/_raylet.so process `pid` has loaded."""
    try:
        maps = Path(f"/proc/{pid}/maps").read_text()
    except OSError:
        return None
    for line in maps.splitlines():
        path = line.split(maxsplit=5)[-1]
        if path.endswith(RAYLET_LIB):
            prefix = Path(path).parents[4]  # <prefix>/lib/pythonX.Y/site-packages/ray/_raylet.so
            for name in ("python3", "python"):
                if (prefix / "bin" / name).exists():
                    return str(prefix / "bin" / name)
    return None


def ray_worker_python(pid: int | None = None, max_depth: int = 4) -> str | None:
    """The Python of the nearest ancestor of `pid` (default: this process) that runs Ray, i.e. in a job the
    supervisor actor that started the entrypoint: the Python the cluster runs Ray with. Ray workers rewrite
    their command line (setproctitle), so the environment is found from the ray/_raylet.so they loaded.
    Reads /proc (Linux); None elsewhere, outside a job, or when no ancestor within max_depth runs Ray."""
    pid = os.getpid() if pid is None else pid
    for _ in range(max_depth):
        pid = _parent(pid)
        if pid <= 1:
            return None
        python = _python_of_raylet_lib(pid)
        if python:
            return python
    return None


def missing_dependency_message(module: str) -> str:
    """One line for `ModuleNotFoundError: No module named <module>` raised while raychat loads its commands."""
    here = f"{sys.executable} (Python {sys.version.split()[0]})"
    text = f"this Python, {here}, cannot import {module!r}, a dependency of raychat"
    if JOB_ENV_VAR not in os.environ:
        return f"{text}: install raychat into it (pip install raychat) or run raychat from its venv"
    ray_python = ray_worker_python()
    fix = (
        f"raychat submit --python {ray_python} ..." if ray_python else "raychat submit --python <python> ..."
    )
    where = f" (Ray itself runs {ray_python} there)" if ray_python else ""
    return (
        f"{text}. This Ray job's `python` is not the Python the cluster runs Ray with{where}: resubmit with "
        f"`{fix}`, or start the cluster's nodes with that Python's bin first on PATH (docs/deployment.md)"
    )
