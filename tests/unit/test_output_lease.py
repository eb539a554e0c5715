"""One writer at a time per data or tokenizer output: `raychat data prepare` and `raychat tokenizer train` hold
<out>/lease.json (raychat.lease.output_lease) while they write it. A second run into the same --out at once
removed the first's live temporaries as a killed run's leftovers (the first then failed at its rename) and wrote
its own shards and manifest there; now it is refused in one line naming the lease and its holder, and the first
finishes untouched. A killed holder's lease is taken over. The first run is a real process held inside its
write (support.stopped_writer)."""

from __future__ import annotations

import json
import shlex
import socket
import time
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from support.stopped_writer import Held, run_killed

from raychat.atomic import is_leftover
from raychat.cli import main
from raychat.data.corpus.shards import list_shards, write_manifest, write_shards
from raychat.lease import output_lease
from raychat.tokenizer import Tokenizer

DOCS = [f"document {i}: " + "words of a small corpus " * (i + 1) for i in range(12)]

# `raychat data prepare --source SRC --out OUT --num-shards 2`, stopped once shard_00001's temporary is written
# (before its rename): the manifest removed, shard_00000 written, the lease held.
PREPARE_STOPPED_IN_A_SHARD = """
from raychat.cli import main
from raychat.data.corpus import shards
real = shards.atomic_write
def held_write(path, write):
    def write_then_stop(tmp):
        write(tmp)
        if path.name == "shard_00001.parquet":
            stop()
    return real(path, write_then_stop)
shards.atomic_write = held_write
sys.exit(main(["data", "prepare", "--source", SRC, "--out", OUT, "--num-shards", "2"]))
"""

# `raychat tokenizer train --data-dir DATA --out OUT --vocab-size 300`, stopped once tokenizer.json's temporary
# is written (before its rename).
TOKENIZER_STOPPED_IN_ITS_SAVE = """
from raychat import tokenizer
from raychat.atomic import atomic_write
from raychat.cli import main
def held_write_text(path, text):
    return atomic_write(path, lambda tmp: (tmp.write_text(text), stop()))
tokenizer.atomic_write_text = held_write_text
sys.exit(main(["tokenizer", "train", "--data-dir", DATA, "--out", OUT, "--vocab-size", "300"]))
"""

HINT = (
    "wait for it to end, or use another --out; if that process is gone, the lease is taken over at once on its "
    "own host, else once it is 120 s without renewal"
)


def _code(template: str, **paths: Path) -> str:
    return "".join(f"{name} = {str(path)!r}\n" for name, path in paths.items()) + template


def _files(out: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(out.iterdir())}


def _refusals(out: Path, flags: Path, pid: int, suffix: str = "") -> set[str]:
    """The refusal of a second start while the held process `pid` holds <out>/lease.json, for the few seconds
    it may have held it ("renewed N s ago")."""
    holder = json.loads((out / "lease.json").read_text())
    assert (holder["pid"], holder["host"]) == (pid, socket.gethostname())
    assert holder["command"] == shlex.join(["-c", str(flags), "hold"])  # the held process's sys.argv
    started = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(holder["started_at"]))
    return {
        f"the run is already running: {out}/lease.json is held by pid {pid} on {socket.gethostname()}, started "
        f"{started}, renewed {n} s ago ({holder['command']}); {HINT}{suffix}\n"
        for n in range(3)
    }


def _second_is_refused(
    argv: list[str], prog: str, out: Path, flags: Path, first: Held, capsys, suffix=""
) -> None:
    """`raychat <argv>` while `first` holds <out>/lease.json exits 2 with the refusal (_refusals) after
    "<prog>: error: ", and leaves `out` as it was."""
    before = _files(out)
    refusals = _refusals(out, flags, first.proc.pid, suffix)
    capsys.readouterr()
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"{prog}: error: ") and err.removeprefix(f"{prog}: error: ") in refusals, err
    assert _files(out) == before


@pytest.fixture
def source(tmp_path) -> Path:
    src = tmp_path / "src"
    src.mkdir()
    for i, text in enumerate(DOCS):
        (src / f"{i:02d}.txt").write_text(text)
    return src


def _assert_prepared(out: Path, train_shards: int) -> None:
    """`out` holds exactly a finished data directory of `train_shards` train shards + validation with every
    document once: no lease, no leftover, no other run's shard."""
    names = [f"shard_{i:05d}.parquet" for i in range(train_shards + 1)]
    assert sorted(p.name for p in out.iterdir()) == ["manifest.json", *names]
    train, val = list_shards(out, verify=True)
    assert [Path(f).name for f in [*train, val]] == names
    texts = [t for f in [*train, val] for t in pq.read_table(f).column("text").to_pylist()]
    assert sorted(texts) == sorted(DOCS)


def test_a_second_prepare_into_a_live_ones_out_is_refused_and_the_first_finishes(source, tmp_path, capsys):
    """The second prepare (other options: 1 train shard where the first writes 2) would have deleted the first's
    live temporary of shard_00001 and written a 2-shard manifest beside the first's shards."""
    out = tmp_path / "out"
    flags = tmp_path / "first"
    first = Held(_code(PREPARE_STOPPED_IN_A_SHARD, SRC=source, OUT=out), flags)
    try:
        before = _files(out)
        (temporary,) = [n for n in before if is_leftover(n)]
        assert sorted(before) == sorted(["lease.json", "shard_00000.parquet", temporary])
        assert temporary.startswith(".shard_00001.parquet.")
        argv = ["data", "prepare", "--source", str(source), "--out", str(out), "--num-shards", "1"]
        _second_is_refused(argv, "raychat data prepare", out, flags, first, capsys)
        status, printed = first.go()
    finally:
        first.proc.kill()
        first.proc.wait()
    assert status == 0, printed
    assert f"prepared {out}: 12 documents" in printed
    _assert_prepared(out, train_shards=2)


def test_a_killed_prepares_lease_is_taken_over(source, tmp_path, capsys):
    """A prepare killed (SIGKILL) inside its write leaves its lease behind; the next prepare takes it over at once
    (its pid is gone on this host), removes the killed run's temporary and shards and finishes."""
    out = tmp_path / "out"
    run_killed(_code(PREPARE_STOPPED_IN_A_SHARD, SRC=source, OUT=out), tmp_path / "killed")
    dead = json.loads((out / "lease.json").read_text())["pid"]
    capsys.readouterr()
    assert main(["data", "prepare", "--source", str(source), "--out", str(out), "--num-shards", "1"]) == 0
    printed = capsys.readouterr().out
    assert (
        f"run lease: taking over {out}/lease.json: its holder, pid {dead} on this host ({socket.gethostname()}), "
        "is gone\n"
    ) in printed
    _assert_prepared(out, train_shards=1)


def test_a_lock_file_left_by_a_killed_prepare_does_not_block_the_rerun(source, tmp_path):
    """A prepare killed (SIGKILL) while it held the lease's lock leaves <out>/.lease.json.lock beside its shards
    (its manifest removed as it started): the rerun refused the directory as holding other files."""
    out = tmp_path / "out"
    argv = ["data", "prepare", "--source", str(source), "--out", str(out), "--num-shards", "1"]
    assert main(argv) == 0
    (out / "manifest.json").unlink()
    (out / ".lease.json.lock").write_bytes(b"")
    assert main(argv) == 0
    _assert_prepared(out, train_shards=1)


def test_a_lock_file_left_by_a_killed_tokenizer_train_does_not_block_the_rerun(tmp_path):
    """The same of a tokenizer train: its out held tokenizer.json and the lock file, and was refused."""
    data, out = tmp_path / "data", tmp_path / "tok"
    write_manifest(data, {"source": "test", "shards": write_shards(DOCS * 4, data, 2, log=lambda *_: None)})
    argv = ["tokenizer", "train", "--data-dir", str(data), "--out", str(out), "--vocab-size", "280"]
    assert main(argv) == 0
    (out / ".lease.json.lock").write_bytes(b"")
    assert main(argv) == 0
    assert sorted(p.name for p in out.iterdir()) == ["tokenizer.json"]


def test_a_second_tokenizer_train_into_a_live_ones_out_is_refused_and_the_first_finishes(tmp_path, capsys):
    """The second (another vocabulary size) would have deleted the first's live tokenizer.json temporary (the first
    then failed at its rename) and saved its own tokenizer there."""
    data, out = tmp_path / "data", tmp_path / "tok"
    write_manifest(data, {"source": "test", "shards": write_shards(DOCS * 4, data, 2, log=lambda *_: None)})
    flags = tmp_path / "first"
    first = Held(_code(TOKENIZER_STOPPED_IN_ITS_SAVE, DATA=data, OUT=out), flags)
    try:
        before = _files(out)
        (temporary,) = [n for n in before if is_leftover(n)]
        assert sorted(before) == sorted(["lease.json", temporary])
        argv = ["tokenizer", "train", "--data-dir", str(data), "--out", str(out), "--vocab-size", "280"]
        suffix = "  (RAYCHAT_DEBUG=1 shows the traceback)"
        _second_is_refused(argv, "raychat tokenizer train", out, flags, first, capsys, suffix)
        status, printed = first.go()
    finally:
        first.proc.kill()
        first.proc.wait()
    assert status == 0, printed
    assert sorted(p.name for p in out.iterdir()) == ["tokenizer.json"]
    assert Tokenizer.load(out).asked_vocab_size == 300


def test_a_killed_tokenizer_trains_lease_is_taken_over(tmp_path, capsys):
    """A tokenizer train killed inside its save leaves its lease and temporary; the next run takes the lease over,
    removes the temporary and saves its own tokenizer."""
    data, out = tmp_path / "data", tmp_path / "tok"
    write_manifest(data, {"source": "test", "shards": write_shards(DOCS * 4, data, 2, log=lambda *_: None)})
    run_killed(_code(TOKENIZER_STOPPED_IN_ITS_SAVE, DATA=data, OUT=out), tmp_path / "killed")
    dead = json.loads((out / "lease.json").read_text())["pid"]
    capsys.readouterr()
    assert (
        main(["tokenizer", "train", "--data-dir", str(data), "--out", str(out), "--vocab-size", "280"]) == 0
    )
    assert (
        f"run lease: taking over {out}/lease.json: its holder, pid {dead} on this host ({socket.gethostname()}), "
        "is gone\n"
    ) in capsys.readouterr().out
    assert sorted(p.name for p in out.iterdir()) == ["tokenizer.json"]
    assert Tokenizer.load(out).asked_vocab_size == 280


@pytest.mark.parametrize("command", ["data", "tokenizer"])
def test_an_output_placed_by_run_name_is_refused_naming_run_name(command, source, tmp_path, capsys):
    """Under --storage-path/--run-name the refusal says to use another --run-name (the output's flag)."""
    root = tmp_path / "root"
    data = tmp_path / "data"
    write_manifest(data, {"source": "test", "shards": write_shards(DOCS * 4, data, 2, log=lambda *_: None)})
    argv = {
        "data": ["data", "prepare", "--source", str(source), "--num-shards", "1"],
        "tokenizer": ["tokenizer", "train", "--data-dir", str(data), "--vocab-size", "280"],
    }[command]
    with output_lease(root / "out", "--run-name") as held:
        held_by = held.holder
        capsys.readouterr()
        assert main([*argv, "--storage-path", str(root), "--run-name", "out"]) == 2
        assert sorted(p.name for p in (root / "out").iterdir()) == ["lease.json"]
    started = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(held_by.started_at))
    err = capsys.readouterr().err
    prefix = {"data": "raychat data prepare: error: ", "tokenizer": "raychat tokenizer train: error: "}[
        command
    ]
    suffix = {"data": "\n", "tokenizer": "  (RAYCHAT_DEBUG=1 shows the traceback)\n"}[command]
    assert err == (
        f"{prefix}the run is already running: {root}/out/lease.json is held by pid {held_by.pid} on "
        f"{socket.gethostname()}, started {started}, renewed 0 s ago ({held_by.command}); wait for it to end, or "
        "use another --run-name; if that process is gone, the lease is taken over at once on its own host, else "
        f"once it is 120 s without renewal{suffix}"
    )
