"""raychat.storage and raychat.checkpoint_manager's resolver: storage roots and checkpoint references, on local
dirs and on a real S3 server (moto)."""

from __future__ import annotations

import json
import os
import re
import stat
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pyarrow.fs as pafs
import pytest
from support.stopped_writer import Held, age, run_killed

from raychat import storage as st
from raychat.atomic import STAGING_IDLE_S, is_leftover
from raychat.checkpoint_manager import CheckpointError, commit_directory, resolve_checkpoint
from raychat.cli import main
from raychat.storage import check_writable, open_storage

LEGACY_NAME = "checkpoint_2026-12-01_09-30-00.000002"  # Ray Train's own naming, from before commit markers


def write_checkpoint(root: Path, step: int | None, model: bool = True, commit: bool = True) -> Path:
    """A checkpoint dir: model.safetensors (bytes that name the step), meta.json (if step is not None), the
    optimizer state, and (commit, with a step) the commit marker. Only the files and the marker matter to the
    resolver."""
    root.mkdir(parents=True, exist_ok=True)
    if model:
        (root / "model.safetensors").write_bytes(f"weights of step {step}".encode() * 100)
    if step is not None:
        (root / "meta.json").write_text(json.dumps({"step": step, "stage": "pretrain"}))
    (root / "optim.pt").write_bytes(b"o" * 10)
    if commit and step is not None:
        commit_directory(root, step, "pretrain")
    return root


@pytest.fixture
def runs(tmp_path) -> Path:
    """<tmp>/runs/pre (steps 2 and 5 committed, 7 written but never committed), <tmp>/runs/sft (steps 10 and
    20 committed, a step-99 dir of the old naming without a marker), <tmp>/runs/empty (a config file, a
    half-written checkpoint)."""
    root = tmp_path / "runs"
    write_checkpoint(root / "pre" / "checkpoint_000002", 2)
    write_checkpoint(root / "pre" / "checkpoint_000005", 5)
    write_checkpoint(root / "pre" / "checkpoint_000007", 7, model=False, commit=False)
    write_checkpoint(root / "sft" / "checkpoint_000010", 10)
    write_checkpoint(root / "sft" / "checkpoint_000020", 20)
    write_checkpoint(root / "sft" / LEGACY_NAME, 99, commit=False)
    (root / "empty").mkdir()
    (root / "empty" / "config.yaml").write_text("depth: 4\n")
    write_checkpoint(root / "empty" / "checkpoint_000001", None)
    return root


# ---------------------------------------------------------------------------------------------- local


def test_every_reference_form_resolves_to_the_newest_committed_checkpoint(runs, monkeypatch):
    newest = runs / "pre" / "checkpoint_000005"  # 7 is newer but was never committed
    assert resolve_checkpoint(runs / "pre") == newest
    assert resolve_checkpoint(f"{runs}/pre/latest") == newest
    assert resolve_checkpoint(f"{runs}/pre/") == newest
    assert resolve_checkpoint("pre", storage=str(runs)) == newest
    assert resolve_checkpoint("pre", storage=open_storage(runs)) == newest
    assert resolve_checkpoint(f"file://{runs}/pre/latest") == newest
    assert resolve_checkpoint(runs / "pre" / "checkpoint_000002") == runs / "pre" / "checkpoint_000002"
    assert resolve_checkpoint(runs / "sft" / "latest") == runs / "sft" / "checkpoint_000020"  # 99: no marker
    monkeypatch.chdir(runs.parent)
    assert resolve_checkpoint("runs/pre/latest") == newest  # relative paths are relative to the cwd


def test_newest_is_the_highest_step_not_the_last_name(tmp_path):
    # a run resumed with a new naming scheme: the step in meta.json decides
    write_checkpoint(tmp_path / "r" / "checkpoint_000009", 30)
    write_checkpoint(tmp_path / "r" / "checkpoint_000010", 12)
    assert resolve_checkpoint(tmp_path / "r" / "latest").name == "checkpoint_000009"


def test_bad_references_fail_in_one_line_naming_the_flag_and_what_exists(runs):
    cases = [
        (f"{runs}/empty/latest", f"--checkpoint: {runs}/empty has no committed checkpoint ({runs}/empty holds: "
         "checkpoint_000001 (uncommitted)/, config.yaml)"),
        (f"{runs}/nope/latest", f"--checkpoint: {runs}/nope does not exist ({runs} holds: empty/, pre/, sft/)"),
        (str(runs), f"--checkpoint: {runs} has no committed checkpoint ({runs} holds: empty/, pre/, sft/); run "
         f"dirs in it that have some: {runs}/pre, {runs}/sft"),  # a stage dir given for its run dir
        (str(runs.parent), f"--checkpoint: {runs.parent} has no committed checkpoint ({runs.parent} holds: runs/); "
         f"run dirs below it that have some: {runs}/pre, {runs}/sft"),  # a speedrun's --out (runs-tiny/rl/rl)
        (f"{runs}/pre/checkpoint_000007", f"--checkpoint: checkpoint {runs}/pre/checkpoint_000007 is not "
         "committed (no commit.json): a save that did not finish, or a checkpoint written before commit markers"),
        (f"{runs}/sft/{LEGACY_NAME}", f"--checkpoint: checkpoint {runs}/sft/{LEGACY_NAME} is not "
         "committed (no commit.json): a save that did not finish, or a checkpoint written before commit markers"),
        (f"{runs}/empty/config.yaml", f"--checkpoint: {runs}/empty/config.yaml is a file; give a checkpoint "
         "dir, a run dir or <run dir>/latest"),
        ("", "--checkpoint: empty; give a checkpoint dir, a run dir, <run dir>/latest or a run name"),
        ("hdfs://nn/runs/pre", "--checkpoint: scheme hdfs:// of 'hdfs://nn/runs/pre' is not supported; use a "
         "directory, s3:// or gs://"),
    ]  # fmt: skip
    for ref, message in cases:
        with pytest.raises(ValueError) as e:
            resolve_checkpoint(ref)
        assert str(e.value) == message
        assert "\n" not in str(e.value)
    with pytest.raises(ValueError, match=rf"^--init-from: {runs}/zzz does not exist \({runs} holds: empty/"):
        resolve_checkpoint("zzz", storage=str(runs), flag="--init-from")
    with pytest.raises(CheckpointError):
        resolve_checkpoint(runs / "pre" / "checkpoint_000007")
    for name in ("..", ".hidden", "a b"):
        with pytest.raises(
            ValueError, match=rf"^--init-from: '{re.escape(name)}' is not a run name \(letters"
        ):
            resolve_checkpoint(name, storage=str(runs / "pre"), flag="--init-from")


def test_local_storage_root_is_created_and_checked_for_writing(tmp_path):
    root = open_storage(tmp_path / "a" / "runs")
    assert (root.uri, root.is_local, root.run_path("r1")) == (
        str(tmp_path / "a" / "runs"),
        True,
        str(tmp_path / "a" / "runs" / "r1"),
    )
    assert root.ray_train_storage() == {"storage_path": str(tmp_path / "a" / "runs")}
    check_writable(root)
    assert list((tmp_path / "a" / "runs").iterdir()) == []  # the probe file is gone again
    (tmp_path / "file").write_text("x")
    with pytest.raises(ValueError, match=rf"^--storage-path: {tmp_path}/file/runs is not writable: "):
        check_writable(open_storage(tmp_path / "file" / "runs"))  # root may write anywhere: a file blocks it
    with pytest.raises(ValueError, match="^--out: empty"):
        open_storage("  ", flag="--out")


def test_an_uploaded_directory_is_readable_by_others_not_private_like_its_staging_dir(tmp_path):
    # raychat export stages into a private temporary directory; the export must not keep its 0o700
    staging = tmp_path / "staging"
    staging.mkdir(mode=0o700)
    (staging / "config.json").write_text("{}")
    (staging / "config.json").chmod(0o644)
    old = os.umask(0o022)
    try:
        where = st.upload_dir(staging, open_storage(tmp_path / "runs"), str(tmp_path / "runs" / "hf"))
    finally:
        os.umask(old)
    out = tmp_path / "runs" / "hf"
    assert where == str(out) and (out / "config.json").read_text() == "{}"
    assert (stat.S_IMODE(out.stat().st_mode), stat.S_IMODE((out / "config.json").stat().st_mode)) == (
        0o755,
        0o644,
    )
    assert sorted(p.name for p in (tmp_path / "runs").iterdir()) == ["hf"]
    old = os.umask(0o022)
    try:  # a fetched copy (a remote checkpoint's local cache, shared by the node's processes) likewise
        cache = st.download_dir(
            open_storage(tmp_path / "runs"), str(out), tmp_path / "cache" / "hf", lambda d: None
        )
    finally:
        os.umask(old)
    assert stat.S_IMODE(cache.stat().st_mode) == 0o755 and (cache / "config.json").read_text() == "{}"


# ---------------------------------------------------------------------------------------------- S3 (moto)


def lock_of(copy: Path) -> str:
    """The flock file's name of the cached copy `copy` (<key>-<12 hex>-<name>): one per URI, .<key>-<name>.lock"""
    key, _, name = copy.name.split("-", 2)
    return f".{key}-{name}.lock"


def _upload(local: Path, fs: pafs.FileSystem, dest: str) -> None:
    pafs.copy_files(str(local), dest, source_filesystem=pafs.LocalFileSystem(), destination_filesystem=fs)


def test_s3_root_resolves_downloads_once_and_never_uses_a_half_download(runs, s3_env, tmp_path, monkeypatch):
    bucket = s3_env.make_bucket()
    fs = s3_env.filesystem()
    _upload(runs, fs, f"{bucket}/runs")
    root = open_storage(f"s3://{bucket}/runs/")
    assert (root.uri, root.path, root.is_local) == (f"s3://{bucket}/runs", f"{bucket}/runs", False)
    check_writable(root)
    assert root.ray_train_storage()["storage_path"] == f"{bucket}/runs"  # Ray Train: no scheme with a fs
    cache = tmp_path / "cache"

    got = resolve_checkpoint(f"s3://{bucket}/runs/pre/latest", cache_dir=cache)
    assert got.parent == cache and got.name.endswith("-checkpoint_000005")
    src = runs / "pre" / "checkpoint_000005"
    assert {p.name: p.read_bytes() for p in got.iterdir()} == {p.name: p.read_bytes() for p in src.iterdir()}
    assert resolve_checkpoint("pre", storage=root, cache_dir=cache) == got
    stamp = (got / "model.safetensors").stat().st_mtime_ns
    assert resolve_checkpoint(f"s3://{bucket}/runs/pre", cache_dir=cache) == got  # cached: not fetched again
    assert (got / "model.safetensors").stat().st_mtime_ns == stamp

    # A download that breaks half-way leaves nothing under the final name; a damaged cached copy (a file
    # gone) is fetched again.
    (got / "meta.json").unlink()
    real_copy = st.pafs.copy_files

    def broken_copy(src, dst, **kw):
        real_copy(src, dst, **kw)
        Path(dst, "model.safetensors").unlink()
        raise OSError("connection reset")

    monkeypatch.setattr(st.pafs, "copy_files", broken_copy)
    with pytest.raises(OSError, match="connection reset"):
        resolve_checkpoint(f"s3://{bucket}/runs/pre/latest", cache_dir=cache)
    assert sorted(p.name for p in cache.iterdir()) == [lock_of(got), got.name]  # no temporary dir
    monkeypatch.setattr(st.pafs, "copy_files", real_copy)
    again = resolve_checkpoint(f"s3://{bucket}/runs/pre/latest", cache_dir=cache)
    assert again == got and (again / "meta.json").read_text() == (src / "meta.json").read_text()

    # a newer checkpoint appears in the bucket: latest follows it
    write_checkpoint(tmp_path / "new" / "checkpoint_000008", 8)
    _upload(tmp_path / "new", fs, f"{bucket}/runs/pre")
    assert resolve_checkpoint(f"s3://{bucket}/runs/pre/latest", cache_dir=cache).name.endswith("_000008")


FETCH_STOPPED_BEFORE_ITS_RENAME = """
import raychat.checkpoint_manager as cm
real = cm.verify
def verify(directory, *args, **kwargs):
    if os.path.basename(directory).startswith("."):  # the staged download, before its rename
        stop()
    return real(directory, *args, **kwargs)
cm.verify = verify
print(cm.resolve_checkpoint(sys.argv[3], cache_dir=sys.argv[4]))
"""


def test_a_killed_fetchs_staging_is_removed_and_a_fetch_beside_a_live_one_waits_for_its_copy(
    runs, s3_env, tmp_path, monkeypatch
):
    """A process killed while it fetched a remote checkpoint left a full copy under `.<dest>.<16 hex>` in the
    cache for good (and its lock, released by its death); the next fetch removes it once it has been idle for
    STAGING_IDLE_S. A fetch while another process of the node fetches the same checkpoint (the two Train
    workers of a restarted group: CI once saw the second to finish rename the first's copy away while the first
    opened model.safetensors) waits for that one and uses its copy: one download, nothing renamed under a
    reader."""
    bucket = s3_env.make_bucket()
    _upload(runs, s3_env.filesystem(), f"{bucket}/runs")
    ref, cache = f"s3://{bucket}/runs/pre/latest", tmp_path / "cache"
    code = FETCH_STOPPED_BEFORE_ITS_RENAME.replace("sys.argv[3]", repr(ref)).replace(
        "sys.argv[4]", repr(str(cache))
    )

    def staged() -> list[Path]:
        return [p for p in cache.iterdir() if is_leftover(p.name)]

    run_killed(code, tmp_path / "killed")
    (killed,) = staged()
    assert (killed / "model.safetensors").is_file()
    age(killed, STAGING_IDLE_S + 60)
    live = Held(code, tmp_path / "live")  # removed the killed one's staging, stopped before renaming its own
    (staging,) = staged()
    assert staging != killed
    copies = []
    real_copy = st.pafs.copy_files
    monkeypatch.setattr(st.pafs, "copy_files", lambda *a, **kw: (copies.append(a), real_copy(*a, **kw)))
    with ThreadPoolExecutor(1) as pool:
        waiting = pool.submit(resolve_checkpoint, ref, cache_dir=cache)
        time.sleep(1.0)
        assert not waiting.done() and staged() == [staging]
        status, out = live.go()
        got = waiting.result(timeout=60)
    assert (status, out) == (0, f"{got}\n") and got.name.endswith("-checkpoint_000005")
    assert copies == []  # the waiting fetch found the live one's copy
    assert sorted(p.name for p in cache.iterdir()) == [lock_of(got), got.name]
    src = runs / "pre" / "checkpoint_000005"
    assert {p.name: p.read_bytes() for p in got.iterdir()} == {p.name: p.read_bytes() for p in src.iterdir()}


def test_a_fetch_keeps_a_copy_already_there_that_passes_its_check_and_replaces_one_that_fails(tmp_path):
    """download_dir finishing after another process put the same directory under `dest` keeps that copy (a
    reader may have it open: its files keep their inodes) and drops its own; a copy that fails the check is
    replaced."""
    src = write_checkpoint(tmp_path / "runs" / "pre" / "checkpoint_000002", 2)
    root, dest = open_storage(tmp_path / "runs"), tmp_path / "cache" / "pre-2"

    def check(d: Path) -> None:
        if (d / "model.safetensors").read_bytes() != (src / "model.safetensors").read_bytes():
            raise CheckpointError(f"{d}: model.safetensors differs")

    first = st.download_dir(root, str(src), dest, check)
    inode = (first / "model.safetensors").stat().st_ino
    assert st.download_dir(root, str(src), dest, check) == dest
    assert (dest / "model.safetensors").stat().st_ino == inode
    (dest / "model.safetensors").write_bytes(b"damaged")
    assert st.download_dir(root, str(src), dest, check) == dest
    assert (dest / "model.safetensors").read_bytes() == (src / "model.safetensors").read_bytes()
    assert sorted(p.name for p in dest.parent.iterdir()) == ["pre-2"]


def test_s3_bad_input_names_the_flag(runs, s3_env, tmp_path):
    bucket = s3_env.make_bucket()
    _upload(runs, s3_env.filesystem(), f"{bucket}/runs")
    with pytest.raises(ValueError) as e:
        resolve_checkpoint(f"s3://{bucket}/runs/empty/latest", cache_dir=tmp_path / "cache")
    assert str(e.value) == (
        f"--checkpoint: s3://{bucket}/runs/empty has no committed checkpoint (s3://{bucket}/runs/empty holds: "
        "checkpoint_000001 (uncommitted)/, config.yaml)"
    )
    with pytest.raises(ValueError) as e:
        resolve_checkpoint("nope", storage=f"s3://{bucket}/runs", cache_dir=tmp_path / "cache")
    assert str(e.value) == (
        f"--checkpoint: s3://{bucket}/runs/nope does not exist (s3://{bucket}/runs holds: empty/, pre/, sft/)"
    )
    missing = open_storage("s3://no-such-bucket-raychat/runs")
    with pytest.raises(ValueError) as e:
        check_writable(missing)
    assert str(e.value) == (
        "--storage-path: s3://no-such-bucket-raychat/runs is not writable: bucket 'no-such-bucket-raychat' "
        "does not exist"
    )
    with pytest.raises(ValueError) as e:
        resolve_checkpoint("s3://no-such-bucket-raychat/runs/pre/latest", cache_dir=tmp_path / "cache")
    assert str(e.value) == (
        "--checkpoint: s3://no-such-bucket-raychat/runs/pre does not exist (bucket 'no-such-bucket-raychat' "
        "does not exist)"
    )
    assert not (tmp_path / "cache").exists()  # nothing was downloaded


def test_s3_access_denied_without_credentials_says_where_they_come_from(s3_env, tmp_path, monkeypatch):
    """docs/deployment.md's S3 job on section 1's cluster (nodes started without AWS variables, the job given
    only --env AWS_ENDPOINT_URL) failed with a bare `access denied (... ACCESS_DENIED during PutObject ...)`."""
    bucket = s3_env.make_bucket()
    for var in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_PROFILE", "AWS_SHARED_CREDENTIALS_FILE"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))  # no ~/.aws/credentials
    with pytest.raises(ValueError) as e:
        check_writable(open_storage(f"s3://{bucket}/runs"))
    assert str(e.value).startswith(f"--storage-path: s3://{bucket}/runs is not writable: access denied (")
    assert str(e.value).endswith(
        "); this process found no AWS credentials (no AWS_ACCESS_KEY_ID, AWS_PROFILE or ~/.aws/credentials), "
        "which every process that opens the root needs (a job's driver, Train workers, RL actors): set them in "
        "the environment of every node's `ray start`, or pass them to a job with raychat submit --env "
        "AWS_ACCESS_KEY_ID=... --env AWS_SECRET_ACCESS_KEY=..."
    ), str(e.value)
    (tmp_path / ".aws").mkdir()
    (tmp_path / ".aws" / "credentials").write_text(
        "[default]\naws_access_key_id = wrong\naws_secret_access_key = x\n"
    )
    check_writable(
        open_storage(f"s3://{bucket}/runs")
    )  # the same process with a credential file: moto takes it


def test_a_storage_path_that_is_a_file_is_refused_on_s3_as_on_a_local_disk(s3_env, tmp_path):
    """An object at the root's name was accepted: the run's objects went to `<root>/...` beside it (a bucket
    holding `afile` and `afile/p/checkpoint_000002/...`, which no mount or download can show as directories),
    while a local file there is refused."""
    bucket = s3_env.make_bucket()
    with s3_env.filesystem().open_output_stream(f"{bucket}/afile") as f:
        f.write(b"hi")
    (tmp_path / "afile").write_text("hi")
    for root in (f"s3://{bucket}/afile", str(tmp_path / "afile")):
        with pytest.raises(ValueError) as e:
            check_writable(open_storage(root))
        assert str(e.value) == f"--storage-path: {root} is not writable: it is a file, not a directory"
    assert [i.path for i in s3_env.filesystem().get_file_info(pafs.FileSelector(bucket, recursive=True))] == [
        f"{bucket}/afile"
    ]


def test_a_relative_path_in_a_submitted_jobs_temporary_checkout_is_refused(tmp_path, monkeypatch, capsys):
    """`raychat submit data prepare --storage-path relruns` (or the default `runs`) wrote its shards into Ray's
    unpacked working_dir, which Ray deletes, and the job SUCCEEDED; nothing reached the user's directory."""
    job_copy = tmp_path / "session_x" / "runtime_resources" / "working_dir_files" / "_ray_pkg_a1bdcca6"
    job_copy.mkdir(parents=True)
    monkeypatch.chdir(job_copy)
    with pytest.raises(ValueError) as e:
        open_storage("relruns", "--storage-path")
    assert str(e.value) == (
        f"--storage-path 'relruns' is relative, and this Ray job runs in a temporary copy of the submitted "
        f"checkout ({job_copy}) that Ray deletes: give an absolute path on storage every node reads (e.g. "
        "--storage-path /mnt/checkpoints/runs), or s3:// / gs://"
    )
    assert open_storage(str(tmp_path / "runs")).path == str(tmp_path / "runs")  # absolute: as before
    assert main(["data", "prepare", "--source", str(tmp_path), "--storage-path", "relruns"]) == 2
    assert "error: --storage-path 'relruns' is relative, and this Ray job runs in" in capsys.readouterr().err
    assert main(["tokenizer", "train"]) == 2  # the defaults (runs/data) are relative too
    assert "is relative, and this Ray job runs in a temporary copy" in capsys.readouterr().err
    assert list(job_copy.iterdir()) == []  # nothing written into the copy
    monkeypatch.chdir(tmp_path)  # outside a job: a relative path is the working directory's, as before
    assert open_storage("relruns").path == str(tmp_path / "relruns")


S3_SETTINGS = (
    "S3 settings come from the environment of every node: AWS_ENDPOINT_URL (its scheme, http or https, is used), "
    "AWS_REGION, AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY or an instance role"
)


def test_options_and_keys_in_a_storage_uri_are_refused_naming_the_flag(s3_server, tmp_path, capsys):
    """`--storage-path "s3://b/runs?endpoint_override=...&scheme=http"` opened on the driver, but Storage.uri
    dropped the query, so every process that reopened the root from it (a Train worker's metrics sink, a
    checkpoint fetch, RL actors, serve replicas) went to AWS's endpoint instead; keys in a URI were written to
    logs, checkpoints' meta.json and job entrypoints. The refusal names the options, never a key's value."""
    bucket = s3_server.make_bucket()
    endpoint = s3_server.endpoint.removeprefix("http://")
    with pytest.raises(ValueError) as e:
        open_storage(f"s3://{bucket}/runs?endpoint_override={endpoint}&scheme=http")
    assert str(e.value) == (
        f"--storage-path: s3://{bucket}/runs: options in a storage URI (endpoint_override, scheme) are refused (the "
        f"processes that reopen the root on other nodes would go without them); give s3://{bucket}/runs: "
        f"{S3_SETTINGS}"
    )
    keys = "access_key=AKIDNOTSHOWN&secret_key=SECRETNOTSHOWN"
    for uri in (f"s3://{bucket}/runs?{keys}&scheme=http", f"s3://AKIDNOTSHOWN:SECRETNOTSHOWN@{bucket}/runs"):
        with pytest.raises(ValueError) as e:
            open_storage(uri, "--out")
        assert str(e.value) == (
            f"--out: s3://{bucket}/runs: keys in a storage URI are refused (they would be written to logs, "
            f"checkpoints' meta.json and job entrypoints); give s3://{bucket}/runs: {S3_SETTINGS}"
        )
    argv = ["sft", "--storage-path", str(tmp_path / "runs"), "--init-from", f"s3://{bucket}/runs/pre?{keys}"]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith(
        f"raychat sft: error: --init-from: s3://{bucket}/runs/pre: keys in a storage URI are "
    )
    assert "NOTSHOWN" not in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "runs").exists()


OBJECT_STORAGE = (
    "is on object storage; data and the tokenizer are read as files by every node: "
    "give a local or NFS directory"
)


@pytest.mark.parametrize(
    "argv, refusal",
    [
        (["data", "prepare"], f"raychat data prepare: error: --storage-path: s3://b/runs {OBJECT_STORAGE}"),
        (
            ["tokenizer", "train"],
            f"raychat tokenizer train: error: --data-dir: s3://b/runs/data {OBJECT_STORAGE}  (RAYCHAT_DEBUG=1 "
            "shows the traceback)",
        ),
    ],
)
def test_a_data_stage_refuses_an_object_storage_root_without_opening_it(argv, refusal, monkeypatch, capsys):
    """`--storage-path s3://...` for data prepare and tokenizer train opened the root first, which asked S3 for
    the bucket's region (10-14 s, then a network error where S3 cannot be reached, and never this refusal)."""
    for var in ("AWS_REGION", "AWS_DEFAULT_REGION", "AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3"):
        monkeypatch.delenv(var, raising=False)
    assert main([*argv, "--storage-path", "s3://b/runs"]) == 2
    assert capsys.readouterr().err == refusal + "\n"


def test_a_gs_root_gets_raychats_retry_limit_and_no_other(tmp_path):
    """raychat's retry_limit_seconds=60 is added to every gs:// root (the driver's and every worker's open alike);
    one given in the URI would have held on the driver only."""
    fs = open_storage("gs://bucket/runs").fs
    assert fs.__reduce__()[1][0]["retry_time_limit"].total_seconds() == st.GCS_RETRY_LIMIT_S == 60
    with pytest.raises(ValueError) as e:
        open_storage("gs://bucket/runs?retry_limit_seconds=5")
    assert str(e.value) == (
        "--storage-path: gs://bucket/runs: options in a storage URI (retry_limit_seconds) are refused (the "
        "processes that reopen the root on other nodes would go without them); give gs://bucket/runs: GCS takes "
        "Google's application default credentials on every node, and raychat sets retry_limit_seconds=60 itself"
    )
