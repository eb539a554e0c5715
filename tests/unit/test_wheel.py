"""The package stands alone: a wheel built from the sources, installed into a fresh venv outside the checkout,
runs `raychat` from a directory that is not the checkout.

Fast on purpose: the wheel is built without build isolation (this venv's setuptools) from a copy of the
sources, and installed with --no-deps into a venv that reaches this venv's dependencies through a .pth line.
That line adds the directory to sys.path without processing the .pth files in it, so this venv's editable
raychat (a .pth finder that points at the checkout) stays out: `import raychat` must find the wheel's copy.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SOURCES = ("pyproject.toml", "README.md", "platform")

pytestmark = pytest.mark.slow


def _run(cmd: list[str], cwd: Path, timeout: int = 300) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env["PATH"] = os.pathsep.join([str(Path(cmd[0]).parent), env.get("PATH", "")])
    return subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> dict:
    tmp = tmp_path_factory.mktemp("wheel")
    src = tmp / "src"
    src.mkdir()
    for name in SOURCES:
        if (REPO / name).is_dir():
            shutil.copytree(
                REPO / name, src / name, ignore=shutil.ignore_patterns("__pycache__", "*.egg-info")
            )
        else:
            shutil.copy2(REPO / name, src / name)
    r = _run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-w", str(tmp), "."], src
    )
    assert r.returncode == 0, r.stdout + r.stderr
    (wheel,) = tmp.glob("raychat-*.whl")

    venv = tmp / "venv"
    subprocess.run([sys._base_executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    python = venv / "bin" / "python"
    site = Path(
        _run(
            [str(python), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"], tmp
        ).stdout.strip()
    )
    (site / "deps-from-dev-venv.pth").write_text(sysconfig.get_path("purelib") + "\n")
    r = _run(
        [sys.executable, "-m", "pip", "--python", str(python), "install", "--no-deps", "-q", str(wheel)], tmp
    )
    assert r.returncode == 0, r.stdout + r.stderr
    work = tmp / "elsewhere"  # neither the checkout nor the venv: nothing to find next to the cwd
    work.mkdir()
    return {"wheel": wheel, "venv": venv, "python": python, "raychat": venv / "bin" / "raychat", "site": site,
            "work": work}  # fmt: skip


def test_wheel_holds_the_package_and_its_data(installed):
    names = set(zipfile.ZipFile(installed["wheel"]).namelist())
    assert {"raychat/cli.py", "raychat/storage.py", "raychat/ops/grafana/raychat.json",
            "raychat/serve/static/chat.html"} <= names  # fmt: skip
    assert not any(n.startswith(("platform/", "tests/", "jobs/")) for n in names)


def test_raychat_runs_from_the_wheel_outside_the_checkout(installed):
    r = _run([str(installed["python"]), "-c", "import raychat; print(raychat.__file__)"], installed["work"])
    assert r.returncode == 0, r.stderr
    assert Path(r.stdout.strip()) == installed["site"] / "raychat" / "__init__.py"

    r = _run([str(installed["raychat"]), "--help"], installed["work"])
    assert r.returncode == 0, r.stderr
    for command in ("pretrain", "sft", "rl", "serve", "submit", "jobs", "k8s"):
        assert f"    {command} " in r.stdout, command


@pytest.fixture(scope="module")
def vocab(installed) -> int:
    """Train a small tokenizer with the wheel's raychat into <work>/tok; its vocabulary size."""
    code = (
        "from raychat.tokenizer import Tokenizer\n"
        "t = Tokenizer.train(['the quick brown fox jumps over the lazy dog. ' * 40] * 20, vocab_size=300)\n"
        "t.save('tok'); print(t.vocab_size)"
    )
    r = _run([str(installed["python"]), "-c", code], installed["work"])
    assert r.returncode == 0, r.stderr
    return int(r.stdout.strip())


def test_pretrain_dry_run_from_the_wheel(installed, vocab):
    work = installed["work"]
    r = _run([str(installed["raychat"]), "pretrain", "--preset", "none", "--tokenizer-path", "tok", "--dry-run"],
             work)  # fmt: skip
    assert r.returncode == 0, r.stdout + r.stderr
    # depth 4 -> width 256, 4 heads of 64, MLP 704. Per layer: q, k, v, o 4 * 256 * 256 = 262,144, SwiGLU
    # 3 * 256 * 704 = 540,672, two RMSNorms 2 * 256 and the QK-norms 2 * 64: 803,456; four layers 3,213,824,
    # the final norm 256, untied embedding and head 2 * vocab * 256.
    params = 4 * 803_456 + 256 + 2 * vocab * 256
    assert f"parameters: {params:,} ({params - vocab * 256:,} without the embedding)" in r.stdout


def test_preset_from_the_wheel(installed, vocab):
    names = zipfile.ZipFile(installed["wheel"]).namelist()
    assert any(n.startswith("raychat/") and n.endswith("/cpu.yaml") for n in names), (
        "no cpu preset in the wheel"
    )
    r = _run([str(installed["raychat"]), "pretrain", "--preset", "cpu", "--tokenizer-path", "tok", "--dry-run"],
             installed["work"])  # fmt: skip
    assert r.returncode == 0, r.stdout + r.stderr
    assert f"vocab {vocab}" in r.stdout and "parameters: " in r.stdout
