"""Checkpoints of a run: one name per step, a commit marker, one `newest` rule, pruning, and the resolver of
checkpoint references. Every stage saves through CheckpointManager (pretraining and SFT from their Ray Train
workers, RL from its driver) on any storage root (raychat.storage: a directory, NFS, s3://, gs://).

  <root>/<run>/checkpoint_<step:06d>/   the files of every rank (raychat.checkpoint's layout)
      commit.json                       {"format": 1, "step", "stage", "committed_at" (unix seconds),
                                         "files": {name: {"size": bytes, "sha256": hex digest}}}

Saving checkpoint `step` (ranks 0..W-1, and whoever commits: rank 0 of the Ray Train group, or RL's driver):
  1. prepare(step): whatever a crashed attempt left under that name is deleted, its commit marker first;
  2. every rank uploads its files: upload(local_dir, step) -> their names, sizes and sha256 digests;
  3. once every rank's upload has returned, commit(step, files, stage) writes commit.json last (one PUT on
     object storage; a unique temporary name, fsync and a rename on a filesystem), then prunes.
A checkpoint exists for readers only once commit.json is there: a crash anywhere before leaves a directory
that no reference resolves to, that the next save of that step replaces and that pruning removes once a
newer checkpoint is committed. `newest` is the committed checkpoint with the highest step: the one rule of
every stage, of resuming, of pruning (the newest `keep` stay) and of the speedrun. Loading
(raychat.checkpoint.load_model, resuming) checks each file's size against the marker and names a file that
differs; a download is also checked against the sha256 digests.

References (find_checkpoint names one; resolve_checkpoint also fetches a remote one to a local directory):
  <checkpoint dir>          a committed checkpoint directory
  <run dir>                 a directory of checkpoint_* dirs: its newest committed checkpoint
  <run dir>/latest          the same, spelled as a path (nothing named `latest` needs to exist)
  <run name> + storage      <storage>/<run name>, as a run dir (the run-name rule applies)
  latest + storage          the most recently committed of the runs' newest checkpoints under <storage>, of
                            the stages asked for (SFT takes a pretraining checkpoint, RL an SFT one)
What eval and export write from a checkpoint goes, with neither --storage-path nor --run-name, beside its
run: <root>/<run>/checkpoint_<step> -> <root>/<run>-eval-step<step>, <root>/<run>-hf-step<step> (output_place).
A bad reference is a ValueError of one line that names the flag and says what was found (uncommitted
directories marked as such). A remote checkpoint is downloaded into a cache directory whole or not at all,
and again only when its commit marker changes: a new commit under the same name goes to a directory of its
own, beside the earlier commit's copy, which its readers keep until it is a day unused (resolve_checkpoint;
a serving replica marks the copy it serves from in use every IN_USE_MARK_S, as a snapshot).
A server pins a run's local checkpoint as a snapshot in <run>/served/ (snapshot_checkpoint: hard links, whole
or not at all), which pruning never touches. A running app marks its snapshot in use every IN_USE_MARK_S
(mark_in_use: the directory's modification time); each snapshot_checkpoint deletes the run's other
snapshots unmarked for SNAPSHOT_UNUSED_S (remove_unused_snapshots).
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import re
import shutil
import time
import warnings
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass
from pathlib import Path

import pyarrow.fs as pafs

from raychat.atomic import (
    STAGING_IDLE_S,
    atomic_write_bytes,
    fresh_dir,
    is_leftover,
    last_change,
    remove_leftovers,
)
from raychat.config.schema import LATEST, check_reference
from raychat.storage import (
    Storage,
    children,
    delete_dir,
    download_dir,
    is_bare_name,
    is_remote,
    listing,
    open_storage,
    read_bytes,
    why,
    write_bytes,
)

COMMIT_FILE = "commit.json"
CHECKPOINT_PREFIX = "checkpoint_"
FORMAT = 1
DEFAULT_CACHE = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "raychat" / "checkpoints"
SNAPSHOTS = "served"  # <run dir>/served/<checkpoint name>-<12 hex>: snapshot_checkpoint
_SNAPSHOT = re.compile(rf"{CHECKPOINT_PREFIX}\d+-[0-9a-f]{{12}}")
# Every app serving a snapshot marks it in use (mark_in_use) this often (raychat.serve.in_use), as every server
# of a remote checkpoint marks its node's cached copy (CACHE_UNUSED_S), and snapshot_checkpoint deletes the
# run's snapshots unmarked for SNAPSHOT_UNUSED_S. A day is 288 missed marks, so only an app gone
# for a day (or a cluster down that long) loses its snapshot, while a pruned checkpoint's snapshot holds that
# checkpoint's space for at most a day after its last app ended (a deploy of a checkpoint that still exists
# makes its snapshot again).
IN_USE_MARK_S = 300.0
SNAPSHOT_UNUSED_S = 24 * 3600.0
# A cached copy of a remote checkpoint that no resolve_checkpoint has returned and no server has marked in use
# (raychat.serve.server: every IN_USE_MARK_S while it serves from it, as its engine process reloads it on a
# restart) for this long, while another commit of that checkpoint's URI is cached, is deleted
# (remove_unused_versions): any other reader that resolved it a day ago has long loaded it.
CACHE_UNUSED_S = 24 * 3600.0
# A cached copy renamed away to be deleted (_remove_if_unused), or a fetch's staging (download_dir), of any URI:
# `.<key>-[<12 hex>-]<name>.<16 hex>` (raychat.atomic.fresh_dir beside a copy's name).
_TOMBSTONE = re.compile(r"\.(?P<key>[0-9a-f]{16})(-[0-9a-f]{12})?-(?P<name>.+)\.[0-9a-f]{16}")


class CheckpointError(ValueError):
    """A checkpoint that is not committed, or whose files differ from its commit marker; the message names the
    checkpoint and the file."""


def checkpoint_name(step: int) -> str:
    """checkpoint_<step:06d>: names sort as steps do up to step 999,999."""
    return f"{CHECKPOINT_PREFIX}{step:06d}"


def sha256_file(path: str | os.PathLike) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def describe_files(directory: str | os.PathLike) -> dict[str, dict]:
    """{name relative to `directory`: {"size": bytes, "sha256": hex}} of every file under a local directory."""
    root = Path(directory)
    return {
        p.relative_to(root).as_posix(): {"size": p.stat().st_size, "sha256": sha256_file(p)}
        for p in sorted(root.rglob("*"))
        if p.is_file()
    }


def marker(step: int, stage: str, files: dict[str, dict]) -> bytes:
    """The bytes of commit.json for checkpoint `step` of `stage` holding `files` (describe_files' form)."""
    body = {"format": FORMAT, "step": step, "stage": stage, "committed_at": time.time(),
            "files": dict(sorted(files.items()))}  # fmt: skip
    return json.dumps(body, indent=1).encode()


def commit_directory(directory: str | os.PathLike, step: int, stage: str) -> None:
    """Commit a local checkpoint directory that one process wrote whole (tests, benchmarks, a single writer):
    its files as they are now, then commit.json."""
    d = Path(directory)
    storage = open_storage(d.parent)
    files = {k: v for k, v in describe_files(d).items() if k != COMMIT_FILE}
    write_bytes(storage, f"{storage.path}/{d.name}/{COMMIT_FILE}", marker(step, stage, files))


def read_commit(directory: str | os.PathLike) -> dict:
    """The commit marker of a local checkpoint directory.

    Raises CheckpointError: no such directory, or one without commit.json (a save that did not finish, or a checkpoint
    written before commit markers) or an unreadable one."""
    path = Path(directory) / COMMIT_FILE
    if not Path(directory).is_dir():
        raise CheckpointError(f"{directory} is not a raychat checkpoint (no such directory)")
    if not path.is_file():
        raise CheckpointError(
            f"checkpoint {directory} is not committed (no {COMMIT_FILE}): a save that did not finish, or a "
            "checkpoint written before commit markers"
        )
    try:
        data = path.read_bytes()
    except OSError as e:
        raise CheckpointError(f"checkpoint {directory}: {COMMIT_FILE} is unreadable ({e})") from e
    return parse_commit(data, str(directory))


def parse_commit(data: bytes, where: str) -> dict:
    """The commit marker `data` of checkpoint `where` as a dict, checked for the fields readers use: an
    integer "step" and "files" mapping each name (a relative path inside the checkpoint: describe_files' form)
    to {"size": int, "sha256": str}.

    Raises CheckpointError naming the checkpoint: not JSON (or not UTF-8), a field missing or of another type,
    or a file name that is not a path inside the checkpoint (absolute, with a backslash, or an empty, `.` or
    `..` part: the readers join each name onto the checkpoint's directory, and a snapshot or a fetch writes
    it). Markers are written whole, so only damage or a hand-made marker from outside does that."""
    try:
        commit = json.loads(data)
        int(commit["step"])
        for name, f in commit["files"].items():
            if not (isinstance(f, dict) and type(f.get("size")) is int and isinstance(f.get("sha256"), str)):
                raise TypeError(f'"files": {name!r} must map to {{"size": int, "sha256": str}}, not {f!r}')
    except (ValueError, TypeError, KeyError, AttributeError) as e:  # JSONDecodeError is a ValueError
        raise CheckpointError(f"checkpoint {where}: {COMMIT_FILE} is unreadable ({e!r})") from None
    for name in commit["files"]:
        if name.startswith("/") or "\\" in name or any(part in ("", ".", "..") for part in name.split("/")):
            raise CheckpointError(
                f"checkpoint {where}: {COMMIT_FILE} lists {name!r}, not a path inside the checkpoint (a file "
                "name may not be absolute, hold a backslash, or have an empty, '.' or '..' part)"
            )
    return commit


def verify(directory: str | os.PathLike, checksums: bool | Collection[str] = False) -> dict:
    """The commit marker of the local checkpoint `directory`, once every file it lists is there with its size
    (and its sha256: with checksums=True every file's, with a collection of names those files').

    Raises CheckpointError naming the file: not committed, a file missing, of another size or digest."""
    commit = read_commit(directory)
    paths = {name: Path(directory) / name for name in commit["files"]}
    _check_sizes(commit, directory, {n: p.stat().st_size for n, p in paths.items() if p.is_file()})
    for name, want in commit["files"].items():
        hashed = checksums if isinstance(checksums, bool) else name in checksums
        if hashed and sha256_file(paths[name]) != want["sha256"]:
            raise CheckpointError(
                f"checkpoint {directory}: {name} differs from its committed sha256 (corrupted)"
            )
    return commit


def verify_stored(storage: Storage, path: str) -> dict:
    """verify() without checksums of the committed checkpoint at `path` on storage.fs (a local directory or
    object storage), fetching nothing: one listing of its files' sizes.

    Raises CheckpointError naming the file: a file missing or of another size (FileNotFoundError: no marker)."""
    where = storage.uri_of(path)
    commit = parse_commit(read_bytes(storage, f"{path}/{COMMIT_FILE}"), where)
    infos = storage.fs.get_file_info([f"{path}/{name}" for name in commit["files"]])
    sizes = {name: i.size for name, i in zip(commit["files"], infos) if i.type == pafs.FileType.File}
    _check_sizes(commit, where, sizes)
    return commit


def _check_sizes(commit: dict, where, sizes: dict[str, int]) -> None:
    """CheckpointError naming the first file of the marker that `sizes` (name: bytes) lacks or sizes otherwise."""
    for name, want in commit["files"].items():
        if name not in sizes:
            raise CheckpointError(
                f"checkpoint {where}: {name} is missing (committed with {want['size']} bytes)"
            )
        if sizes[name] != want["size"]:
            raise CheckpointError(
                f"checkpoint {where}: {name} has {sizes[name]} bytes, committed with {want['size']} (truncated or "
                "replaced)"
            )


@dataclass(frozen=True)
class Committed:
    """A committed checkpoint: its step, its path on the storage's filesystem, its commit marker."""

    step: int
    path: str
    commit: dict


def committed_checkpoints(storage: Storage, run_path: str) -> list[Committed]:
    """The committed checkpoint_* directories under `run_path` on storage.fs, oldest step first. A marker that
    does not parse (parse_commit) commits nothing: its directory is skipped, with a warning naming it, like
    one without a marker."""
    found = []
    for path in children(storage, run_path):
        if not _is_checkpoint_name(path):
            continue
        try:
            commit = parse_commit(read_bytes(storage, f"{path}/{COMMIT_FILE}"), storage.uri_of(path))
        except FileNotFoundError:
            continue
        except CheckpointError as e:
            warnings.warn(f"{e}: not a committed checkpoint", stacklevel=2)
            continue
        found.append(Committed(int(commit["step"]), path, commit))
    return sorted(found, key=lambda c: (c.step, c.path))


CHECKPOINT_DIR = re.compile(rf"{CHECKPOINT_PREFIX}(\d+)")  # a run's checkpoint dir: checkpoint_<step:06d>
RUN_NAME_UNSAFE = re.compile(r"[^A-Za-z0-9._-]")  # what a derived run name may not hold (RUN_NAME_RULE)


def output_place(
    checkpoint: str, storage_path: str | None, run_name: str | None, kind: str
) -> tuple[Storage, str, str]:
    """(the storage root, the run name, the --storage-path flag as errors name it) of what a command of `kind`
    ("eval": raychat eval's results, "hf": raychat export's directory) writes from `checkpoint` (a resolved
    checkpoint dir: absolute path or URI). Given, --storage-path and --run-name decide; not given, the
    checkpoint's run decides: <root>/<run>/checkpoint_<step> writes <root>/<run>-<kind>-step<step> (beside its
    run, so two checkpoints' outputs are both kept), a checkpoint dir of another name, <parent>/<name>, writes
    <parent>/<name>-<kind>. Touches nothing.

    Raises ValueError naming --storage-path: not given, and the checkpoint lies at the top of its bucket (no
    directory beside it to write to)."""
    parts = checkpoint.rstrip("/").split("/")
    step = CHECKPOINT_DIR.fullmatch(parts[-1])
    beside, name = parts[:-1], f"{parts[-1]}-{kind}"
    if step:  # <run>/checkpoint_<step>: beside the run
        beside, name = parts[:-2], f"{parts[-2]}-{kind}-step{int(step[1])}"
    if storage_path:
        storage, flag = open_storage(storage_path), "--storage-path"
    else:
        if "://" in checkpoint and len(beside) < 3:  # "s3:", "", the bucket
            raise ValueError(
                f"--storage-path: not given, and {checkpoint} lies at the top of its bucket, with no directory "
                "beside its run for the output: give --storage-path"
            )
        storage = open_storage("/".join(beside) or "/")
        flag = "--storage-path (not given: beside the checkpoint's run)"
    return storage, run_name or RUN_NAME_UNSAFE.sub("_", name).lstrip("."), flag


def check_output_target(
    storage: Storage,
    target: str,
    flag: str,
    output: str,
    earlier: str,
    is_earlier: Callable[[list, bool], bool],
) -> str:
    """`target` on storage.fs, where a stage writes `output` (e.g. "an export"), replacing what is there:
    nothing, an empty directory, or a directory whose entries (pafs.FileInfo) is_earlier(entries, killed)
    accepts as `earlier` (e.g. "an earlier export"). The leftovers of killed writes (raychat.atomic.is_leftover)
    are left out of the entries and of the judgement; killed says whether there were any (the stage removes
    them once it writes there: raychat.atomic.remove_leftovers). Touches nothing. A checkpoint or a training
    run's checkpoints are never replaced.

    Raises ValueError naming `flag`: a checkpoint (it holds COMMIT_FILE), a directory of committed checkpoints,
    a file, a directory is_earlier does not accept (its listing in the message), or storage that cannot be read
    (storage.why: the S3 endpoint does not answer, access denied, ...)."""
    uri = storage.uri_of(target)
    try:
        return _check_output_target(storage, target, flag, output, earlier, is_earlier)
    except OSError as e:
        raise ValueError(f"{flag}: cannot read {uri}: {why(e, storage)}") from e


def _check_output_target(storage, target, flag, output, earlier, is_earlier) -> str:
    uri, kind = storage.uri_of(target), storage.fs.get_file_info(target).type
    if kind == pafs.FileType.NotFound:
        return target
    if kind == pafs.FileType.Directory:
        listed = storage.fs.get_file_info(pafs.FileSelector(target))
        entries = [e for e in listed if not is_leftover(e.base_name)]
        held = None
        if any(e.base_name == COMMIT_FILE for e in entries):
            held = "is a checkpoint"
        elif committed_checkpoints(storage, target):
            held = "holds a training run's checkpoints"
        if held:
            raise ValueError(
                f"{flag}: {uri} {held}, which {output} there would replace; choose another {flag}"
            )
        if not entries or is_earlier(entries, len(entries) < len(listed)):
            return target
    held = listing(storage, target) if kind == pafs.FileType.Directory else f"{uri} is a file"
    raise ValueError(
        f"{flag}: {output} would replace {uri}, which is not {earlier} ({held}); choose another {flag}"
    )


class CheckpointManager:
    """The checkpoints of run `run_name` under a storage root (see the module doc).

    Args:
        storage: the root; run_name: the run (the run-name rule, else ConfigError naming `flag`).
        keep: how many committed checkpoints pruning keeps, newest by step (0 = all).
    """

    def __init__(self, storage: Storage, run_name: str, keep: int = 0, flag: str = "--run-name"):
        self.storage, self.keep = storage, keep
        self.run_path = storage.run_path(run_name, flag)

    def path(self, step: int) -> str:
        """Checkpoint `step`'s directory on storage.fs."""
        return f"{self.run_path}/{checkpoint_name(step)}"

    def uri(self, step: int) -> str:
        return self.storage.uri_of(self.path(step))

    def committed(self) -> list[Committed]:
        return committed_checkpoints(self.storage, self.run_path)

    def newest(self) -> Committed | None:
        """The committed checkpoint with the highest step, or None."""
        done = self.committed()
        return done[-1] if done else None

    def prepare(self, step: int) -> None:
        """Delete what an earlier attempt left at checkpoint `step` (see _delete)."""
        self._delete(self.path(step))

    def _delete(self, path: str) -> None:
        """Delete the checkpoint dir at `path` (on storage.fs), its commit marker first: a delete that
        stops halfway leaves a directory no reader takes for whole."""
        marker_path = self.storage.inside(f"{path}/{COMMIT_FILE}")
        if self.storage.fs.get_file_info(marker_path).type == pafs.FileType.File:
            self.storage.fs.delete_file(marker_path)
        delete_dir(self.storage, path)

    def upload(self, directory: str | os.PathLike, step: int) -> dict[str, dict]:
        """Copy the files of the local `directory` (one rank's part) into checkpoint `step`; returns their
        describe_files() entries for commit(). A filesystem copy is fsynced before this returns."""
        files = describe_files(directory)
        dest = self.storage.inside(self.path(step))
        if self.storage.is_local:
            for name in files:
                target = Path(dest) / name
                target.parent.mkdir(parents=True, exist_ok=True)
                shutil.copyfile(Path(directory) / name, target)
                with open(target, "rb+") as f:
                    os.fsync(f.fileno())
        else:
            pafs.copy_files(
                str(directory),
                dest,
                source_filesystem=pafs.LocalFileSystem(),
                destination_filesystem=self.storage.fs,
            )
        return files

    def commit(self, step: int, parts: Sequence[dict[str, dict]], stage: str) -> str:
        """Write checkpoint `step`'s commit marker over every rank's upload() result in `parts` (call once all
        of them have returned) and prune; returns the checkpoint's URI.

        Raises ValueError: two parts hold a file of the same name (two ranks wrote over each other)."""
        files: dict[str, dict] = {}
        for part in parts:
            if clash := files.keys() & part.keys():
                raise ValueError(f"checkpoint {self.uri(step)}: {sorted(clash)} uploaded by two ranks")
            files.update(part)
        write_bytes(self.storage, f"{self.path(step)}/{COMMIT_FILE}", marker(step, stage, files))
        self.prune()
        return self.uri(step)

    def prune(self) -> list[str]:
        """Delete committed checkpoints beyond the newest `keep` and the uncommitted checkpoint_<step> dirs older
        than the newest committed one (directories of other names are never touched; each commit marker goes
        first, see _delete); returns their paths."""
        done = self.committed()
        if not done:
            return []
        dropped = [c.path for c in done[: -self.keep]] if self.keep else []
        kept = {c.path for c in done}
        for path in children(self.storage, self.run_path):
            m = re.fullmatch(rf"{CHECKPOINT_PREFIX}(\d+)", path.rsplit("/", 1)[-1])
            if m and path not in kept and int(m[1]) < done[-1].step:
                dropped.append(path)
        for path in dropped:
            self._delete(path)
        return dropped


# ---- references ---------------------------------------------------------------------------------------
def find_checkpoint(
    ref: str | os.PathLike,
    storage: Storage | str | None = None,
    flag: str = "--checkpoint",
    stages: tuple[str, ...] | None = None,
) -> str:
    """The committed checkpoint that `ref` names (see the module doc), fetched nowhere: an absolute local path,
    or the s3:// / gs:// URI of the checkpoint dir.

    ref: a checkpoint dir, a run dir, <run dir>/latest (local paths or URIs), a run name (no '/') looked up
    under `storage` (a bare name that exists as a local path is that path), or `latest` with `storage`.
    stages: what `latest` may pick (the commit marker's "stage"; None = any).

    Raises ValueError (one line, naming `flag`): ref names nothing, breaks the run-name rule, is a run without
    a committed checkpoint (listing what the run holds) or an uncommitted checkpoint dir (CheckpointError); a
    Hugging Face export (raychat export's directory); a missing bucket; `latest` without a storage root or with
    no checkpoint of `stages` under it."""
    text = str(ref).strip()
    if not text:
        raise ValueError(f"{flag}: empty; give a checkpoint dir, a run dir, <run dir>/latest or a run name")
    check_reference(text, flag)
    if isinstance(storage, str | os.PathLike):
        storage = open_storage(storage)
    bare_name = is_bare_name(text)
    if bare_name and text == LATEST:
        if storage is None:
            raise ValueError(
                f"{flag}: a bare 'latest' searches a storage root's runs, and this command has none; give "
                "<run dir>/latest, a run dir or a checkpoint dir"
            )
        return storage.uri_of(_latest_of_runs(storage, stages, flag))
    if bare_name and storage is not None:
        where, target = storage, storage.run_path(text, flag)
    else:
        where = open_storage(text, flag)
        target = where.path
    try:
        return where.uri_of(_find(where, target, flag))
    except OSError as e:
        raise ValueError(f"{flag}: cannot read {where.uri_of(target)}: {why(e, where)}") from e


def resolve_checkpoint(
    ref: str | os.PathLike,
    storage: Storage | str | None = None,
    flag: str = "--checkpoint",
    cache_dir: str | os.PathLike | None = None,
    stages: tuple[str, ...] | None = None,
) -> Path:
    """A local directory holding the checkpoint find_checkpoint(ref, storage, flag, stages) names: the
    directory itself when local; a remote one downloaded to
    <cache_dir>/<key>-<sha256(commit.json)[:12]>-<name> (key: sha256(uri)[:16]; default cache:
    $XDG_CACHE_HOME or ~/.cache, then raychat/checkpoints), checked against its commit marker's sizes and
    sha256 digests before it takes that name. A checkpoint committed again under the same URI (a run that
    re-saved a step after a restart) is another commit marker, so it goes to a directory of its own: the copy
    of the earlier commit stays as it was for the readers that have it (a serving replica, an eval), until a
    later resolve of that URI finds it returned by no resolve and marked by no server for CACHE_UNUSED_S
    (remove_unused_versions: renamed to a tombstone, which no resolve returns, and looked at again before it
    is deleted). The processes of a node (the Train workers of a restarted group) fetch one checkpoint once:
    each holds an exclusive flock on <cache_dir>/.<key>-<name>.lock while it checks the cache, downloads and
    removes unused versions, so the others wait and then find the copy; a copy that a reader may hold open is
    never replaced while it matches the marker. Each return marks the copy in use (mark_in_use: its
    directory's modification time), and a server that serves from it marks it every IN_USE_MARK_S while it
    runs (raychat.serve.server.ChatServer.from_checkpoint).

    Raises ValueError as find_checkpoint; CheckpointError: a downloaded file differs from the marker; OSError:
    the download failed (nothing is left under the final name)."""
    uri = find_checkpoint(ref, storage, flag, stages)
    if not is_remote(uri):
        return Path(uri)
    where = open_storage(uri, flag)
    commit = read_bytes(where, f"{where.path}/{COMMIT_FILE}")
    cache = Path(cache_dir) if cache_dir else DEFAULT_CACHE
    key, name = hashlib.sha256(uri.encode()).hexdigest()[:16], where.path.rsplit("/", 1)[-1]
    dest = cache / f"{key}-{hashlib.sha256(commit).hexdigest()[:12]}-{name}"

    def check(d: Path) -> None:
        if (d / COMMIT_FILE).read_bytes() != commit:
            raise CheckpointError(f"{d} holds another commit of {uri}")
        verify(d, checksums=True)

    cache.mkdir(parents=True, exist_ok=True)
    with open(_uri_lock(cache, key, name), "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes, or when its process dies
        got = None
        if (dest / COMMIT_FILE).is_file() and (dest / COMMIT_FILE).read_bytes() == commit:
            try:
                verify(dest)
                got = dest
            except CheckpointError:  # a damaged cached copy: fetched again
                pass
        got = got or download_dir(where, where.path, dest, check=check)
        mark_in_use(got)
        remove_unused_versions(cache, key, name, keep=got.name)
        return got


def _uri_lock(cache: Path, key: str, name: str) -> Path:
    """The file whose flock a process holds while it resolves the URI of key `key` and checkpoint name `name`."""
    return cache / f".{key}-{name}.lock"


def remove_unused_versions(
    cache: Path, key: str, name: str, keep: str, unused_s: float | None = None
) -> list[str]:
    """Delete the copies in the checkpoint cache `cache` of the checkpoint whose URI's key is `key` and whose
    name is `name` (<key>-<12 hex>-<name>, and <key>-<name> of raychat versions that kept one copy per URI),
    other than `keep`, in which nothing has changed for `unused_s` seconds (default CACHE_UNUSED_S;
    raychat.atomic.last_change: resolve_checkpoint marks the one it returns, and a live server the one it
    serves from, with mark_in_use). Each is first renamed to a tombstone, a leftover name beside it
    (raychat.atomic.fresh_dir: `.<copy name>.<16 hex>`, a name resolve_checkpoint never returns), and looked
    at again: one marked between the first look and the rename is renamed back and kept (_remove_if_unused).
    The tombstones of a remover (or the staging of a fetch) killed before its delete are deleted too, once idle
    for raychat.atomic.STAGING_IDLE_S: those of every URI in the cache, not only this one's, so one left by a
    URI never resolved again does not stay forever (_remove_idle_tombstones). The caller holds the URI's flock.
    Returns the names deleted, sorted (copies only, not tombstones)."""
    unused_s = CACHE_UNUSED_S if unused_s is None else unused_s
    version = rf"{re.escape(key)}(-[0-9a-f]{{12}})?-{re.escape(name)}"
    removed = []
    for path in sorted(cache.iterdir()):
        if path.name != keep and re.fullmatch(version, path.name) and _remove_if_unused(path, unused_s):
            removed.append(path.name)
    _remove_idle_tombstones(cache, key, name)
    return removed


def _remove_idle_tombstones(cache: Path, key: str, name: str) -> None:
    """Delete the tombstones and fetch stagings in the checkpoint cache `cache` (directories, not links, named
    `.<key>-[<12 hex>-]<name>.<16 hex>`) in which nothing has changed for raychat.atomic.STAGING_IDLE_S, of
    any URI. Those of the URI whose key is `key` and whose name is `name` are deleted under its flock, which
    the caller holds; another URI's only while this process holds that URI's flock too
    (<cache>/.<key>-<name>.lock, taken without waiting): one that another process holds (it is resolving that
    URI, maybe fetching into that staging right now) is passed over, and that process deletes it."""
    for path in sorted(cache.iterdir()):
        found = _TOMBSTONE.fullmatch(path.name)
        if not found or not _idle_dir(path):
            continue
        if (found["key"], found["name"]) == (key, name):
            shutil.rmtree(path, ignore_errors=True)
            continue
        with open(_uri_lock(cache, found["key"], found["name"]), "a") as lock:
            try:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:  # that URI is being resolved now
                continue
            if _idle_dir(path):  # looked at again under its lock
                shutil.rmtree(path, ignore_errors=True)


def _idle_dir(path: Path) -> bool:
    """Whether `path` is a directory (not a link) in which nothing has changed for STAGING_IDLE_S."""
    try:
        return path.is_dir() and not path.is_symlink() and time.time() - last_change(path) >= STAGING_IDLE_S
    except FileNotFoundError:
        return False


def _remove_if_unused(path: Path, unused_s: float) -> bool:
    """Delete the directory `path` (not a link) if nothing in it has changed for `unused_s` seconds
    (raychat.atomic.last_change), looked at twice: it is renamed to a tombstone (raychat.atomic.fresh_dir)
    and looked at again, and one marked in use between the two looks (mark_in_use) is renamed back. A mark
    while it is renamed finds it gone (FileNotFoundError). Returns whether it was deleted: False also when it
    is gone, cannot be renamed (not ours), or its tombstone was deleted meanwhile by another process."""
    try:
        if path.is_symlink() or not path.is_dir() or time.time() - last_change(path) < unused_s:
            return False
        tomb = fresh_dir(path)
    except OSError:
        return False
    try:
        os.replace(path, tomb)
    except OSError:  # gone meanwhile, or not ours to rename
        tomb.rmdir()
        return False
    try:
        recent = time.time() - last_change(tomb) < unused_s  # marked between the look and the rename
    except FileNotFoundError:  # deleted meanwhile as a leftover by another process
        return False
    if recent:
        try:
            os.replace(tomb, path)
            return False
        except OSError:  # made again meanwhile: the one renamed away goes
            pass
    shutil.rmtree(tomb, ignore_errors=True)
    return not recent


def described(checkpoint: str) -> str:
    """`checkpoint` (what find_checkpoint returned) with the stage and step of its commit marker, e.g.
    "runs/pretrain/checkpoint_000004 (pretrain checkpoint, step 4)": one small read, also of a remote one.

    Raises CheckpointError: an unreadable commit marker; OSError: it cannot be read."""
    commit = commit_of(checkpoint)
    return f"{checkpoint} ({commit.get('stage') or 'unknown'} checkpoint, step {commit['step']})"


def commit_of(checkpoint: str) -> dict:
    """The commit marker of `checkpoint` (a local checkpoint directory or an s3:// / gs:// URI): one small read.

    Raises CheckpointError: an unreadable marker; OSError: it cannot be read."""
    where = open_storage(checkpoint)
    return parse_commit(read_bytes(where, f"{where.path}/{COMMIT_FILE}"), checkpoint)


def committed_bytes(commit: dict) -> int:
    """Bytes of the files a commit marker (parse_commit's dict) lists."""
    return sum(f["size"] for f in commit["files"].values())


def is_run_checkpoint(checkpoint: str) -> bool:
    """Whether `checkpoint` (what find_checkpoint returned) is a local checkpoint_<step> directory: a run's,
    which that run's pruning deletes once newer ones are committed."""
    return (
        not is_remote(checkpoint)
        and re.fullmatch(rf"{CHECKPOINT_PREFIX}\d+", Path(checkpoint).name) is not None
    )


def snapshot_checkpoint(checkpoint: str | os.PathLike) -> Path:
    """A snapshot of the local committed checkpoint `checkpoint` that its run's pruning never deletes:
    <run dir>/served/<checkpoint name>-<sha256(commit.json)[:12]>, beside the checkpoint (so on the same
    storage, which every node that reads the checkpoint reads too). Its files are hard links to the
    checkpoint's (a copy where the filesystem refuses a link), put together under a temporary name
    (raychat.atomic.fresh_dir), checked against the commit marker (verify: every file, its size), and then
    given the final name, commit.json last; a snapshot of the same commit marker already there is reused
    (marked in use first: mark_in_use), also one that another server made while this one put its own
    together (its replicas may be opening its files: it is never renamed away while it passes verify). The
    leftovers of killed processes in served/ (a snapshot's staging, a stale snapshot renamed away to be
    deleted) are deleted first, those idle for raychat.atomic.STAGING_IDLE_S only: another server may be
    putting a snapshot together right now. The run's other snapshots that no app has marked in use for
    SNAPSHOT_UNUSED_S are deleted last (remove_unused_snapshots).

    Raises CheckpointError: `checkpoint` is not committed, or a file differs from its marker; ValueError: a
    symbolic link leads the snapshot out of the run dir (Storage.inside); OSError: the run dir is not
    writable (nothing is left under the final name)."""
    src = Path(checkpoint)
    verify(src)
    commit = (src / COMMIT_FILE).read_bytes()
    run = open_storage(src.parent)
    name = f"{src.name}-{hashlib.sha256(commit).hexdigest()[:12]}"
    dest = Path(run.inside(f"{run.path}/{SNAPSHOTS}/{name}"))
    # of any snapshot killed while being made, or while remove_unused_snapshots deleted it
    remove_leftovers(dest.parent, idle_s=STAGING_IDLE_S)
    if (dest / COMMIT_FILE).is_file() and (dest / COMMIT_FILE).read_bytes() == commit:
        try:
            _mark_reused(dest)  # first: remove_unused_snapshots of another server then keeps it
            verify(dest)
            remove_unused_snapshots(dest.parent.parent, keep=dest.name)
            return dest
        except (
            CheckpointError,
            FileNotFoundError,
        ):  # a damaged snapshot, or one deleted just now: made again
            pass
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = fresh_dir(dest)
    try:
        for file in parse_commit(commit, str(src))["files"]:
            (tmp / file).parent.mkdir(parents=True, exist_ok=True)
            try:
                os.link(src / file, tmp / file)
            except FileNotFoundError:
                raise CheckpointError(
                    f"checkpoint {src}: {file} was deleted while it was snapshotted (pruned meanwhile?)"
                ) from None
            except OSError:  # another filesystem, or one without hard links
                shutil.copyfile(src / file, tmp / file)
                with open(tmp / file, "rb+") as f:
                    os.fsync(f.fileno())
        atomic_write_bytes(tmp / COMMIT_FILE, commit)
        verify(tmp)
        if not _holds(
            dest, commit
        ):  # else another server made it meanwhile, whose replicas may be loading it
            if dest.exists():
                old = fresh_dir(dest)
                os.replace(dest, old)
                shutil.rmtree(old, ignore_errors=True)
            os.replace(tmp, dest)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    remove_unused_snapshots(dest.parent.parent, keep=dest.name)
    return dest


def _holds(snapshot: Path, commit: bytes) -> bool:
    """Whether the snapshot directory `snapshot` holds commit marker `commit` and every file it lists, of its
    size (verify)."""
    try:
        return (snapshot / COMMIT_FILE).read_bytes() == commit and bool(verify(snapshot))
    except (CheckpointError, OSError):
        return False


def _mark_reused(snapshot: Path) -> None:
    """mark_in_use, where a snapshot this process may not mark (another user's, a read-only
    filesystem) is reused unmarked, with a warning. Raises FileNotFoundError: the snapshot is gone."""
    try:
        mark_in_use(snapshot)
    except FileNotFoundError:
        raise
    except OSError as e:
        warnings.warn(
            f"snapshot {snapshot}: cannot mark it in use ({e}); the run's next snapshot deletes it once "
            f"unmarked for {SNAPSHOT_UNUSED_S / 3600:g} h",
            stacklevel=3,
        )


def is_snapshot(checkpoint: str) -> bool:
    """Whether `checkpoint` (what find_checkpoint returned) is a snapshot snapshot_checkpoint made: a local
    <run dir>/served/checkpoint_<step>-<12 hex> directory, which remove_unused_snapshots deletes once no app
    has marked it in use for SNAPSHOT_UNUSED_S."""
    path = Path(checkpoint)
    return (
        not is_remote(checkpoint) and path.parent.name == SNAPSHOTS and bool(_SNAPSHOT.fullmatch(path.name))
    )


def mark_in_use(directory: str | os.PathLike) -> None:
    """Mark `directory` (a snapshot, or a cached copy of a remote checkpoint: resolve_checkpoint) in use now:
    its modification time (one utime call; its files are untouched), which remove_unused_snapshots and
    remove_unused_versions read. Raises OSError as os.utime (FileNotFoundError: it is gone; PermissionError:
    not ours)."""
    os.utime(directory)


def remove_unused_snapshots(
    run_dir: str | os.PathLike, keep: str, unused_s: float = SNAPSHOT_UNUSED_S
) -> list[str]:
    """Delete the snapshots in the local <run_dir>/served/ (directories named checkpoint_<step>-<12 hex>, not
    links) other than `keep` in which nothing has changed for `unused_s` seconds (raychat.atomic.last_change:
    mark_in_use changes the directory's time). Each is first renamed to a leftover name
    (raychat.atomic.fresh_dir) and looked at again: one marked at that moment is renamed back, and a server
    that marks it while it is renamed finds it gone and makes it again (snapshot_checkpoint); one that another
    server's snapshot_checkpoint deletes as a leftover meanwhile is passed over. Nothing else in
    served/, and nothing outside it, is touched; a snapshot that cannot be renamed (no permission) stays.
    Returns the names deleted, sorted."""
    served = Path(run_dir) / SNAPSHOTS
    try:
        names = sorted(n for n in os.listdir(served) if n != keep and _SNAPSHOT.fullmatch(n))
    except OSError:  # no served/ (or not ours to read)
        return []
    return [name for name in names if _remove_if_unused(served / name, unused_s)]


def checkpoint_gone(checkpoint: str) -> bool:
    """Whether the checkpoint `checkpoint` (what find_checkpoint returned: a local path, or an s3:// / gs://
    URI) has no commit marker any more (pruned or deleted since). False while the marker is there and when
    the storage cannot be read (nothing is known)."""
    try:
        where = open_storage(checkpoint)
        return where.fs.get_file_info(f"{where.path}/{COMMIT_FILE}").type == pafs.FileType.NotFound
    except (OSError, ValueError):
        return False


def _find(storage: Storage, target: str, flag: str) -> str:
    fs = storage.fs
    info = fs.get_file_info(target)
    if info.type == pafs.FileType.NotFound and target.rsplit("/", 1)[-1] == LATEST:
        target = target.rsplit("/", 1)[0]
        info = fs.get_file_info(target)
    shown = storage.uri_of(target)
    if info.type == pafs.FileType.NotFound:
        parent = target.rsplit("/", 1)[0] or "/"
        raise ValueError(f"{flag}: {shown} does not exist ({_listing(storage, parent)})")
    if info.type != pafs.FileType.Directory:
        raise ValueError(f"{flag}: {shown} is a file; give a checkpoint dir, a run dir or <run dir>/latest")
    if fs.get_file_info(f"{target}/{COMMIT_FILE}").type == pafs.FileType.File:
        try:
            parse_commit(read_bytes(storage, f"{target}/{COMMIT_FILE}"), shown)
        except CheckpointError as e:
            raise CheckpointError(f"{flag}: {e}") from None
        return target
    done = committed_checkpoints(storage, target)
    if done:
        return done[-1].path
    has = {
        name for name in ("meta.json", "model.safetensors", "config.json")
        if fs.get_file_info(f"{target}/{name}").type == pafs.FileType.File
    }  # fmt: skip
    if has == {"model.safetensors", "config.json"}:
        raise ValueError(
            f"{flag}: {shown} is a Hugging Face export (config.json, model.safetensors: raychat export), not a "
            "raychat checkpoint: give the checkpoint it was exported from, or load it with transformers"
        )
    looks_like_one = _is_checkpoint_name(target) or bool(has - {"config.json"})
    if looks_like_one:
        raise CheckpointError(
            f"{flag}: checkpoint {shown} is not committed (no {COMMIT_FILE}): a save that did not finish, or a "
            "checkpoint written before commit markers"
        )
    runs = [storage.uri_of(run) for run in children(storage, target) if committed_checkpoints(storage, run)]
    hint = f"; run dirs in it that have some: {', '.join(runs)}" if runs else ""
    if not runs:  # a speedrun's --out: its runs are checkpoints/base, checkpoints/sft, rl/rl
        below = [run for sub in children(storage, target) for run in children(storage, sub)]
        runs = [storage.uri_of(run) for run in below if committed_checkpoints(storage, run)]
        hint = f"; run dirs below it that have some: {', '.join(runs)}" if runs else ""
    raise ValueError(f"{flag}: {shown} has no committed checkpoint ({_listing(storage, target)}){hint}")


def _latest_of_runs(storage: Storage, stages: tuple[str, ...] | None, flag: str) -> str:
    """The most recently committed of the runs' newest checkpoints under the root, of `stages`."""
    found = []
    try:
        for run in children(storage, storage.path):
            done = committed_checkpoints(storage, run)
            if done and (stages is None or done[-1].commit.get("stage") in stages):
                found.append((done[-1].commit.get("committed_at", 0), done[-1].path))
    except OSError as e:
        raise ValueError(f"{flag}: cannot read {storage.uri}: {why(e, storage)}") from e
    if not found:
        what = f"committed {'/'.join(stages)}" if stages else "committed"
        raise ValueError(
            f"{flag}: latest: no {what} checkpoint under {storage.uri} ({_listing(storage, storage.path)})"
        )
    return max(found)[1]


def _is_checkpoint_name(path: str) -> bool:
    """Whether the last part of `path` is a run's checkpoint directory name, checkpoint_<digits> (CHECKPOINT_DIR):
    a committed copy named otherwise (checkpoint_best, checkpoint_000007.bak) is not one of the run's
    checkpoints, so neither `latest` nor resuming picks it, and pruning never deletes it."""
    return CHECKPOINT_DIR.fullmatch(path.rsplit("/", 1)[-1]) is not None


def _listing(storage: Storage, path: str) -> str:
    def mark(child: str) -> str:
        uncommitted = storage.fs.get_file_info(f"{child}/{COMMIT_FILE}").type != pafs.FileType.File
        return " (uncommitted)" if _is_checkpoint_name(child) and uncommitted else ""

    return listing(storage, path, mark)
