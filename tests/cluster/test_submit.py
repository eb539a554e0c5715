"""`raychat submit` / `raychat jobs`: unit tests of the pieces, then a real local Ray cluster with token auth.

The integration tier starts its own head node (tests/support/cluster.py: `ray start --head --block`, free loopback
ports, token auth with a token of its own, a process group of its own, everything stopped afterwards) from a
PATH whose `python` is a bare Python without raychat's dependencies.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import textwrap
import time
import urllib.request
from pathlib import Path
from zipfile import ZipFile

import pytest
from ray._private.ray_constants import RAY_RUNTIME_ENV_DEFAULT_EXCLUDES, get_runtime_env_default_excludes
from ray._private.runtime_env.packaging import _zip_files
from ray._private.runtime_env.working_dir import upload_working_dir_if_needed
from support.cluster import LocalCluster, short_temp_dir
from support.serve_helpers import write_tiny_checkpoint

from raychat import ray_token
from raychat.cli import main as raychat_main
from raychat.data.corpus.shards import write_manifest, write_shards
from raychat.ops import submit

REPO = Path(__file__).resolve().parents[2]


# ---------------------------------------------------------------- unit tests (fast tier)


def test_entrypoint_for_stage_and_command(tmp_path):
    (tmp_path / "jobs").mkdir()
    (tmp_path / "jobs" / "sft.py").write_text("")
    assert submit.entrypoint_for("sft", ["--depth", "4", "--tag", "a b"], tmp_path) == (
        "python jobs/sft.py --depth 4 --tag 'a b'"
    )
    assert submit.entrypoint_for("sft", [], tmp_path, python="/opt/ray py/bin/python") == (
        "'/opt/ray py/bin/python' jobs/sft.py"
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
        "excludes": [
            ".venv",
            "venv",
            "runs",
            ".git",
            "__pycache__",
            "*.egg-info",
            ".pytest_cache",
            ".ruff_cache",
            ".mypy_cache",
            "node_modules",
            "bench/results",
            "/token",
        ],
        "py_modules": [str(tmp_path / "platform" / "raychat")],
        "pip": ["tiktoken>=0.14,<0.15"],
        "env_vars": {"A": "1"},
    }
    assert "pip" not in submit.runtime_env_for(tmp_path)  # default: the image's environment


def test_the_clusters_token_file_is_neither_uploaded_nor_committed(tmp_path):
    """docs/deployment.md section 1 writes the cluster's token to `token` in the checkout; Ray zipped it into
    every job's working_dir package (kept in the GCS) and `git add -A` took it. Zipped here by Ray's own
    packaging with the job's excludes and without .gitignore (a checkout of an older .gitignore)."""
    checkout = tmp_path / "checkout"
    for rel in ("token", "docs/token", "platform/raychat/x.py", ".venv/bin/python"):
        (checkout / rel).parent.mkdir(parents=True, exist_ok=True)
        (checkout / rel).write_text("x")
    excludes = submit.runtime_env_for(checkout)["excludes"]
    _zip_files(str(checkout), excludes, str(tmp_path / "pkg.zip"), include_gitignore=False)
    assert sorted(ZipFile(tmp_path / "pkg.zip").namelist()) == ["docs/token", "platform/raychat/x.py"]
    ignored = subprocess.run(
        ["git", "check-ignore", "token", "docs/token"], cwd=REPO, capture_output=True, text=True
    )
    assert ignored.stdout == "token\n"


def test_submits_packaging_uploads_the_same_files_without_rays_default_exclude_warnings(tmp_path, caplog):
    """Every `raychat submit` printed Ray's "Directory '.git' is now ignored by default ..." (and '.venv'), which
    Ray logs for each of its default excludes the checkout holds whatever the runtime_env's own excludes say, and
    its INFO line "Ignoring upload to cluster for these files: [.../.gitignore]" for the checkout's .gitignore
    and those of .pytest_cache and .ruff_cache. Within
    packaging_quiet Ray adds no default exclude (WORKING_DIR_EXCLUDES lists them) and the INFO line is left out:
    the working dir packaged by Ray's own code has the same URI (a hash of every file's path and content) and the
    same files as with Ray's defaults on."""
    checkout = tmp_path / "checkout"
    kept = ["jobs/pretrain.py", "platform/raychat/x.py", "docs/a.md", ".gitignore"]
    left_out = [".git/HEAD", ".venv/bin/python", "venv/bin/python", "__pycache__/a.pyc",
                "platform/raychat/__pycache__/x.pyc", "build/lib/x.py", "token"]  # fmt: skip
    for rel in kept + left_out:
        (checkout / rel).parent.mkdir(parents=True, exist_ok=True)
        (checkout / rel).write_text(rel)
    (checkout / ".gitignore").write_text((REPO / ".gitignore").read_text())  # build/ is ignored there only

    excludes_seen = []

    def packaged(name: str) -> tuple[str, list[str], list[str]]:
        """(the working_dir's URI, the zip's files, Ray's log lines) as submit_job packages it."""
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="ray"):
            env = upload_working_dir_if_needed(
                submit.runtime_env_for(checkout),
                include_gitignore=True,
                upload_fn=lambda _dir, excludes=None, is_file=False: excludes_seen.append(excludes),
            )
            excludes = excludes_seen.pop()
            _zip_files(str(checkout), excludes, str(tmp_path / name), include_gitignore=True)
        files = sorted(n for n in ZipFile(tmp_path / name).namelist() if not n.endswith("/"))
        return env["working_dir"], files, [r.getMessage() for r in caplog.records]

    before = packaged("before.zip")
    assert any(line.startswith(submit.GITIGNORE_LINE) for line in before[2])  # Ray's line, without the fix
    with submit.packaging_quiet():
        assert get_runtime_env_default_excludes() == []  # nothing for Ray to warn about
        after = packaged("after.zip")
    assert after[:2] == before[:2]
    assert after[1] == sorted(kept)
    assert not any(submit.GITIGNORE_LINE in line or "ignored by default" in line for line in after[2])
    assert submit.DEFAULT_EXCLUDES_ENV not in os.environ  # restored
    # every default exclude of this Ray is one of the job's own: the upload stays the same
    assert set(RAY_RUNTIME_ENV_DEFAULT_EXCLUDES.split(",")) <= set(submit.WORKING_DIR_EXCLUDES)


def test_a_stage_job_is_given_a_stop_grace_its_driver_can_end_in():
    """Ray SIGKILLs a stopped job's driver RAY_JOB_STOP_WAIT_TIME_S (3 s) after its SIGTERM; a pretrain driver
    took 2.3-4.1 s to stop its workers, print its line, delete its lease and exit (docs/deployment.md), so a
    stage's job gets 30 s, which --env overrides; a `command` job keeps Ray's default."""
    assert submit.job_env_vars("pretrain", ["A=1"]) == {"A": "1", "RAY_JOB_STOP_WAIT_TIME_S": "30"}
    assert submit.job_env_vars("speedrun", ["RAY_JOB_STOP_WAIT_TIME_S=0"]) == {
        "RAY_JOB_STOP_WAIT_TIME_S": "0"
    }
    assert submit.job_env_vars("command", ["A=1"]) == {"A": "1"}
    for bad in ("2.5", "-1", "", "ten"):
        with pytest.raises(ValueError) as e:
            submit.job_env_vars("command", [f"RAY_JOB_STOP_WAIT_TIME_S={bad}"])
        assert str(e.value) == (
            f"--env RAY_JOB_STOP_WAIT_TIME_S={bad}: Ray reads it as whole seconds; allowed: an integer >= 0"
        )


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
    assert ray_token.load_token() is None
    (home / ".ray" / "auth_token").write_text("from-home\n")
    assert ray_token.load_token() == "from-home"
    (tmp_path / "p").write_text("from-path")
    monkeypatch.setenv("RAY_AUTH_TOKEN_PATH", str(tmp_path / "p"))
    assert ray_token.load_token() == "from-path"
    monkeypatch.setenv("RAY_AUTH_TOKEN", "from-env")
    assert ray_token.load_token() == "from-env"
    (tmp_path / "f").write_text(" from-flag ")
    assert ray_token.load_token(str(tmp_path / "f")) == "from-flag"
    (tmp_path / "empty").write_text("\n")
    with pytest.raises(ValueError, match="--token-file: token file .* is empty"):
        ray_token.load_token(str(tmp_path / "empty"))
    monkeypatch.delenv("RAY_AUTH_TOKEN")
    monkeypatch.setenv("RAY_AUTH_TOKEN_PATH", str(tmp_path / "missing"))
    with pytest.raises(FileNotFoundError, match="RAY_AUTH_TOKEN_PATH"):
        ray_token.load_token()


def test_cli_parses_options_before_stage_and_passes_the_rest():
    from raychat.cli import build_parser

    args = build_parser("submit").parse_args(
        ["submit", "--no-wait", "--num-gpus", "1", "pretrain", "--depth", "12", "--storage-path", "/mnt/runs"]
    )
    assert (args.stage, args.stage_args, args.no_wait, args.num_gpus) == (
        "pretrain",
        ["--depth", "12", "--storage-path", "/mnt/runs"],
        True,
        1.0,
    )


def test_missing_dependency_message_names_the_python_ray_runs(tmp_path):
    """A real process tree like a job's: a process that has loaded Ray (the job supervisor) -> sh -c -> the
    entrypoint. The entrypoint finds the supervisor's Python from the ray/_raylet.so it loaded."""
    supervisor = "import subprocess, sys, ray._raylet; sys.exit(subprocess.run(['/bin/sh', '-c', sys.argv[1]]).returncode)"
    code = "from raychat.ops.job_python import missing_dependency_message as m; print(m('pyarrow'))"
    entrypoint = (
        f"true && {sys.executable} -c {code!r}"  # `true &&`: sh stays in between, as with Ray's shell
    )
    env = dict(os.environ, RAY_JOB_CONFIG_JSON_ENV_VAR="{}")
    r = subprocess.run(
        [sys.executable, "-c", supervisor, entrypoint], env=env, capture_output=True, text=True, timeout=120
    )
    assert r.returncode == 0, r.stderr
    ray_python = Path(sys.prefix) / "bin" / "python3"
    assert r.stdout.strip() == (
        f"this Python, {sys.executable} (Python {sys.version.split()[0]}), cannot import 'pyarrow', a dependency"
        f" of raychat. This Ray job's `python` is not the Python the cluster runs Ray with (Ray itself runs "
        f"{ray_python} there): resubmit with `raychat submit --python {ray_python} ...`, or start the "
        "cluster's nodes with that Python's bin first on PATH (docs/deployment.md)"
    )
    from raychat.ops.job_python import missing_dependency_message

    assert missing_dependency_message("torch").endswith(
        "cannot import 'torch', a dependency of raychat: install raychat into it (pip install raychat) or run "
        "raychat from its venv"
    )  # not in a job: no Ray advice


# ---------------------------------------------------------------- a real cluster with token auth


@pytest.fixture(scope="module")
def token_cluster(tmp_path_factory):
    """A head node (tests/support/cluster.py) started as `.venv/bin/ray start` from a shell whose PATH finds a bare
    Python first (a venv with the standard library only, like the machine's global Python): what a job's
    `python` is on a head started without the venv on PATH. Ray itself runs this venv's Python."""
    bare = tmp_path_factory.mktemp("bare") / "py"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(bare)], check=True)
    cluster = LocalCluster(short_temp_dir("rcsub"), head_cpus=1, path_prefix=[str(bare / "bin")])
    try:
        cluster.start(workers={})
        yield {
            "url": cluster.dashboard_url,
            "token_file": cluster.token_file,
            "tmp": cluster.root,
            "bare_python": bare / "bin" / "python",
            "cluster": cluster,
        }
    finally:
        cluster.stop()


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
    r = _raychat(["jobs", "list", *conn], c["tmp"])  # the module's first test on its cluster: no job yet
    assert (r.returncode, r.stdout) == (0, "")  # stdout: job lines only
    assert r.stderr.endswith(f"no jobs on the cluster at {c['url']} (`raychat submit` starts one)\n")
    # exactly the command of docs/deployment.md
    r = _raychat(["submit", *conn, "--job-id", "rc-ok", "command", "python", "-c", "print(6 * 7)"], c["tmp"])
    assert r.returncode == 0, r.stdout + r.stderr
    assert "\n42\n" in r.stdout
    assert "job rc-ok SUCCEEDED" in r.stderr
    assert "Uploading package gcs://" in r.stderr  # Ray's line of the working dir's upload (a fresh cluster)
    # Ray's warning of each default exclude the checkout holds (.git, .venv) and its .gitignore line (3 times)
    assert "is now ignored by default" not in r.stderr and submit.GITIGNORE_LINE not in r.stderr, r.stderr

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

    # about the job, not the cluster: exit 2 with the reason (was exit 4, "unreachable or unauthorized")
    r = _raychat(["submit", *conn, "--job-id", "rc-ok", "command", "python", "-c", "print(1)"], c["tmp"])
    assert r.returncode == 2 and r.stderr.strip().endswith(
        "raychat submit: error: --job-id rc-ok: a job with this submission id already exists on this cluster; choose "
        "another"
    ), r.stdout + r.stderr  # was "Request failed with status code 500: Traceback (most recent call last):"
    assert "Uploading package" not in r.stderr and "skipping upload" not in r.stderr  # refused first
    for command in (["logs"], ["stop"], ["logs", "--follow"]):  # --follow: was aiohttp's traceback, exit 1
        r = _raychat(["jobs", *command, *conn, "rc-nosuchjob"], c["tmp"])
        assert (r.returncode, r.stderr.strip().splitlines()[-1]) == (
            2, "raychat jobs: error: no job 'rc-nosuchjob' on this cluster (`raychat jobs list` shows its jobs)"
        ), r.stdout + r.stderr  # fmt: skip

    # The token through RAY_AUTH_TOKEN_PATH works too; no token at all is refused with exit code 4.
    r = _raychat(["jobs", "list", "--address", c["url"]], c["tmp"], RAY_AUTH_TOKEN_PATH=str(c["token_file"]))
    assert r.returncode == 0 and "rc-ok" in r.stdout, r.stderr
    r = _raychat(["jobs", "list", "--address", c["url"]], c["tmp"])
    assert r.returncode == 4, r.stdout + r.stderr
    assert "Unauthorized" in r.stderr or "authentication" in r.stderr.lower()


@pytest.mark.ray
def test_a_gcs_address_takes_the_token_file_and_serve_has_one_too(token_cluster, tmp_path):
    """--address HOST:PORT of the GCS (what `ray start --address` takes) reaches the cluster with --token-file's
    token: the Jobs client asks the GCS for the dashboard, `raychat serve` connects to it, and a fixed cluster
    refuses a replica it can never hold at once. No RAY_* variable and no ~/.ray/auth_token: only the flag."""
    c = token_cluster
    gcs, token_file = c["cluster"].gcs_address, str(c["token_file"])
    r = _raychat(["jobs", "list", "--address", gcs, "--token-file", token_file], c["tmp"])
    assert r.returncode == 0, r.stdout + r.stderr  # was 4: "--token-file: ... refused the token in ..."

    ckpt = write_tiny_checkpoint(tmp_path / "ckpt")
    serve = ["serve", "--checkpoint", str(ckpt), "--num-gpus", "1", "--address", gcs, "--no-block"]
    r = _raychat([*serve, "--token-file", token_file], c["tmp"])
    assert r.returncode == 2 and r.stderr.strip().splitlines()[-1].startswith(
        "raychat serve: error: --num-cpus, --num-gpus, --min-replicas: one of them needs {CPU: 1, GPU: 1}; no "
        "node type has room: GPU (need 1, the most a node has is 0); largest node type: alive node "
    ), r.stdout + r.stderr  # was "unrecognized arguments: --token-file"

    # `raychat serve` connected as a driver: `jobs list` shows its Ray job id, which logs and stop refuse in a line
    r = _raychat(["jobs", "list", "--address", gcs, "--token-file", token_file], c["tmp"])
    (driver,) = [
        line.split("\t")[0] for line in r.stdout.splitlines() if f"serve --checkpoint {ckpt}" in line
    ]
    for command in (["logs"], ["logs", "--follow"], ["stop"]):  # was Ray's 400, exit 4; --follow a traceback
        r = _raychat(["jobs", *command, "--address", gcs, "--token-file", token_file, driver], c["tmp"])
        assert (r.returncode, r.stderr.strip().splitlines()[-1]) == (
            2, f"raychat jobs: error: job '{driver}' was not submitted: it is a Ray driver that connected to the "
            "cluster itself (ray.init: `raychat serve`, a script), listed by its Ray job id; the Jobs API has no logs "
            "of it and cannot stop it: its output is where that process runs"
        ), r.stdout + r.stderr  # fmt: skip

    _wrong_token_is_refused_in_one_line(serve, c, tmp_path)


@pytest.mark.ray
def test_rl_takes_the_token_file_of_a_gcs_address(token_cluster, tmp_path):
    """`raychat rl --address HOST:PORT --token-file F` connects with the flag's token (no RAY_* variable, no
    ~/.ray/auth_token) and plans its actors against the cluster: a GPU layout on this CPU-only head is refused
    after connecting. A wrong token is refused in one line naming --token-file."""
    c = token_cluster
    gcs, token_file = c["cluster"].gcs_address, str(c["token_file"])
    ckpt = write_tiny_checkpoint(tmp_path / "sft", stage="sft")
    rl = ["rl", "--preset", "tiny", "--storage-path", str(tmp_path / "runs"), "--init-from", str(ckpt),
          "--use-gpu", "--address", gcs]  # fmt: skip
    r = _raychat([*rl, "--token-file", token_file], c["tmp"])
    assert r.returncode == 2 and r.stderr.strip().splitlines()[-1].startswith(
        "raychat rl: error: --learner-workers 1 x --cpus-per-learner 0.5 --use-gpu: one of them needs {CPU: 0.5, "
        "GPU: 1}; no node type has room: GPU (need 1, the most a node has is 0); largest node type: alive node "
    ), r.stdout + r.stderr  # was "unrecognized arguments: --token-file"

    _wrong_token_is_refused_in_one_line(rl, c, tmp_path)


@pytest.mark.ray
def test_pretrain_takes_the_token_file_of_ray_address(token_cluster, tmp_path, small_tokenizer):
    """`RAY_ADDRESS=HOST:PORT raychat pretrain --token-file F` (no other RAY_* variable, no ~/.ray/auth_token)
    connects with the flag's token and plans its workers against the cluster: a GPU layout on this CPU-only head
    is refused after connecting. A wrong token is refused in one line naming --token-file. (sft and speedrun
    connect the same way: raychat.train.layout.start_or_connect.)"""
    c = token_cluster
    gcs, token_file = c["cluster"].gcs_address, str(c["token_file"])
    small_tokenizer.save(tmp_path / "tokenizer")
    entries = write_shards(["a b c d " * 10] * 8, tmp_path / "data", num_shards=2, log=lambda *_: None)
    write_manifest(tmp_path / "data", {"source": "test", "shards": entries})
    pretrain = ["pretrain", "--preset", "tiny", "--storage-path", str(tmp_path / "runs"), "--data-dir",
                str(tmp_path / "data"), "--tokenizer-path", str(tmp_path / "tokenizer"), "--use-gpu"]  # fmt: skip
    r = _raychat([*pretrain, "--token-file", token_file], c["tmp"], RAY_ADDRESS=gcs)
    assert r.returncode == 2 and r.stderr.strip().splitlines()[-1].startswith(
        "raychat pretrain: error: --num-workers 2 x --cpus-per-worker 0.5 --use-gpu: one of them needs {CPU: 0.5, "
        "GPU: 1}; no node type has room: GPU (need 1, the most a node has is 0); largest node type: alive node "
    ), r.stdout + r.stderr  # was "unrecognized arguments: --token-file"

    _wrong_token_is_refused_in_one_line(pretrain, c, tmp_path, RAY_ADDRESS=gcs)


def _wrong_token_is_refused_in_one_line(argv: list[str], c, tmp_path, **env) -> None:
    """`raychat *argv --token-file F` (in `env`) with a token the cluster does not know ends in one line naming
    --token-file, the cluster and F, with Ray's reason (InvalidAuthToken)."""
    gcs, wrong = c["cluster"].gcs_address, tmp_path / "wrong-token"
    wrong.write_text("not-the-token\n")
    # one GCS connection attempt instead of Ray's 20 (1 s apart)
    r = _raychat([*argv, "--token-file", str(wrong)], c["tmp"], RAY_gcs_server_port_wait_time_s="1", **env)
    last = r.stderr.strip().splitlines()[-1]
    assert r.returncode == 2 and last.startswith(
        f"raychat {argv[0]}: error: --token-file: the Ray cluster at {gcs} refused the token in {wrong} ("
    ), r.stdout + r.stderr
    assert "InvalidAuthToken" in last


def _job_statuses(c) -> dict[str, str]:
    """submission id -> status, straight from the Jobs REST API the dashboard serves (GET /api/jobs/)."""
    req = urllib.request.Request(
        c["url"] + "/api/jobs/", headers={"Authorization": f"Bearer {c['token_file'].read_text().strip()}"}
    )
    with urllib.request.urlopen(req, timeout=10) as r:
        return {j["submission_id"]: j["status"] for j in json.load(r)}


@pytest.mark.ray
def test_stage_job_names_the_python_it_needs_and_runs_with_python_flag(token_cluster, capsys):
    """The head's PATH finds a bare Python: `python jobs/pretrain.py` cannot import raychat's dependencies and
    the job says so in one line, naming the Python Ray runs; with --python that Python, the job succeeds.
    `raychat submit` runs in this process here (the CLI in a subprocess is tested above)."""
    c = token_cluster
    conn = ["--address", c["url"], "--token-file", str(c["token_file"])]
    ray_python = Path(sys.executable).parent / "python3"  # the shebang of .venv/bin/ray, so Ray's workers
    assert Path(sys.executable).with_name("ray").read_text().splitlines()[0] == f"#!{ray_python}"

    def submit_(*args: str) -> tuple[int, str, str]:
        rc = raychat_main(["submit", *conn, *args])
        out, err = capsys.readouterr()
        return rc, out, err

    rc, out, err = submit_("--job-id", "rc-bare", "pretrain", "--help")
    assert rc == 1, out + err
    line = next(x for x in out.splitlines() if x.startswith("raychat: error:"))
    assert line.startswith(f"raychat: error: this Python, {c['bare_python']} (Python ")
    assert (
        f"Ray itself runs {ray_python} there): resubmit with `raychat submit --python {ray_python} ...`"
        in line
    )
    assert "Traceback" not in out

    rc, out, err = submit_("--job-id", "rc-pinned", "--python", str(ray_python), "pretrain", "--help")
    assert rc == 0, out + err
    assert "usage: raychat pretrain" in out
    assert f"submitted rc-pinned: {ray_python} jobs/pretrain.py --help" in err

    rc, out, err = submit_("--job-id", "rc-nopy", "--python", "/no/such/python", "pretrain", "--help")
    assert rc == 1, out + err
    assert "the job's shell found no such command ('/no/such/python': exit 127)" in err

    statuses = _job_statuses(c)
    assert {k: statuses[k] for k in ("rc-bare", "rc-pinned", "rc-nopy")} == {
        "rc-bare": "FAILED",
        "rc-pinned": "SUCCEEDED",
        "rc-nopy": "FAILED",
    }


def _wait_for_status(c, job_id: str, want: str, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while _job_statuses(c).get(job_id) != want:
        assert time.monotonic() < deadline, f"{job_id}: not {want} within {timeout_s} s: {_job_statuses(c)}"
        time.sleep(0.5)


@pytest.mark.ray
def test_a_job_that_cannot_start_is_refused_or_reported(token_cluster):
    """The fixture's head (1 CPU, no GPU, `ray start --head`: no autoscaler, Ray's read-only monitor) can never
    hold a --num-gpus 1 entrypoint: refused before submission (was PENDING, silent, for Ray's 15-minute start
    timeout). A --num-cpus 1 job behind another that holds the CPU waits PENDING: following it says what it
    waits for; `jobs stop` of it says that Ray stops it only once its driver starts, which then happens (STOPPED)."""
    c = token_cluster
    conn = ["--address", c["url"], "--token-file", str(c["token_file"])]
    deadline = time.monotonic() + 30  # the monitor's first report comes seconds after the head starts
    while submit.fixed_cluster_capacity(submit.make_client(c["url"], str(c["token_file"]))) is None:
        assert time.monotonic() < deadline, "Ray's monitor reported no read-only node types within 30 s"
        time.sleep(1)
    before = set(_job_statuses(c))
    r = _raychat(["submit", *conn, "--num-gpus", "1", "command", "echo", "hi"], c["tmp"])
    assert r.returncode == 2 and r.stderr.startswith(
        "raychat submit: error: --num-gpus 1: no node of this cluster has room for the job's entrypoint {GPU: 1}: "
        "GPU (need 1, the most a node has is 0); the cluster has no autoscaler to add one (its nodes: alive node "
    ), r.stdout + r.stderr
    assert r.stderr.endswith(" {CPU: 1})\n") and r.stderr.count("\n") == 1, r.stderr
    assert set(_job_statuses(c)) == before  # nothing submitted

    hold = ["submit", *conn, "--num-cpus", "1", "--no-wait", "--job-id", "rc-hold", "command", "sleep", "300"]
    assert _raychat(hold, c["tmp"]).returncode == 0
    _wait_for_status(c, "rc-hold", "RUNNING")
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")} | {"HOME": str(c["tmp"] / "home")}
    err_path = c["tmp"] / "rc-wait.err"  # read while it runs: its PENDING line is the moment to stop it
    with open(err_path, "w") as err_file:
        waiting = subprocess.Popen(
            [sys.executable, "-m", "raychat.cli", "submit", *conn, "--num-cpus", "1", "--job-id", "rc-wait",
             "command", "sleep", "60"],
            env=env, stdout=subprocess.PIPE, stderr=err_file, text=True,
        )  # fmt: skip
    try:
        # its report comes PENDING_REPORT_AFTER_S after the submission, itself seconds after a loaded start
        deadline = time.monotonic() + 120
        while "job rc-wait still PENDING after " not in err_path.read_text():
            assert waiting.poll() is None, err_path.read_text()
            assert time.monotonic() < deadline, f"no PENDING report within 120 s: {err_path.read_text()}"
            time.sleep(0.5)
        r = _raychat(["jobs", "stop", *conn, "rc-wait"], c["tmp"])
        assert (r.returncode, r.stdout) == (0, f"rc-wait: stop requested, but {submit.PENDING_STOP}\n"), (
            r.stderr
        )
        assert "RAY_JOB_START_TIMEOUT_SECONDS on the head, default 900 s" in r.stdout
        assert _job_statuses(c)["rc-wait"] == "PENDING"  # the stop has not taken: Ray's behaviour
        r = _raychat(["jobs", "stop", *conn, "rc-hold"], c["tmp"])
        assert (r.returncode, r.stdout) == (0, "rc-hold: stop requested\n"), r.stderr
        out, _ = waiting.communicate(timeout=120)
    finally:
        waiting.kill()
    err = err_path.read_text()
    assert waiting.returncode == 3, out + err  # STOPPED: the queued stop, once its driver started
    line = next(x for x in err.splitlines() if x.startswith("job rc-wait still PENDING after "))
    assert line.split(" s: ", 1)[1] == (
        "its driver has not started; Ray waits for a node with room for its entrypoint {CPU: 1} (--num-cpus 1) and "
        "its runtime_env (working_dir upload, pip) and fails a job that has not started within Ray's start timeout "
        "(RAY_JOB_START_TIMEOUT_SECONDS on the head, default 900 s)"
    ), err
    assert "job rc-wait STOPPED" in err
    assert {k: _job_statuses(c)[k] for k in ("rc-hold", "rc-wait")} == {
        "rc-hold": "STOPPED",
        "rc-wait": "STOPPED",
    }


@pytest.mark.ray
def test_a_job_drivers_lease_refusal_finds_that_the_holders_job_has_ended(token_cluster, capsys):
    """What a unit test cannot show: a job's driver asks the Jobs API of its own cluster (Ray's client without an
    address: the driver's RAY_ADDRESS, its GCS; the nodes' token) for the lease holder's job. The holder here,
    a lease written as a driver on another node writes it, names a job that has SUCCEEDED and renewed it since:
    the refusal names the process to kill, not `raychat jobs stop` (tests/unit/test_lease.py has the lines)."""
    c = token_cluster
    conn = ["--address", c["url"], "--token-file", str(c["token_file"])]
    assert raychat_main(["submit", *conn, "--job-id", "rc-lease-done", "command", "true"]) == 0
    root = c["tmp"] / "lease-root"
    holder = {"host": "node-x", "pid": 4242, "command": "holder", "job": "rc-lease-done", "token": "0" * 16}
    code = textwrap.dedent(f"""
        import json, os, time
        from raychat.lease import LeaseHeld, RunLease
        from raychat.storage import open_storage
        s = open_storage({str(root)!r})
        os.makedirs(f"{{s.path}}/r", exist_ok=True)
        now = time.time()
        lease = {{**{holder!r}, "started_at": now - 60, "renewed_at": now}}
        open(f"{{s.path}}/r/lease.json", "w").write(json.dumps(lease))
        try:
            RunLease(s, s.run_path("r")).acquire()
        except LeaseHeld as e:
            print("refused:", e)
    """)
    python = str(Path(sys.executable).parent / "python3")  # the Python Ray runs (the head's PATH: a bare one)
    assert raychat_main(["submit", *conn, "command", python, "-c", code]) == 0
    out = capsys.readouterr().out
    line = next(x for x in out.splitlines() if x.startswith("refused: "))
    assert "but its Ray job rc-lease-done is SUCCEEDED (ended " in line, out
    assert line.endswith(
        "so `raychat jobs stop rc-lease-done` cannot end it: its driver outlived the job and renews the lease: "
        "`kill 4242` on node-x ends it (the driver deletes the lease as it exits); or use another --run-name"
    ), out
