"""The vLLM environment resolves against the package registry (issue 21 item 3).

The `vllm` extra is `ray[llm]` of the Ray that raychat pins (what `ray.serve.llm` needs; it pulls vllm
0.29.0). vllm 0.29.0 requires fastapi<0.137, while constraints.txt (the main environment, `make venv`) pins
fastapi 0.165, so the vLLM environment has its own lock, constraints-vllm.txt:

  pip install "torch==2.13.0" --index-url https://download.pytorch.org/whl/cu128   # a CUDA machine
  pip install -c constraints-vllm.txt -e ".[vllm]"

The slow tests ask pip to resolve that set (tests/support/pip_resolve.py: `pip install --dry-run
--ignore-installed --report`, nothing downloaded beyond metadata, nothing installed; started in the background
when collection ends) and skip, saying so, only when the registry cannot be reached.
Rewrite the lock after a tested upgrade with `.venv/bin/python tests/unit/test_vllm_env.py --write`.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest
from support import pip_resolve

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

REPO = Path(__file__).resolve().parents[2]
LOCK = REPO / "constraints-vllm.txt"
# what Ray 2.60's `llm` extra pulls (its requirement is vllm[audio]==0.29.0)
VLLM_VERSION = "0.29.0"
NETWORK_ERRORS = re.compile(
    r"NewConnectionError|Max retries exceeded|Temporary failure in name resolution|Network is unreachable|"
    r"Connection refused|ConnectTimeout|ReadTimeoutError"
)


def pins(path: Path) -> dict[str, str]:
    """{normalized name: version} of the `name==version` lines of a constraints file."""
    out = {}
    for line in path.read_text().splitlines():
        m = re.match(r"([A-Za-z0-9_.\-]+)==(\S+)", line.strip())
        if m:
            out[re.sub(r"[-_.]+", "-", m.group(1)).lower()] = m.group(2)
    return out


def vllm_requirements() -> list[str]:
    """What `pip install raychat[vllm]` asks for: the project's dependencies plus the vllm extra."""
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    return [*project["dependencies"], *project["optional-dependencies"]["vllm"]]


def resolve(constraints: Path | None) -> tuple[int, dict[str, str], str]:
    """pip's resolution of vllm_requirements() under `constraints`: (returncode, {name: version}, stderr), from
    the background resolution tests/conftest.py started for a test marked pip_resolution (or one started now).
    Skips the test when the registry cannot be reached."""
    rc, versions, err = pip_resolve.start(vllm_requirements(), constraints).result()
    if rc != 0 and NETWORK_ERRORS.search(err):
        pytest.skip(f"the package registry is not reachable: {NETWORK_ERRORS.search(err)[0]}")
    return rc, versions, err


def test_the_vllm_extra_is_the_pinned_rays_llm_extra():
    ray = pins(REPO / "constraints.txt")["ray"]
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    assert project["optional-dependencies"]["vllm"] == [f"ray[llm]=={ray}"]
    lock = pins(LOCK)
    assert (lock["ray"], lock["vllm"]) == (ray, VLLM_VERSION)  # the same Ray as the main environment
    assert "torch" not in lock  # the CUDA build is installed first, as in the Makefile


@pytest.mark.slow
@pytest.mark.pip_resolution(vllm_requirements(), LOCK)
def test_the_vllm_environment_resolves_to_its_lock():
    rc, versions, err = resolve(LOCK)
    assert rc == 0, err[-3000:]
    assert versions["vllm"] == VLLM_VERSION and versions["ray"] == pins(LOCK)["ray"]
    # every pin of the lock is what pip picks for raychat[vllm] (the lock is the resolved set, not a wish)
    lock = pins(LOCK)
    assert {k: versions.get(k) for k in lock} == lock


@pytest.mark.slow
@pytest.mark.pip_resolution(vllm_requirements(), REPO / "constraints.txt")
def test_the_main_constraints_cannot_hold_vllm():
    """Why the lock is separate: constraints.txt's fastapi is newer than vllm 0.29.0 accepts."""
    rc, _, err = resolve(REPO / "constraints.txt")
    assert rc != 0
    assert "ResolutionImpossible" in err and "fastapi" in err


def write_lock() -> None:
    """Resolve raychat[vllm] with no constraints and write every pin but torch's (and any local-version
    build) to constraints-vllm.txt."""
    rc, versions, err = resolve(None)
    if rc:
        sys.exit(err)
    lines = [f"{k}=={v}" for k, v in sorted(versions.items()) if k != "torch" and "+" not in v]
    header = "# The vLLM environment's lock (raychat[vllm] = ray[llm]): tests/unit/test_vllm_env.py --write\n"
    LOCK.write_text(header + "\n".join(lines) + "\n")
    print(f"wrote {LOCK}: {len(lines)} pins")


if __name__ == "__main__":
    if sys.argv[1:] != ["--write"]:
        sys.exit("usage: python tests/unit/test_vllm_env.py --write")
    write_lock()
