"""`raychat submit` / `raychat jobs`: unit tests of the pieces, then a real local Ray cluster with token auth.

The integration tier starts its own `ray start --head --block` in a temp dir, on free loopback ports, with
RAY_AUTH_MODE=token and a token of its own, in a new process group; teardown ends exactly that group.
"""

from __future__ import annotations

import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from raychat.ops import submit

REPO = Path(__file__).resolve().parents[1]


# ---------------------------------------------------------------- unit tests (fast tier)


def test_entrypoint_for_stage_and_command(tmp_path):
    (tmp_path / "jobs").mkdir()
    (tmp_path / "jobs" / "sft.py").write_text("")
    assert submit.entrypoint_for("sft", ["--depth", "4", "--tag", "a b"], tmp_path) == (
        "python jobs/sft.py --depth 4 --tag 'a b'"
    )
    assert (
        submit.entrypoint_for("command", ["python", "-c", "print(42)"], tmp_path) == "python -c 'print(42)'"
    )
    with pytest.raises(ValueError, match="jobs/rl.py does not exist"):
        submit.entrypoint_for("rl", [], tmp_path)
    with pytest.raises(ValueError, match="stage must be one of"):
        submit.entrypoint_for("train", [], tmp_path)
    with pytest.raises(ValueError, match="needs a command"):
        submit.entrypoint_for("command", [], tmp_path)


def test_runtime_env_for(tmp_path):
    env = submit.runtime_env_for(tmp_path, pip=["tiktoken>=0.14,<0.15"], env_vars={"A": "1"})
    assert env == {
        "working_dir": str(tmp_path),
        "excludes": [".venv", "runs", ".git", "__pycache__", "*.egg-info", ".pytest_cache", ".ruff_cache"],
        "py_modules": [str(tmp_path / "platform" / "raychat")],
        "pip": ["tiktoken>=0.14,<0.15"],
        "env_vars": {"A": "1"},
    }
    assert "pip" not in submit.runtime_env_for(tmp_path)  # default: the image's environment


def test_project_requirements_drop_torch_keep_the_rest(tmp_path):
    (tmp_path / "pyproject.toml").write_text(
        '[project]\nname = "x"\ndependencies = ["torch>=2.13,<2.15", "torchao>=0.18,<0.19", "ray[serve]>=2.60"]\n'
    )
    assert submit.project_requirements(tmp_path) == ["torchao>=0.18,<0.19", "ray[serve]>=2.60"]


def test_load_token_order(tmp_path, monkeypatch):
    home = tmp_path / "home"
    (home / ".ray").mkdir(parents=True)
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.delenv("RAY_AUTH_TOKEN", raising=False)
    monkeypatch.delenv("RAY_AUTH_TOKEN_PATH", raising=False)
    assert submit.load_token() is None
    (home / ".ray" / "auth_token").write_text("from-home\n")
    assert submit.load_token() == "from-home"
    (tmp_path / "p").write_text("from-path")
    monkeypatch.setenv("RAY_AUTH_TOKEN_PATH", str(tmp_path / "p"))
    assert submit.load_token() == "from-path"
    monkeypatch.setenv("RAY_AUTH_TOKEN", "from-env")
    assert submit.load_token() == "from-env"
    (tmp_path / "f").write_text(" from-flag ")
    assert submit.load_token(str(tmp_path / "f")) == "from-flag"
    (tmp_path / "empty").write_text("\n")
    with pytest.raises(ValueError, match="--token-file: token file .* is empty"):
        submit.load_token(str(tmp_path / "empty"))
    monkeypatch.delenv("RAY_AUTH_TOKEN")
    monkeypatch.setenv("RAY_AUTH_TOKEN_PATH", str(tmp_path / "missing"))
    with pytest.raises(FileNotFoundError, match="RAY_AUTH_TOKEN_PATH"):
        submit.load_token()


def test_cli_parses_options_before_stage_and_passes_the_rest():
    from raychat.cli import build_parser

    args = build_parser().parse_args(["submit", "--no-wait", "--num-gpus", "1", "pretrain", "--depth", "12"])
    assert (args.stage, args.stage_args, args.no_wait, args.num_gpus) == (
        "pretrain",
        ["--depth", "12"],
        True,
        1.0,
    )


# ---------------------------------------------------------------- a real cluster with token auth


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


PORT_FLAGS = (
    "port",
    "dashboard-port",
    "ray-client-server-port",
    "node-manager-port",
    "object-manager-port",
    "metrics-export-port",
    "dashboard-agent-listen-port",
    "dashboard-agent-grpc-port",
    "runtime-env-agent-port",
)


@pytest.fixture(scope="module")
def token_cluster():
    tmp = Path(tempfile.mkdtemp(prefix="rcsub"))
    token = secrets.token_hex(16)
    (tmp / "token").write_text(token + "\n")
    ports = {flag: _free_port() for flag in PORT_FLAGS}
    env = dict(os.environ, RAY_AUTH_MODE="token", RAY_AUTH_TOKEN=token, RAY_USAGE_STATS_ENABLED="0")
    for key in ("RAY_ADDRESS", "RAY_API_SERVER_ADDRESS"):
        env.pop(key, None)
    ray_bin = Path(sys.executable).with_name("ray")
    cmd = [
        str(ray_bin), "start", "--head", "--block", "--num-cpus=1", "--num-gpus=0",
        f"--temp-dir={tmp / 'ray'}", "--include-dashboard=true", "--dashboard-host=127.0.0.1",
        "--disable-usage-stats", *[f"--{flag}={port}" for flag, port in ports.items()],
    ]  # fmt: skip
    log = open(tmp / "ray-start.log", "w")
    proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{ports['dashboard-port']}"
    deadline = time.monotonic() + 60
    try:
        while True:
            try:
                urllib.request.urlopen(url + "/api/version", timeout=2)
                raise AssertionError("the dashboard answered without a token: token auth is not on")
            except urllib.error.HTTPError as e:
                assert e.code == 401, e
                break
            except (urllib.error.URLError, ConnectionError, OSError) as e:
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise AssertionError(
                        "ray start failed:\n" + (tmp / "ray-start.log").read_text()[-3000:]
                    ) from e
                time.sleep(0.5)
        yield {"url": url, "token_file": tmp / "token", "tmp": tmp}
    finally:
        # `ray start --block` cleans up on SIGTERM but takes ~30 s here; give it 5 s, then kill the group.
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(5)
        except subprocess.TimeoutExpired:
            pass
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait(10)
        log.close()
        shutil.rmtree(tmp, ignore_errors=True)


def _raychat(args: list[str], tmp: Path, **env_extra) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    env.update(HOME=str(tmp / "home"), **env_extra)  # no ~/.ray/auth_token: the token comes from the flag
    return subprocess.run(
        [sys.executable, "-m", "raychat.cli", *args], env=env, capture_output=True, text=True, timeout=120
    )


@pytest.mark.ray
def test_submit_follow_and_jobs_commands(token_cluster):
    c = token_cluster
    conn = ["--address", c["url"], "--token-file", str(c["token_file"])]
    # exactly the command of docs/deployment.md
    r = _raychat(["submit", *conn, "--job-id", "rc-ok", "command", "python", "-c", "print(6 * 7)"], c["tmp"])
    assert r.returncode == 0, r.stdout + r.stderr
    assert "\n42\n" in r.stdout
    assert "job rc-ok SUCCEEDED" in r.stderr

    code = (
        "import os, sys, raychat; print('cwd-has-pyproject', os.path.isfile('pyproject.toml'));"
        " print('raychat-from', raychat.__file__); sys.exit(3)"
    )
    r = _raychat(["submit", *conn, "command", "python", "-c", code], c["tmp"])
    assert r.returncode == 1, r.stdout + r.stderr  # FAILED
    assert "FAILED" in r.stderr
    assert "cwd-has-pyproject True" in r.stdout  # working_dir = this checkout
    from_line = next(line for line in r.stdout.splitlines() if line.startswith("raychat-from"))
    assert str(REPO / "platform") not in from_line  # py_modules: the uploaded copy, not the local install

    r = _raychat(["jobs", "list", *conn], c["tmp"])
    assert r.returncode == 0, r.stderr
    assert "rc-ok\tSUCCEEDED\tpython -c 'print(6 * 7)'" in r.stdout

    r = _raychat(["jobs", "logs", *conn, "rc-ok"], c["tmp"])
    assert r.returncode == 0 and "\n42\n" in r.stdout

    # The token through RAY_AUTH_TOKEN_PATH works too; no token at all is refused with exit code 4.
    r = _raychat(["jobs", "list", "--address", c["url"]], c["tmp"], RAY_AUTH_TOKEN_PATH=str(c["token_file"]))
    assert r.returncode == 0 and "rc-ok" in r.stdout, r.stderr
    r = _raychat(["jobs", "list", "--address", c["url"]], c["tmp"])
    assert r.returncode == 4, r.stdout + r.stderr
    assert "Unauthorized" in r.stderr or "authentication" in r.stderr.lower()
