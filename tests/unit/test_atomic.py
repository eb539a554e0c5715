"""raychat.atomic: a file is the old one or the new one, never half of one; no temporary file is left behind."""

from __future__ import annotations

import os
import re
import stat

import numpy as np
import pytest

from raychat.atomic import (
    atomic_write,
    atomic_write_bytes,
    atomic_write_dir,
    atomic_write_text,
    fresh_dir,
    fresh_file,
    is_leftover,
    remove_leftovers,
)


def test_a_write_that_fails_half_way_leaves_the_old_file_and_no_temporary(tmp_path):
    path = atomic_write_text(tmp_path / "report.md", "old")

    def half(tmp):
        tmp.write_text("ne")
        raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        atomic_write(path, half)
    assert path.read_text() == "old"
    assert [p.name for p in tmp_path.iterdir()] == ["report.md"]


def test_temporary_names_are_unique_and_hidden(tmp_path):
    seen = []

    def record(tmp):
        seen.append(tmp)
        tmp.write_bytes(b"x")

    atomic_write(tmp_path / "a.json", record)
    atomic_write(tmp_path / "a.json", record)
    assert seen[0] != seen[1] and all(p.name.startswith(".a.json.") and p.parent == tmp_path for p in seen)
    assert atomic_write_bytes(tmp_path / "a.json", b"\x00\x01").read_bytes() == b"\x00\x01"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.json"]


@pytest.fixture
def umask_022():
    old = os.umask(0o022)
    yield
    os.umask(old)


def test_a_written_file_gets_a_plain_writes_mode_not_owner_only(tmp_path, umask_022):
    # a storage root is read by other nodes, a server, another user: tempfile's 0o600 locked them out
    path = atomic_write_text(tmp_path / "eval.json", "{}")
    plain = tmp_path / "plain.json"
    plain.write_text("{}")
    assert stat.S_IMODE(path.stat().st_mode) == stat.S_IMODE(plain.stat().st_mode) == 0o644
    os.umask(0o077)  # a user's stricter umask is kept
    assert stat.S_IMODE(atomic_write_text(tmp_path / "private.json", "{}").stat().st_mode) == 0o600


def test_a_writer_that_replaces_the_temporary_keeps_the_plain_mode(tmp_path, umask_022):
    # safetensors' save_file (raychat export's model.safetensors) makes its own owner-only file at the name
    from safetensors.numpy import save_file

    path = atomic_write(tmp_path / "model.safetensors", lambda tmp: save_file({"w": np.zeros(2)}, str(tmp)))
    assert stat.S_IMODE(path.stat().st_mode) == 0o644
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.safetensors"]


def test_fresh_dir_and_file_are_new_hidden_names_with_a_plain_mode(tmp_path, umask_022):
    d, f = fresh_dir(tmp_path / "out"), fresh_file(tmp_path / "a")
    assert re.fullmatch(r"\.out\.[0-9a-f]{16}", d.name) and re.fullmatch(r"\.a\.[0-9a-f]{16}\.tmp", f.name)
    assert d.parent == f.parent == tmp_path
    assert (stat.S_IMODE(d.stat().st_mode), stat.S_IMODE(f.stat().st_mode)) == (0o755, 0o644)
    assert fresh_dir(tmp_path / "out") != d and f.read_bytes() == b""


def test_a_killed_writes_temporaries_are_leftovers_and_nothing_else_is(tmp_path):
    """The one rule the stages use for their output directories: exactly the names fresh_file / fresh_dir
    give (what atomic_write, the downloads and the directory uploads leave when killed before the rename)."""
    made = [
        fresh_file(tmp_path / "model.safetensors"),
        fresh_dir(tmp_path / "run"),
        fresh_file(tmp_path / "a"),
    ]
    assert all(is_leftover(p.name) for p in made)
    users = ["model.safetensors", ".model.safetensors.tmp", ".bashrc", "a.0123456789abcdef.tmp",
             ".a.0123456789ABCDEF.tmp", ".a.0123456789abcde.tmp", ".a.0123456789abcdef.part",
             ".a.0123456789abcdef.tmp.x", "..0123456789abcdef.tmp", ".a.old-01234567"]  # fmt: skip
    assert not any(map(is_leftover, users))
    for name in users:
        (tmp_path / name).write_text("mine")
    (made[1] / "config.json").write_text("{}")  # a staging directory holds files
    assert remove_leftovers(tmp_path) == sorted(p.name for p in made)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(users)
    assert remove_leftovers(tmp_path / "absent") == []


def test_a_directory_is_replaced_whole_and_only_its_own_leftovers_are_removed(tmp_path):
    """atomic_write_dir: the old directory stays as it was until the new one is complete; a failed write
    leaves it and no staging directory; the leftovers of an earlier killed call on the same target go, those
    of another target (`hf.b`) stay."""
    target = tmp_path / "hf"
    atomic_write_dir(target, lambda d: (d / "config.json").write_text("old"))
    killed, other = fresh_dir(target), fresh_dir(tmp_path / "hf.b")

    def half(d):
        (d / "config.json").write_text("new")
        assert (target / "config.json").read_text() == "old"  # not yet in place
        raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        atomic_write_dir(target, half)
    assert (target / "config.json").read_text() == "old"
    assert not killed.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["hf", other.name])
    atomic_write_dir(target, lambda d: (d / "model.safetensors").write_text("w"))
    assert sorted(p.name for p in target.iterdir()) == ["model.safetensors"]  # no old file beside the new
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["hf", other.name])
