"""Whole-or-nothing writes of local files: a unique temporary name beside the target, fsync, then a rename.

A reader (or a crash at any point) sees the old file or the new one, never half of one; two writers never
share a temporary name. The files and directories made here get the mode a plain open() or mkdir() gives
(0o666 / 0o777 less the umask), not tempfile's owner-only 0o600 / 0o700: a storage root is shared by the nodes,
a server or a user reading what another wrote. Object storage has its own atomic PUT
(raychat.storage.write_bytes).
"""

from __future__ import annotations

import os
import secrets
from collections.abc import Callable
from pathlib import Path


def fresh_file(directory: str | os.PathLike, prefix: str, suffix: str = "") -> Path:
    """A new empty file <directory>/<prefix><random hex><suffix>, created exclusively (never one that
    existed), of mode 0o666 less the umask. Raises OSError as os.open."""
    while True:
        path = Path(directory) / f"{prefix}{secrets.token_hex(8)}{suffix}"
        try:
            os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666))
            return path
        except FileExistsError:
            continue


def fresh_dir(directory: str | os.PathLike, prefix: str) -> Path:
    """A new empty directory <directory>/<prefix><random hex>, of mode 0o777 less the umask. Raises OSError as
    os.mkdir."""
    while True:
        path = Path(directory) / f"{prefix}{secrets.token_hex(8)}"
        try:
            path.mkdir(0o777)
            return path
        except FileExistsError:
            continue


def atomic_write(path: str | os.PathLike, write: Callable[[Path], object]) -> Path:
    """Call write(tmp) on a fresh temporary file in `path`'s directory, fsync it, rename it to `path`;
    returns `path`. The temporary file is removed if anything raises (the error propagates)."""
    path = Path(path)
    tmp = fresh_file(path.parent, f".{path.name}.", ".tmp")
    try:
        write(Path(tmp))
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
