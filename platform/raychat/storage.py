"""One storage root for every stage, and one resolver from a checkpoint reference to a local checkpoint dir.

A storage root is a local or NFS directory, or an `s3://bucket/prefix` or `gs://bucket/prefix` URI. A run
lives at <root>/<run>/ and its checkpoints at <root>/<run>/checkpoint_*/ (Ray Train names them
checkpoint_<timestamp>, RL checkpoint_<step:06d>). A checkpoint is complete when it holds every file of
COMPLETE_FILES; the newest complete one of a run is the one with the highest meta.json "step" (then the
highest name).

Filesystems are pyarrow.fs, the ones Ray Train uses (`Storage.ray_train_storage()` gives its RunConfig
arguments). S3 takes the standard AWS variables: AWS_ENDPOINT_URL or AWS_ENDPOINT_URL_S3 (an S3-compatible
server: the scheme of that URL, http or https, is the one used), AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY
(or any other source of the AWS default chain) and AWS_REGION / AWS_DEFAULT_REGION (else the bucket's region
is looked up). GCS takes Google's application default credentials; a GCS URI without `retry_limit_seconds`
gets 60 s, so a missing credential fails within a minute instead of retrying for 15.

Checkpoint references (`find_checkpoint` names one, `resolve_checkpoint` also fetches it), local or remote:
  <checkpoint dir>          a directory holding the checkpoint files
  <run dir>                 a directory of checkpoint_* dirs: its newest complete checkpoint
  <run dir>/latest          the same, spelled as a path (nothing named `latest` needs to exist)
  <run name> + storage      <storage>/<run name>, as a run dir
  latest + storage          the most recently written (meta.json's modification time) of the newest complete
                            checkpoints of the runs under <storage>, of the stages asked for (meta "stage":
                            SFT takes a pretraining checkpoint, RL an SFT one)
A remote checkpoint is downloaded into a cache dir under a temporary name and renamed when complete, so a
half download is never used, and it is downloaded again only when its files (names, sizes) change.
A bad reference or storage root is a ValueError of one line that names the flag and says what was found;
an I/O error in the middle of a download propagates (OSError) and leaves no partial copy behind.

Data directories (parquet shards, the tokenizer) are named like runs (`run_directory`: a path, or a run
name under the storage root) and must be on a filesystem every node mounts (local or NFS): the training
workers read them as files. Small results (`write_bytes`) and exported directories (`upload_dir`) go to any
storage root.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
import uuid
from dataclasses import dataclass
from pathlib import Path

import pyarrow.fs as pafs

COMPLETE_FILES = ("model.safetensors", "meta.json")
CHECKPOINT_PREFIX = "checkpoint_"
LATEST = "latest"
REMOTE_SCHEMES = ("s3", "gs")
GCS_RETRY_LIMIT_S = 60
DEFAULT_CACHE = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "raychat" / "checkpoints"


@dataclass(frozen=True)
class Storage:
    """A storage root. uri: absolute local path, or scheme://bucket/prefix (no trailing slash); fs: its
    pyarrow filesystem; path: the root on fs (a local path, or bucket/prefix)."""

    uri: str
    fs: pafs.FileSystem
    path: str

    @property
    def is_local(self) -> bool:
        return isinstance(self.fs, pafs.LocalFileSystem)

    def uri_of(self, fs_path: str) -> str:
        """The URI (local path for local storage) of a path on self.fs."""
        return fs_path if self.is_local else f"{self.uri.split('://')[0]}://{fs_path}"

    def run_path(self, run: str) -> str:
        """<root>/<run> on self.fs."""
        return f"{self.path}/{run}"

    def ray_train_storage(self) -> dict:
        """RunConfig(**this): storage_path and, for a remote root, the storage_filesystem it lives on (Ray
        Train then takes storage_path as a path on that filesystem: bucket/prefix, without the scheme)."""
        if self.is_local:
            return {"storage_path": self.path}
        return {"storage_path": self.path, "storage_filesystem": self.fs}


def open_storage(uri: str | os.PathLike, flag: str = "--storage-path") -> Storage:
    """The Storage for a local path, file://, s3:// or gs:// URI. Touches nothing (see check_writable).

    Raises ValueError naming `flag` for an empty value or an unsupported scheme."""
    text = str(uri).strip()
    if not text:
        raise ValueError(f"{flag}: empty; give a directory, s3://bucket/prefix or gs://bucket/prefix")
    scheme = text.split("://", 1)[0].lower() if "://" in text else ""
    if scheme in ("", "file"):
        local = os.path.abspath(os.path.expanduser(text[len("file://") :] if scheme else text))
        return Storage(local.rstrip("/") or "/", pafs.LocalFileSystem(), local.rstrip("/") or "/")
    if scheme not in REMOTE_SCHEMES:
        raise ValueError(
            f"{flag}: scheme {scheme}:// of {text!r} is not supported; use a directory, s3:// or gs://"
        )
    if scheme == "gs" and "retry_limit_seconds=" not in text:
        text += ("&" if "?" in text else "?") + f"retry_limit_seconds={GCS_RETRY_LIMIT_S}"
    try:
        fs, path = pafs.FileSystem.from_uri(text)
    except (OSError, ValueError) as e:  # pyarrow.lib.ArrowInvalid is a ValueError
        raise ValueError(f"{flag}: cannot open {text!r}: {_first_line(e)}") from e
    path = path.rstrip("/")
    if not path:
        raise ValueError(f"{flag}: {text!r} names no bucket")
    return Storage(f"{scheme}://{path}", fs, path)


def check_writable(storage: Storage, flag: str = "--storage-path") -> None:
    """Create the root if needed and write, then delete, a probe file in it. Nothing else is touched.

    Raises ValueError naming `flag`: the bucket does not exist, access is denied, or the directory cannot
    be created or written."""
    probe = f"{storage.path}/.raychat-write-probe-{uuid.uuid4().hex}"
    try:
        storage.fs.create_dir(storage.path, recursive=True)
        with storage.fs.open_output_stream(probe) as f:
            f.write(b"ok")
        storage.fs.delete_file(probe)
    except OSError as e:
        raise ValueError(f"{flag}: {storage.uri} is not writable: {_why(e, storage)}") from e


def is_remote(uri: str | os.PathLike) -> bool:
    """True for an s3:// or gs:// URI (what has to be fetched before a local file API can read it)."""
    return str(uri).split("://", 1)[0].lower() in REMOTE_SCHEMES if "://" in str(uri) else False


def find_checkpoint(
    ref: str | os.PathLike,
    storage: Storage | str | None = None,
    flag: str = "--checkpoint",
    stages: tuple[str, ...] | None = None,
) -> str:
    """The newest complete checkpoint that `ref` names (see the module doc), fetched nowhere: an absolute local
    path, or the s3:// / gs:// URI of the checkpoint dir.

    ref: a checkpoint dir, a run dir, <run dir>/latest (local paths or URIs), a run name (no '/') looked up
    under `storage` (a bare name that exists as a local path is that path), or `latest` with `storage`.
    stages: what `latest` may pick (meta.json "stage"; None = any).

    Raises ValueError (one line, naming `flag`): ref names nothing, a run without a complete checkpoint
    (listing what the run holds), an incomplete checkpoint dir, a missing bucket, a `latest` without a
    storage root or with no checkpoint of `stages` under it."""
    text = str(ref).strip()
    if not text:
        raise ValueError(f"{flag}: empty; give a checkpoint dir, a run dir, <run dir>/latest or a run name")
    if isinstance(storage, str | os.PathLike):
        storage = open_storage(storage)
    bare_name = "://" not in text and "/" not in text and not os.path.exists(text)
    if bare_name and text == LATEST:
        if storage is None:
            raise ValueError(f"{flag}: latest needs a storage root (--storage-path) whose runs to search")
        where, ckpt = storage, _latest_of_runs(storage, stages, flag)
    else:
        if bare_name and storage is not None:
            where, target = storage, storage.run_path(text)
        else:
            where = open_storage(text, flag)
            target = where.path
        try:
            ckpt = _find(where, target, flag)
        except OSError as e:
            raise ValueError(f"{flag}: cannot read {where.uri_of(target)}: {_why(e, where)}") from e
    return where.uri_of(ckpt)


def resolve_checkpoint(
    ref: str | os.PathLike,
    storage: Storage | str | None = None,
    flag: str = "--checkpoint",
    cache_dir: str | os.PathLike | None = None,
    stages: tuple[str, ...] | None = None,
) -> Path:
    """A local directory holding the checkpoint find_checkpoint(ref, storage, flag, stages) names: the
    directory itself when local; a remote one downloaded to <cache_dir>/<sha256(uri)[:16]>-<name> (default
    cache: $XDG_CACHE_HOME or ~/.cache, then raychat/checkpoints).

    Raises ValueError as find_checkpoint; OSError: the download failed (nothing is left under the final
    name)."""
    uri = find_checkpoint(ref, storage, flag, stages)
    if not is_remote(uri):
        return Path(uri)
    where = open_storage(uri, flag)
    return _download(where, where.path, Path(cache_dir) if cache_dir else DEFAULT_CACHE)


def newest_checkpoint(storage: Storage, run_path: str) -> str | None:
    """The path on storage.fs of the newest complete checkpoint_* under run_path, or None."""
    done = [c for c in _children(storage.fs, run_path) if _is_checkpoint_name(c) and _complete(storage.fs, c)]
    if not done:
        return None
    return max(done, key=lambda c: (_read_meta(storage.fs, c).get("step", -1), c))


def checkpoint_meta(storage: Storage, path: str) -> dict:
    """meta.json of the checkpoint at `path` on storage.fs (an older checkpoint's "kind" read as "stage")."""
    meta = _read_meta(storage.fs, path)
    if "kind" in meta and "stage" not in meta:
        meta["stage"] = meta.pop("kind")
    return meta


def run_directory(ref: str | os.PathLike, storage: Storage | str | None, flag: str) -> str:
    """The absolute local path of a data directory: `ref` as a path, or a bare name (no '/', not an existing
    local path) as the run <storage>/<name>.

    Raises ValueError naming `flag` when it lands on object storage: training workers read data directories
    as files, so they must be on a filesystem every node mounts (local or NFS)."""
    text = str(ref).strip()
    if not text:
        raise ValueError(f"{flag}: empty; give a directory or a run name under --storage-path")
    if isinstance(storage, str | os.PathLike):
        storage = open_storage(storage)
    bare_name = "://" not in text and "/" not in text and not os.path.exists(text)
    uri = storage.uri_of(storage.run_path(text)) if bare_name and storage is not None else text
    if is_remote(uri):
        raise ValueError(
            f"{flag}: {uri} is on object storage; data and the tokenizer are read as files by every "
            "node: give a local or NFS directory"
        )
    return open_storage(uri, flag).path


def write_bytes(storage: Storage, path: str, data: bytes) -> str:
    """Write `data` to `path` on storage.fs whole or not at all (local: a temporary name, then a rename;
    object storage: one PUT). Creates the parent dirs; returns the file's URI."""
    parent = path.rsplit("/", 1)[0]
    storage.fs.create_dir(parent, recursive=True)
    if storage.is_local:
        fd, tmp = tempfile.mkstemp(dir=parent, prefix=f".{path.rsplit('/', 1)[-1]}.")
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(data)
            os.replace(tmp, path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
    else:
        with storage.fs.open_output_stream(path) as f:
            f.write(data)
    return storage.uri_of(path)


def upload_dir(local: str | os.PathLike, storage: Storage, path: str) -> str:
    """Copy the local directory `local` to `path` on storage.fs, replacing what was there; returns its URI.
    Local storage: copied beside it under a temporary name, then renamed (never half there). Object storage:
    file by file (a reader sees the new files appear one by one)."""
    if storage.is_local:
        parent = Path(path).parent
        parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{Path(path).name}.", dir=parent))
        try:
            shutil.copytree(local, tmp, dirs_exist_ok=True)
            if os.path.exists(path):
                old = parent / f".{Path(path).name}.old-{uuid.uuid4().hex[:8]}"
                os.replace(path, old)
                shutil.rmtree(old, ignore_errors=True)
            os.replace(tmp, path)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    else:
        pafs.copy_files(
            str(local), path, source_filesystem=pafs.LocalFileSystem(), destination_filesystem=storage.fs
        )
    return storage.uri_of(path)


# ---------------------------------------------------------------------------------------------- helpers
def _find(storage: Storage, target: str, flag: str) -> str:
    fs = storage.fs
    info = fs.get_file_info(target)
    if info.type == pafs.FileType.NotFound and target.rsplit("/", 1)[-1] == LATEST:
        target = target.rsplit("/", 1)[0]
        info = fs.get_file_info(target)
    shown = storage.uri_of(target)
    if info.type == pafs.FileType.NotFound:
        parent = target.rsplit("/", 1)[0]
        raise ValueError(f"{flag}: {shown} does not exist ({_listing(fs, parent, storage)})")
    if info.type != pafs.FileType.Directory:
        raise ValueError(f"{flag}: {shown} is a file; give a checkpoint dir, a run dir or <run dir>/latest")
    if _complete(fs, target):
        return target
    newest = newest_checkpoint(storage, target)
    if newest is not None:
        return newest
    if _is_checkpoint_name(target):
        missing = [f for f in COMPLETE_FILES if fs.get_file_info(f"{target}/{f}").type != pafs.FileType.File]
        raise ValueError(f"{flag}: checkpoint {shown} is incomplete (no {', '.join(missing)})")
    raise ValueError(f"{flag}: {shown} has no complete checkpoint ({_listing(fs, target, storage)})")


def _latest_of_runs(storage: Storage, stages: tuple[str, ...] | None, flag: str) -> str:
    """The most recently written newest complete checkpoint among the runs under the root, of `stages`."""
    found = []
    try:
        for run in _children(storage.fs, storage.path):
            ckpt = newest_checkpoint(storage, run)
            if ckpt is not None and (stages is None or checkpoint_meta(storage, ckpt).get("stage") in stages):
                found.append((storage.fs.get_file_info(f"{ckpt}/meta.json").mtime, ckpt))
    except OSError as e:
        raise ValueError(f"{flag}: cannot read {storage.uri}: {_why(e, storage)}") from e
    if not found:
        what = f"complete {'/'.join(stages)}" if stages else "complete"
        where = _listing(storage.fs, storage.path, storage)
        raise ValueError(f"{flag}: latest: no {what} checkpoint under {storage.uri} ({where})")
    return max(found)[1]


def _children(fs: pafs.FileSystem, path: str) -> list[str]:
    infos = fs.get_file_info(pafs.FileSelector(path, allow_not_found=True))
    return sorted(i.path for i in infos if i.type == pafs.FileType.Directory)


def _is_checkpoint_name(path: str) -> bool:
    return path.rsplit("/", 1)[-1].startswith(CHECKPOINT_PREFIX)


def _complete(fs: pafs.FileSystem, path: str) -> bool:
    return all(
        i.type == pafs.FileType.File for i in fs.get_file_info([f"{path}/{f}" for f in COMPLETE_FILES])
    )


def _read_meta(fs: pafs.FileSystem, path: str) -> dict:
    with fs.open_input_stream(f"{path}/meta.json") as f:
        return json.loads(f.read())


def _listing(fs: pafs.FileSystem, path: str, storage: Storage) -> str:
    """'<path> holds: a, b (incomplete: checkpoint_x)' or '<path> is empty' or '<path> does not exist'."""
    shown = storage.uri_of(path)
    try:
        infos = fs.get_file_info(pafs.FileSelector(path, allow_not_found=True))
    except OSError as e:
        return _why(e, storage)
    if not infos:
        if fs.get_file_info(path).type == pafs.FileType.Directory:
            return f"{shown} is empty"
        bucket = path.split("/", 1)[0]
        if not storage.is_local and fs.get_file_info(bucket).type == pafs.FileType.NotFound:
            return f"bucket {bucket!r} does not exist"
        return f"{shown} does not exist"
    names = []
    for i in sorted(infos, key=lambda i: i.path):
        name = i.path.rsplit("/", 1)[-1]
        if i.type == pafs.FileType.Directory and _is_checkpoint_name(name) and not _complete(fs, i.path):
            name += " (incomplete)"
        names.append(name + ("/" if i.type == pafs.FileType.Directory else ""))
    more = f", ... ({len(names)} in all)" if len(names) > 20 else ""
    return f"{shown} holds: {', '.join(names[:20])}{more}"


def _download(storage: Storage, ckpt: str, cache: Path) -> Path:
    """Copy the remote checkpoint dir to the cache atomically; reuse a cached copy with the same files."""
    uri = storage.uri_of(ckpt)
    dest = cache / f"{hashlib.sha256(uri.encode()).hexdigest()[:16]}-{ckpt.rsplit('/', 1)[-1]}"
    remote = {
        i.path[len(ckpt) + 1 :]: i.size
        for i in storage.fs.get_file_info(pafs.FileSelector(ckpt, recursive=True))
        if i.type == pafs.FileType.File
    }
    if dest.is_dir() and _local_files(dest) == remote:
        return dest
    cache.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{dest.name}.", dir=cache))
    try:
        pafs.copy_files(
            ckpt, str(tmp), source_filesystem=storage.fs, destination_filesystem=pafs.LocalFileSystem()
        )
        if _local_files(tmp) != remote:
            raise OSError(f"download of {uri} is incomplete")
        if dest.exists():
            old = dest.with_name(f".{dest.name}.old-{uuid.uuid4().hex[:8]}")
            os.replace(dest, old)
            shutil.rmtree(old, ignore_errors=True)
        try:
            os.replace(tmp, dest)
        except OSError:  # another process put a copy there meanwhile: use it if it is whole
            if not (dest.is_dir() and _local_files(dest) == remote):
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return dest


def _local_files(root: Path) -> dict[str, int]:
    return {p.relative_to(root).as_posix(): p.stat().st_size for p in root.rglob("*") if p.is_file()}


def _first_line(e: BaseException) -> str:
    return (str(e).strip().splitlines() or [type(e).__name__])[0]


def _why(e: OSError, storage: Storage) -> str:
    """A short reason for a filesystem error (the bucket is missing, access denied, ...)."""
    text = str(e)
    bucket = storage.path.split("/", 1)[0]
    if not storage.is_local and ("NO_SUCH_BUCKET" in text or f"Bucket '{bucket}' not found" in text):
        return f"bucket {bucket!r} does not exist"
    if "ACCESS_DENIED" in text or isinstance(e, PermissionError):
        return f"access denied ({_first_line(e)})"
    return _first_line(e)
