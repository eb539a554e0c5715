"""raychat.atomic: a file is the old one or the new one, never half of one; no temporary file is left behind."""

from __future__ import annotations

import pytest

from raychat.atomic import atomic_write, atomic_write_bytes, atomic_write_text


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
