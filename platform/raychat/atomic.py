"""Whole-or-nothing writes of local files: a unique temporary name beside the target, fsync, then a rename.

A reader (or a crash at any point) sees the old file or the new one, never half of one; two writers never
share a temporary name. Object storage has its own atomic PUT (raychat.storage.write_bytes).
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable
from pathlib import Path


def atomic_write(path: str | os.PathLike, write: Callable[[Path], object]) -> Path:
    """Call write(tmp) on a fresh temporary file in `path`'s directory, fsync it, rename it to `path`;
    returns `path`. The temporary file is removed if anything raises (the error propagates)."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    os.close(fd)
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
