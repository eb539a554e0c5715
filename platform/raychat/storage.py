"""One storage root for every stage: where runs live, and the only place that writes, renames or deletes there.

A storage root is a local or NFS directory, or an `s3://bucket/prefix` or `gs://bucket/prefix` URI. A run
lives at <root>/<run>/ (its checkpoints: raychat.checkpoint_manager). Run names follow one rule
(raychat.config.schema.RUN_NAME_RULE); every write, rename and delete goes through `Storage.inside`, which
refuses any path that is not strictly below the root, so no name, empty or `..`, reaches the root itself or
anything outside it.

Filesystems are pyarrow.fs, the ones Ray Train uses (`Storage.ray_train_storage()` gives its RunConfig
arguments). S3 takes the standard AWS variables: AWS_ENDPOINT_URL or AWS_ENDPOINT_URL_S3 (an S3-compatible
server: the scheme of that URL, http or https, is the one used), AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY
(or any other source of the AWS default chain). Without an endpoint, pyarrow's from_uri asks S3 for
the bucket's region (one request per process that opens the root) whatever AWS_REGION / AWS_DEFAULT_REGION
say. GCS takes Google's application default credentials; every GCS URI gets
`retry_limit_seconds=60`, so a missing credential fails within a minute instead of retrying for 15. Every
process that opens a root (the driver, Train workers, RL actors, serve replicas) reads these variables itself,
so they must be set on every node. A root's URI holds no options: a query (`?endpoint_override=...`) would be
lost where a worker reopens the root from Storage.uri, and keys in a URI would be written to logs, checkpoints'
meta.json and job entrypoints; open_storage refuses both.

A bad storage root is a ValueError of one line that names the flag and says what was found. Data directories
(parquet shards, the tokenizer) are named like runs (`run_directory`: a path, or a run name under the storage
root) and must be on a filesystem every node mounts (local or NFS): the training workers read them as files.
Small results (`write_bytes`) and exported directories (`upload_dir`) go to any storage root; a remote
directory comes back whole or not at all (`download_dir`).
"""

from __future__ import annotations

import os
import shutil
import uuid
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import parse_qsl, urlsplit

import pyarrow.fs as pafs

from raychat.atomic import STAGING_IDLE_S, atomic_write_bytes, atomic_write_dir, fresh_dir, remove_leftovers
from raychat.config.schema import check_run_name

REMOTE_SCHEMES = ("s3", "gs")
GCS_RETRY_LIMIT_S = 60
# pyarrow's URI options that carry a credential (S3FileSystem, GcsFileSystem): never in a storage URI
SECRET_OPTIONS = ("access_key", "secret_key", "session_token", "access_token")
# the command that copies the directory {src} (a path or URI of its scheme; "" = a local path) into the directory
# {into} as <into>/<name>, {name} being src's last part: what a user runs, e.g. to fetch a remote export, or to
# copy a checkpoint out of the run that prunes it
COPY_COMMANDS = {
    "": "cp -r {src} {into}",
    "s3": "aws s3 cp --recursive {src} {into}/{name}",
    "gs": "gcloud storage cp -r {src} {into}",
}
# what gives the AWS SDK's default credential chain a credential, before an instance role
AWS_CREDENTIAL_VARIABLES = (
    "AWS_ACCESS_KEY_ID", "AWS_PROFILE", "AWS_WEB_IDENTITY_TOKEN_FILE", "AWS_CONTAINER_CREDENTIALS_RELATIVE_URI",
    "AWS_CONTAINER_CREDENTIALS_FULL_URI",
)  # fmt: skip
# where a remote root's settings come from instead of its URI, per scheme
SETTINGS_FROM = {
    "s3": "S3 settings come from the environment of every node: AWS_ENDPOINT_URL (its scheme, http or https, is "
    "used), AWS_REGION, AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY or an instance role",
    "gs": "GCS takes Google's application default credentials on every node, and raychat sets "
    "retry_limit_seconds=60 itself",
}


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

    def run_path(self, run: str, flag: str = "--run-name") -> str:
        """<root>/<run> on self.fs. Raises ConfigError naming `flag` for a name that breaks the run-name rule
        (empty, '.', '..', a hidden name, a path)."""
        return f"{self.path}/{check_run_name(run, flag)}"

    def writable_run_path(self, run: str, flag: str = "--run-name") -> str:
        """run_path(run, flag), refused as a write there would be (`inside`) before anything is written.

        Raises ValueError naming `flag`: a name that breaks the run-name rule, or (local root) a symbolic link
        below the root that leads out of it."""
        path = self.run_path(run, flag)
        try:
            return self.inside(path)
        except ValueError as e:
            raise ValueError(f"{flag}: {e}") from e

    def inside(self, fs_path: str) -> str:
        """`fs_path` when it lies strictly below the root (no '.', '..' or empty part on the way; on a local
        root, no symbolic link on the way that leads out of it), else ValueError. Every write, rename and
        delete under a storage root asks this first."""
        prefix = self.path.rstrip("/") + "/"
        rest = fs_path[len(prefix) :] if fs_path.startswith(prefix) else None
        if not rest or any(part in ("", ".", "..") for part in rest.split("/")):
            raise ValueError(f"{self.uri_of(fs_path)} is not below the storage root {self.uri}: refused")
        if self.is_local:  # the root itself may be a link (a mount point); what lies below must stay below it
            real, real_root = os.path.realpath(fs_path), os.path.realpath(self.path)
            if not real.startswith(real_root.rstrip("/") + "/"):
                raise ValueError(
                    f"{fs_path} is not below the storage root {self.uri}: a symbolic link on the way leads to "
                    f"{real}: refused"
                )
        return fs_path

    def ray_train_storage(self) -> dict:
        """RunConfig(**this): storage_path and, for a remote root, the storage_filesystem it lives on (Ray
        Train then takes storage_path as a path on that filesystem: bucket/prefix, without the scheme)."""
        if self.is_local:
            return {"storage_path": self.path}
        return {"storage_path": self.path, "storage_filesystem": self.fs}


# Where Ray unpacks a job's runtime_env working_dir (`raychat submit` uploads the checkout): the job's cwd
RAY_JOB_COPY = f"{os.sep}runtime_resources{os.sep}working_dir_files{os.sep}"


def check_not_in_job_copy(path: str, flag: str) -> None:
    """Raise ValueError naming `flag` when `path` is relative and this process runs in a Ray job's unpacked
    working_dir (RAY_JOB_COPY in the cwd): the path would land in that temporary copy of the checkout, which
    Ray deletes with the job's runtime env (a submitted stage wrote its output there and SUCCEEDED)."""
    cwd = os.getcwd()
    if not os.path.isabs(path) and RAY_JOB_COPY in cwd + os.sep:
        raise ValueError(
            f"{flag} {path!r} is relative, and this Ray job runs in a temporary copy of the submitted checkout "
            f"({cwd}) that Ray deletes: give an absolute path on storage every node reads (e.g. --storage-path "
            "/mnt/checkpoints/runs), or s3:// / gs://"
        )


def open_storage(uri: str | os.PathLike, flag: str = "--storage-path") -> Storage:
    """The Storage for a local path, file://, s3:// or gs:// URI. Touches nothing (see check_writable).

    Raises ValueError naming `flag` for an empty value, an unsupported scheme, options or keys in an s3:// /
    gs:// URI (check_bare_uri), or a relative path inside a Ray job's temporary working_dir
    (check_not_in_job_copy)."""
    text = str(uri).strip()
    if not text:
        raise ValueError(f"{flag}: empty; give a directory, s3://bucket/prefix or gs://bucket/prefix")
    scheme = text.split("://", 1)[0].lower() if "://" in text else ""
    if scheme in ("", "file"):
        given = os.path.expanduser(text[len("file://") :] if scheme else text)
        check_not_in_job_copy(given, flag)
        local = os.path.abspath(given)
        return Storage(local.rstrip("/") or "/", pafs.LocalFileSystem(), local.rstrip("/") or "/")
    if scheme not in REMOTE_SCHEMES:
        raise ValueError(
            f"{flag}: scheme {scheme}:// of {text!r} is not supported; use a directory, s3:// or gs://"
        )
    check_bare_uri(text, scheme, flag)
    if scheme == "gs":
        text += f"?retry_limit_seconds={GCS_RETRY_LIMIT_S}"
    try:
        fs, path = pafs.FileSystem.from_uri(text)
    except (OSError, ValueError) as e:  # pyarrow.lib.ArrowInvalid is a ValueError
        raise ValueError(f"{flag}: cannot open {text!r}: {_first_line(e)}") from e
    path = path.rstrip("/")
    if not path:
        raise ValueError(f"{flag}: {text!r} names no bucket")
    return Storage(f"{scheme}://{path}", fs, path)


def check_bare_uri(text: str, scheme: str, flag: str) -> None:
    """Refuse an s3:// / gs:// URI `text` with a query (pyarrow's options: `?endpoint_override=...&scheme=http`)
    or a user part (`s3://KEY:SECRET@bucket`): the driver would open it, but every process that reopens the
    root from its bare URI (Storage.uri: Train workers' metrics sink, a checkpoint fetch, RL actors, serve
    replicas) would go without them; and keys in a URI would be written to logs, checkpoints' meta.json and
    job entrypoints. The message names the options, never their values.

    Raises ValueError naming `flag`, the options and where such settings go (SETTINGS_FROM)."""
    parts = urlsplit(text)
    bare = f"{scheme}://{parts.netloc.rsplit('@', 1)[-1]}{parts.path}"
    names = list(dict.fromkeys(k for k, _ in parse_qsl(parts.query, keep_blank_values=True)))
    if "@" in parts.netloc or any(n in SECRET_OPTIONS for n in names):
        raise ValueError(
            f"{flag}: {bare}: keys in a storage URI are refused (they would be written to logs, checkpoints' "
            f"meta.json and job entrypoints); give {bare}: {SETTINGS_FROM[scheme]}"
        )
    if "?" in text:
        raise ValueError(
            f"{flag}: {bare}: options in a storage URI ({', '.join(names) or 'an empty query'}) are refused (the "
            f"processes that reopen the root on other nodes would go without them); give {bare}: "
            f"{SETTINGS_FROM[scheme]}"
        )


def check_writable(storage: Storage, flag: str = "--storage-path") -> None:
    """Create the root if needed and write, then delete, a probe file in it. Nothing else is touched.

    Raises ValueError naming `flag`: the bucket does not exist, access is denied, the root is a file (on
    object storage, too: an object there would not stop the run's objects from going under the same name), or
    the directory cannot be created or written."""
    probe = f"{storage.path}/.raychat-write-probe-{uuid.uuid4().hex}"
    try:
        is_file = storage.fs.get_file_info(storage.path).type == pafs.FileType.File
        if not is_file:
            storage.fs.create_dir(storage.path, recursive=True)
            with storage.fs.open_output_stream(probe) as f:
                f.write(b"ok")
            storage.fs.delete_file(probe)
    except OSError as e:
        raise ValueError(f"{flag}: {storage.uri} is not writable: {why(e, storage)}") from e
    if is_file:
        raise ValueError(f"{flag}: {storage.uri} is not writable: it is a file, not a directory")


def is_remote(uri: str | os.PathLike) -> bool:
    """True for an s3:// or gs:// URI (what has to be fetched before a local file API can read it)."""
    return str(uri).split("://", 1)[0].lower() in REMOTE_SCHEMES if "://" in str(uri) else False


def copy_command(src: str, into: str) -> str:
    """The shell command (COPY_COMMANDS) that copies the directory `src` (a local path, s3:// or gs:// URI) into
    the directory `into` (e.g. "."), as <into>/<src's last part>."""
    scheme = src.split("://", 1)[0].lower() if is_remote(src) else ""
    name = src.rstrip("/").rsplit("/", 1)[-1]
    return COPY_COMMANDS[scheme].format(src=src, into=into, name=name)


def is_bare_name(ref: str) -> bool:
    """A reference that names a run under the storage root: no '/', no scheme, not an existing local path."""
    return "://" not in ref and "/" not in ref and not os.path.exists(ref)


def run_directory(ref: str | os.PathLike, storage: Storage | str | None, flag: str) -> str:
    """The absolute local path of a data directory: `ref` as a path, or a bare name (no '/', not an existing
    local path) as the run <storage>/<name>.

    Raises ValueError naming `flag` when it lands on object storage (check_mounted): training workers read data
    directories as files, so they must be on a filesystem every node mounts (local or NFS). A root given as a
    string is opened only for a bare name, and an s3:// or gs:// one not even then."""
    text = str(ref).strip()
    if not text:
        raise ValueError(f"{flag}: empty; give a directory or a run name under --storage-path")
    uri = text
    if is_bare_name(text) and storage is not None:
        if isinstance(storage, str | os.PathLike):
            check_mounted(f"{str(storage).strip().rstrip('/')}/{text}", flag)
            storage = open_storage(storage)
        uri = storage.uri_of(storage.run_path(text, flag))
    check_mounted(uri, flag)
    return open_storage(uri, flag).path


def check_mounted(uri: str | os.PathLike, flag: str) -> None:
    """Refuse a data directory on object storage (an s3:// or gs:// URI: is_remote) before anything opens it
    (opening an s3:// root may ask S3 for its bucket's region: seconds, or a network error).

    Raises ValueError naming `flag`: "<flag>: <uri> is on object storage; ... give a local or NFS directory"."""
    if is_remote(uri):
        raise ValueError(
            f"{flag}: {uri} is on object storage; data and the tokenizer are read as files by every "
            "node: give a local or NFS directory"
        )


def output_directory(out: str | None, storage_path: str, run: str) -> tuple[str, str]:
    """The local directory a data stage writes, and the flag that names it: `out` as given (--out), else the
    run <storage_path>/<run> (--storage-path), which must stay below its root. Touches nothing.

    Raises ValueError naming the flag: the directory is on object storage (see run_directory), the run name
    breaks the rule, or a symbolic link below the root leads out of it (--run-name)."""
    if out:
        return run_directory(out, None, "--out"), "--out"
    check_mounted(storage_path, "--storage-path")
    storage = open_storage(storage_path)
    path = storage.writable_run_path(run)
    return run_directory(storage.uri_of(path), None, "--storage-path"), "--storage-path"


def write_bytes(storage: Storage, path: str, data: bytes) -> str:
    """Write `data` to `path` (strictly below the root) on storage.fs whole or not at all (local: a unique
    temporary name, fsync, then a rename; object storage: one PUT). Creates the parent dirs; returns the
    file's URI. Raises ValueError for a path outside the root."""
    storage.inside(path)
    parent = path.rsplit("/", 1)[0]
    storage.fs.create_dir(parent, recursive=True)
    if storage.is_local:
        atomic_write_bytes(path, data)
    else:
        with storage.fs.open_output_stream(path) as f:
            f.write(data)
    return storage.uri_of(path)


def read_bytes(storage: Storage, path: str) -> bytes:
    """The bytes of the file at `path` on storage.fs (OSError / FileNotFoundError as pyarrow raises them)."""
    with storage.fs.open_input_stream(path) as f:
        return f.read()


def delete_dir(storage: Storage, path: str) -> None:
    """Delete the directory `path` (strictly below the root) and all it holds; nothing when it is absent.
    Raises ValueError for a path outside the root."""
    storage.inside(path)
    if storage.fs.get_file_info(path).type != pafs.FileType.NotFound:
        storage.fs.delete_dir(path)


def upload_dir(local: str | os.PathLike, storage: Storage, path: str, last: str | None = None) -> str:
    """Copy the local directory `local` to `path` (strictly below the root) on storage.fs, replacing what was
    there; returns its URI. Local storage: copied beside it under a temporary name, then renamed
    (raychat.atomic.atomic_write_dir: never half there, never a mix with what was there). Object storage: file
    by file (a reader sees the new files appear one by one), in this order: the file named `last` (a name
    directly in `local`) is deleted at `path` first, every other file is uploaded, the files directly at `path`
    that `local` does not hold are deleted (an earlier upload's; sub-directories there are left), and `last`
    is uploaded last; so once `last` is there, so is the whole upload and nothing else, and an upload that
    ended part-way lacks it.
    Raises ValueError for a path outside the root; OSError as pyarrow raises it (the upload ended there)."""
    storage.inside(path)
    if storage.is_local:

        def copy(tmp: Path) -> None:
            mode = tmp.stat().st_mode
            shutil.copytree(local, tmp, dirs_exist_ok=True)
            os.chmod(tmp, mode)  # a mkdir's mode, not the local directory's (often a private temporary one)

        atomic_write_dir(path, copy)
    else:
        names = sorted(p.relative_to(local).as_posix() for p in Path(local).rglob("*") if p.is_file())

        def put(name: str) -> None:
            pafs.copy_files(
                str(Path(local) / name),
                storage.inside(f"{path}/{name}"),
                source_filesystem=pafs.LocalFileSystem(),
                destination_filesystem=storage.fs,
            )

        if last is not None:
            delete_file(storage, f"{path}/{last}")
        for name in names:
            if name != last:
                put(name)
        for info in storage.fs.get_file_info(pafs.FileSelector(path, allow_not_found=True)):
            if info.type == pafs.FileType.File and info.base_name not in names:
                delete_file(storage, info.path)
        if last in names:
            put(last)
    return storage.uri_of(path)


def delete_file(storage: Storage, path: str) -> None:
    """Delete the file at `path` (strictly below the root) on storage.fs; nothing when there is none."""
    if storage.fs.get_file_info(storage.inside(path)).type == pafs.FileType.File:
        storage.fs.delete_file(path)


def download_dir(storage: Storage, path: str, dest: Path, check) -> Path:
    """Copy the remote directory `path` to the local `dest` whole or not at all: into a temporary sibling,
    `check(tmp)` (which raises ValueError or OSError to refuse it), then renamed over whatever `dest` held,
    unless what `dest` holds by then passes `check` too: another process of the node fetched the same
    directory meanwhile and may be reading it, so it is kept and the copy is dropped. The temporaries of `dest`
    left by a killed process are deleted first, those idle for raychat.atomic.STAGING_IDLE_S only: another
    process of the node may be fetching the same directory right now.

    Raises what check raises, or OSError: the copy failed (nothing is left under `dest`'s name either way)."""
    dest.parent.mkdir(parents=True, exist_ok=True)
    remove_leftovers(dest.parent, of=dest.name, idle_s=STAGING_IDLE_S)
    tmp = fresh_dir(dest)  # a mkdir's mode: the cache is shared too
    try:
        pafs.copy_files(
            path, str(tmp), source_filesystem=storage.fs, destination_filesystem=pafs.LocalFileSystem()
        )
        check(tmp)
        if dest.exists():
            try:
                check(dest)
                return dest
            except (ValueError, OSError):  # refused: replaced
                pass
            old = fresh_dir(dest)  # a leftover's name, should a kill come before the rmtree
            os.replace(dest, old)
            shutil.rmtree(old, ignore_errors=True)
        try:
            os.replace(tmp, dest)
        except OSError:  # another process put a copy there meanwhile: use it if it passes the check
            if not dest.is_dir():
                raise
            check(dest)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return dest


def children(storage: Storage, path: str) -> list[str]:
    """The sub-directories of `path` on storage.fs, sorted ([] when it does not exist)."""
    infos = storage.fs.get_file_info(pafs.FileSelector(path, allow_not_found=True))
    return sorted(i.path for i in infos if i.type == pafs.FileType.Directory)


def listing(storage: Storage, path: str, mark=lambda path: "") -> str:
    """'<path> holds: a, b/ ...' or '<path> is empty' or '<path> does not exist' (or why it cannot be read);
    mark(path) adds a note after a directory's name."""
    fs, shown = storage.fs, storage.uri_of(path)
    try:
        infos = fs.get_file_info(pafs.FileSelector(path, allow_not_found=True))
    except OSError as e:
        return why(e, storage)
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
        if i.type == pafs.FileType.Directory:
            name += mark(i.path) + "/"
        names.append(name)
    more = f", ... ({len(names)} in all)" if len(names) > 20 else ""
    return f"{shown} holds: {', '.join(names[:20])}{more}"


def _first_line(e: BaseException) -> str:
    return (str(e).strip().splitlines() or [type(e).__name__])[0]


def why(e: OSError, storage: Storage) -> str:
    """A short reason for a filesystem error (the bucket is missing, access denied, the S3 endpoint does not
    answer, ...)."""
    text = str(e)
    bucket = storage.path.split("/", 1)[0]
    if not storage.is_local and ("NO_SUCH_BUCKET" in text or f"Bucket '{bucket}' not found" in text):
        return f"bucket {bucket!r} does not exist"
    if "NETWORK_CONNECTION" in text:  # pyarrow's S3: nothing answered (after the AWS SDK's retries)
        detail = text.split("Details: ", 1)[-1].strip().splitlines()[0]
        var = next((v for v in ("AWS_ENDPOINT_URL_S3", "AWS_ENDPOINT_URL") if os.environ.get(v)), None)
        where = f"the S3 endpoint {os.environ[var]} (${var})" if var else "the S3 endpoint"
        return f"cannot connect to {where}: {detail}"
    if "ACCESS_DENIED" in text or isinstance(e, PermissionError):
        hint = ""
        if storage.uri.startswith("s3://") and not _aws_credentials_configured():
            hint = (
                "; this process found no AWS credentials (no AWS_ACCESS_KEY_ID, AWS_PROFILE or ~/.aws/credentials),"
                " which every process that opens the root needs (a job's driver, Train workers, RL actors): set "
                "them in the environment of every node's `ray start`, or pass them to a job with raychat submit "
                "--env AWS_ACCESS_KEY_ID=... --env AWS_SECRET_ACCESS_KEY=..."
            )
        return f"access denied ({_first_line(e)}){hint}"
    return _first_line(e)


def _aws_credentials_configured() -> bool:
    """Whether the AWS SDK's credential chain has a source in this process's environment or files (an
    instance role, the chain's last source, cannot be told without asking the metadata service)."""
    if any(os.environ.get(v) for v in AWS_CREDENTIAL_VARIABLES):
        return True
    shared = os.environ.get("AWS_SHARED_CREDENTIALS_FILE") or os.path.expanduser("~/.aws/credentials")
    return os.path.isfile(shared)
