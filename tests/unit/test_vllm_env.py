"""The vLLM environment resolves against the package registry (issue 21 item 3).

The `vllm` extra is `ray[llm]` of the Ray that raychat pins (what `ray.serve.llm` needs; it pulls vllm
0.29.0). vllm 0.29.0 requires fastapi<0.137, while constraints.txt (the main environment, `make venv`) pins
fastapi 0.165, so the vLLM environment has its own lock, constraints-vllm.txt:

  pip install "torch==2.13.0" --index-url https://download.pytorch.org/whl/cu128   # a CUDA machine
  pip install -c constraints-vllm.txt -e ".[vllm]"

The slow tests ask pip to resolve that set (`pip install --dry-run --ignore-installed --report`: nothing is
downloaded beyond metadata, nothing installed) and skip, saying so, only when the registry cannot be reached.
Rewrite the lock after a tested upgrade with `.venv/bin/python tests/unit/test_vllm_env.py --write`.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

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
    """pip's resolution of vllm_requirements() under `constraints`: (returncode, {name: version}, stderr).
    Skips the test when the registry cannot be reached."""
    with tempfile.TemporaryDirectory() as d:
        reqs, report = Path(d) / "requirements.txt", Path(d) / "report.json"
        reqs.write_text("\n".join(vllm_requirements()) + "\n")
        cmd = [sys.executable, "-m", "pip", "install", "--dry-run", "--ignore-installed", "--quiet"]
        cmd += ["--report", str(report), "-r", str(reqs)] + (["-c", str(constraints)] if constraints else [])
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
        if r.returncode != 0 and NETWORK_ERRORS.search(r.stderr):
            pytest.skip(f"the package registry is not reachable: {NETWORK_ERRORS.search(r.stderr)[0]}")
        if r.returncode != 0:
            return r.returncode, {}, r.stderr
        installs = json.loads(report.read_text())["install"]
    versions = {
        re.sub(r"[-_.]+", "-", i["metadata"]["name"]).lower(): i["metadata"]["version"] for i in installs
    }
    return 0, versions, r.stderr


def test_the_vllm_extra_is_the_pinned_rays_llm_extra():
    ray = pins(REPO / "constraints.txt")["ray"]
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    assert project["optional-dependencies"]["vllm"] == [f"ray[llm]=={ray}"]
    lock = pins(LOCK)
    assert (lock["ray"], lock["vllm"]) == (ray, VLLM_VERSION)  # the same Ray as the main environment
    assert "torch" not in lock  # the CUDA build is installed first, as in the Makefile


@pytest.mark.slow
def test_the_vllm_environment_resolves_to_its_lock():
    rc, versions, err = resolve(LOCK)
    assert rc == 0, err[-3000:]
    assert versions["vllm"] == VLLM_VERSION and versions["ray"] == pins(LOCK)["ray"]
    # every pin of the lock is what pip picks for raychat[vllm] (the lock is the resolved set, not a wish)
    lock = pins(LOCK)
    assert {k: versions.get(k) for k in lock} == lock


@pytest.mark.slow
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
