"""Whole-or-nothing writes of local files: a unique temporary name beside the target, fsync, then a rename.

A reader (or a crash at any point) sees the old file or the new one, never half of one; two writers never
share a temporary name. The files and directories made here get the mode a plain open() or mkdir() gives
(0o666 / 0o777 less the umask), not tempfile's owner-only 0o600 / 0o700: a storage root is shared by the nodes,
a server or a user reading what another wrote. Object storage has its own atomic PUT
(raychat.storage.write_bytes).

Every temporary made here lies beside its target and is named after it: a file `.<target name>.<16 hex>.tmp`,
a directory `.<target name>.<16 hex>`. A process killed before its rename leaves that name behind: a
leftover (is_leftover), which the stages ignore in their output directories and remove when they write there
(remove_leftovers; where another process may be writing the same target at that moment, only those idle for
STAGING_IDLE_S); no other name is ever taken for one. A whole directory is replaced the same way
(atomic_write_dir): assembled under a temporary sibling name, then renamed into place.
"""

from __future__ import annotations

import errno
import os
import re
import secrets
import shutil
import stat
import time
from collections.abc import Callable
from pathlib import Path

# A staging directory nothing has changed in for this long has no live writer: serve's snapshots and the
# checkpoint cache's downloads add files to it as they go (a checkpoint's sha256 check takes minutes at most)
STAGING_IDLE_S = 3600.0
_LEFTOVER = re.compile(r"\..+\.[0-9a-f]{16}(\.tmp)?")


def _beside(target: Path, suffix: str) -> Path:
    return target.parent / f".{target.name}.{secrets.token_hex(8)}{suffix}"


def fresh_file(target: str | os.PathLike) -> Path:
    """A new empty file beside `target`, named `.<target name>.<16 hex>.tmp`, created exclusively (never one
    that existed), of mode 0o666 less the umask. Raises OSError as os.open."""
    while True:
        path = _beside(Path(target), ".tmp")
        try:
            os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666))
            return path
        except FileExistsError:
            continue


def fresh_dir(target: str | os.PathLike) -> Path:
    """A new empty directory beside `target`, named `.<target name>.<16 hex>`, of mode 0o777 less the umask.
    Raises OSError as os.mkdir."""
    while True:
        path = _beside(Path(target), "")
        try:
            path.mkdir(0o777)
            return path
        except FileExistsError:
            continue


def is_leftover(name: str) -> bool:
    """Whether `name` (no directory part) is one fresh_file or fresh_dir gives: the temporary of a write that
    was killed before its rename, when it is still there after that write."""
    return _LEFTOVER.fullmatch(name) is not None


def remove_leftovers(
    directory: str | os.PathLike, of: str | None = None, idle_s: float | None = None
) -> list[str]:
    """Delete the leftovers (is_leftover: files, and directories with what they hold) directly inside the local
    `directory`, and nothing else; with `of`, only those of the target named `of` (`.<of>.<16 hex>[.tmp]`);
    with `idle_s`, only those in which nothing has changed for `idle_s` seconds (last_change). Returns the
    names deleted, sorted ([] when `directory` does not exist). Without `idle_s`, call it where a stage starts
    writing into its own directory: a leftover there is never another run's live temporary unless two runs
    write the same directory at once. Where two processes may write one target at once (two servers
    snapshotting one checkpoint, two fetches of one checkpoint into a node's cache), give `idle_s`: a live
    writer keeps changing its temporary, so only one whose writer is gone (or stalled that long) is deleted."""
    try:
        names = sorted(filter(is_leftover, os.listdir(directory)))
    except FileNotFoundError:
        return []
    if of is not None:
        names = [n for n in names if re.fullmatch(rf"\.{re.escape(of)}\.[0-9a-f]{{16}}(\.tmp)?", n)]
    removed = []
    for name in names:
        path = Path(directory) / name
        try:
            if idle_s is not None and time.time() - last_change(path) < idle_s:
                continue
            if path.is_dir() and not path.is_symlink():
                shutil.rmtree(path)
            else:
                path.unlink()
        except FileNotFoundError:  # deleted meanwhile by its writer or another process cleaning up
            continue
        removed.append(name)
    return removed


def last_change(path: str | os.PathLike) -> float:
    """The newest modification time (unix seconds) of `path` and, for a directory, of everything below it
    (links not followed). A directory's own time moves whenever an entry is added, renamed or removed, so it
    also moves as hard links are made into it. Raises FileNotFoundError when `path` is gone."""
    newest = os.lstat(path).st_mtime
    if os.path.isdir(path) and not os.path.islink(path):
        for root, dirs, files in os.walk(path):
            for name in dirs + files:
                try:
                    newest = max(newest, os.lstat(os.path.join(root, name)).st_mtime)
                except FileNotFoundError:
                    continue
    return newest


def atomic_write(path: str | os.PathLike, write: Callable[[Path], object]) -> Path:
    """Call write(tmp) on a fresh temporary file in `path`'s directory, fsync it, rename it to `path`;
    returns `path`. The file keeps fresh_file's mode even when write() replaces tmp with a file of its own
    (safetensors' save_file makes an owner-only one). The temporary file is removed if anything raises (the
    error propagates)."""
    path = Path(path)
    tmp = fresh_file(path)
    try:
        mode = stat.S_IMODE(os.stat(tmp).st_mode)
        write(Path(tmp))
        os.chmod(tmp, mode)
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def atomic_write_bytes(path: str | os.PathLike, data: bytes) -> Path:
    return atomic_write(path, lambda p: p.write_bytes(data))


def atomic_write_text(path: str | os.PathLike, text: str) -> Path:
    return atomic_write(path, lambda p: p.write_text(text))


def atomic_write_dir(path: str | os.PathLike, write: Callable[[Path], object]) -> Path:
    """Replace the local directory `path` whole: call write(tmp) on a fresh directory beside it (fresh_dir),
    then rename the directory `path` held (if any) to a leftover name, tmp to `path`, and delete the old one;
    returns `path`. The leftovers of an earlier call on `path` that was killed are deleted first
    (remove_leftovers). A reader sees the old directory or the new one, never a mix; a kill before the first
    rename leaves the old one untouched, one between the two renames leaves `path` absent (both copies stay
    under leftover names until the next call). tmp is removed if anything raises (the error propagates)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    remove_leftovers(path.parent, of=path.name)
    tmp = fresh_dir(path)
    try:
        write(tmp)
        old = None
        if path.exists():
            old = fresh_dir(path)
            os.replace(path, old)  # onto an empty directory: allowed
        os.replace(tmp, path)
        if old is not None:  # after the new one is in place: `path` is absent only between the two renames
            shutil.rmtree(old, ignore_errors=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return path


def exclusive_write_bytes(path: str | os.PathLike, data: bytes) -> bool:
    """Create the local file `path` holding `data` only if nothing is at `path`: the bytes go to a fresh
    temporary file (fsync) that is then hard-linked to `path` (link(2) fails when `path` exists, as an O_EXCL
    create does, also on NFS), so two writers cannot both create it and no reader sees half of it. On a
    filesystem without hard links (some FUSE mounts) `path` is created with O_EXCL and written in place (a
    reader may see it empty for that moment). Returns False (nothing written) when `path` exists. Raises
    OSError as os.open / os.link do."""
    tmp = fresh_file(path)
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.link(tmp, path)
        return True
    except FileExistsError:
        return False
    except OSError as e:
        if e.errno not in (errno.EPERM, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EMLINK, errno.ENOSYS):
            raise
    finally:
        Path(tmp).unlink(missing_ok=True)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
    except FileExistsError:
        return False
    with os.fdopen(fd, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    return True
