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

Checkpoint references (`resolve_checkpoint`), local or remote alike:
  <checkpoint dir>          a directory holding the checkpoint files
  <run dir>                 a directory of checkpoint_* dirs: its newest complete checkpoint
  <run dir>/latest          the same, spelled as a path (nothing named `latest` needs to exist)
  <run name> + storage      <storage>/<run name>, as a run dir
A remote checkpoint is downloaded into a cache dir under a temporary name and renamed when complete, so a
half download is never used, and it is downloaded again only when its files (names, sizes) change.
A bad reference or storage root is a ValueError of one line that names the flag and says what was found;
an I/O error in the middle of a download propagates (OSError) and leaves no partial copy behind.
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


def resolve_checkpoint(
    ref: str | os.PathLike,
    storage: Storage | str | None = None,
    flag: str = "--checkpoint",
    cache_dir: str | os.PathLike | None = None,
) -> Path:
    """A local directory holding the newest complete checkpoint that `ref` names (see the module doc).

    ref: a checkpoint dir, a run dir, <run dir>/latest (local paths or s3:// / gs:// URIs), or a run name
    (no '/') looked up under `storage` (a bare name that exists as a local path is that path). A remote checkpoint is downloaded to
    <cache_dir>/<sha256(uri)[:16]>-<name> (default cache: ~/.cache/raychat/checkpoints).

    Raises ValueError (one line, naming `flag`): ref names nothing, a run without a complete checkpoint
    (listing what the run holds), an incomplete checkpoint dir, a missing bucket. OSError: the download
    failed (nothing is left under the final name)."""
    text = str(ref).strip()
    if not text:
        raise ValueError(f"{flag}: empty; give a checkpoint dir, a run dir, <run dir>/latest or a run name")
    if isinstance(storage, str | os.PathLike):
        storage = open_storage(storage)
    bare_name = "://" not in text and "/" not in text and not os.path.exists(text)
    if bare_name and storage is not None:
        where, target = storage, storage.run_path(text)
    else:
        where = open_storage(text, flag)
        target = where.path
    try:
        ckpt = _find(where, target, flag)
    except OSError as e:
        raise ValueError(f"{flag}: cannot read {where.uri_of(target)}: {_why(e, where)}") from e
    if where.is_local:
        return Path(ckpt)
    return _download(where, ckpt, Path(cache_dir) if cache_dir else DEFAULT_CACHE)


def newest_checkpoint(storage: Storage, run_path: str) -> str | None:
    """The path on storage.fs of the newest complete checkpoint_* under run_path, or None."""
    done = [c for c in _children(storage.fs, run_path) if _is_checkpoint_name(c) and _complete(storage.fs, c)]
    if not done:
        return None
    return max(done, key=lambda c: (_read_meta(storage.fs, c).get("step", -1), c))


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
