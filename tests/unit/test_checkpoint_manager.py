"""raychat.checkpoint_manager: a checkpoint exists once its commit marker is written last; `newest` is the highest
committed step; a crash mid-save is never loaded, and the next save cleans it up; nothing outside the storage
root is ever written, renamed or deleted."""

from __future__ import annotations

import errno
import fcntl
import gc
import hashlib
import json
import os
import re
import shutil
import threading
import time
from pathlib import Path

import pytest
from support.stopped_writer import Held, age, run_killed
from test_checkpointer import tiny_model

import raychat.checkpoint_manager as cm
from raychat.atomic import STAGING_IDLE_S, is_leftover, remove_leftovers
from raychat.checkpoint import check_model, load_model, read_meta, save_model
from raychat.checkpoint_manager import (
    COMMIT_FILE,
    SNAPSHOT_UNUSED_S,
    CheckpointError,
    CheckpointManager,
    checkpoint_gone,
    find_checkpoint,
    is_run_checkpoint,
    mark_in_use,
    resolve_checkpoint,
    snapshot_checkpoint,
)
from raychat.config import ConfigError
from raychat.serve.in_use import MarkInUse
from raychat.storage import open_storage


def part(directory: Path, files: dict[str, bytes]) -> Path:
    """A rank's local part of a checkpoint: `files` written under `directory`."""
    directory.mkdir(parents=True, exist_ok=True)
    for name, data in files.items():
        (directory / name).write_bytes(data)
    return directory


def save(manager: CheckpointManager, tmp: Path, step: int, ranks: int = 2) -> str:
    """Checkpoint `step` as the training stages save it: prepare, every rank uploads its part, then commit."""
    manager.prepare(step)
    parts = []
    for r in range(ranks):
        local = part(tmp / f"s{step}r{r}", {f"state_rank{r}.npz": f"rank {r} at {step}".encode()})
        if r == 0:
            part(local, {"model.safetensors": b"w" * step, "meta.json": json.dumps({"step": step}).encode()})
        parts.append(manager.upload(local, step))
    return manager.commit(step, parts, "pretrain")


def tree(root: Path) -> dict[str, str]:
    """{relative path: sha256} of every file under root (what 'nothing else was touched' compares)."""
    return {p.relative_to(root).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}  # fmt: skip


def test_the_commit_marker_lists_every_ranks_files_and_is_written_last(tmp_path):
    storage = open_storage(tmp_path / "runs")
    manager = CheckpointManager(storage, "run", keep=3)
    manager.prepare(4)
    rank1 = manager.upload(part(tmp_path / "r1", {"state_rank1.npz": b"one"}), 4)
    assert manager.newest() is None  # uploaded, not committed: no reader takes it
    rank0 = manager.upload(
        part(tmp_path / "r0", {"model.safetensors": b"w" * 10, "state_rank0.npz": b"zero"}), 4
    )
    uri = manager.commit(4, [rank0, rank1], "sft")
    assert uri == str(tmp_path / "runs" / "run" / "checkpoint_000004")
    commit = json.loads((Path(uri) / COMMIT_FILE).read_text())
    assert (commit["format"], commit["step"], commit["stage"]) == (1, 4, "sft")
    assert commit["files"] == {
        "model.safetensors": {"size": 10, "sha256": hashlib.sha256(b"w" * 10).hexdigest()},
        "state_rank0.npz": {"size": 4, "sha256": hashlib.sha256(b"zero").hexdigest()},
        "state_rank1.npz": {"size": 3, "sha256": hashlib.sha256(b"one").hexdigest()},
    }
    assert (manager.newest().step, manager.newest().path) == (4, uri)
    with pytest.raises(ValueError, match=r"\['state_rank1.npz'\] uploaded by two ranks"):
        manager.commit(4, [rank1, rank1], "sft")


def test_newest_and_pruning_go_by_step_not_by_name(tmp_path):
    # checkpoint_1000000 sorts before checkpoint_999999 as a name; the step decides
    manager = CheckpointManager(open_storage(tmp_path / "runs"), "long", keep=1)
    save(manager, tmp_path, 999_999)
    save(manager, tmp_path, 1_000_000)
    assert [p.name for p in (tmp_path / "runs" / "long").iterdir()] == ["checkpoint_1000000"]
    assert find_checkpoint("long", tmp_path / "runs").endswith("/long/checkpoint_1000000")


def test_a_pruned_checkpoint_is_gone_and_an_unreadable_reference_is_not_said_to_be(tmp_path):
    manager = CheckpointManager(open_storage(tmp_path / "runs"), "run", keep=1)
    first = save(manager, tmp_path, 1)
    assert not checkpoint_gone(first)
    save(manager, tmp_path, 2)  # keep=1: checkpoint 1 is pruned
    assert checkpoint_gone(first) and not checkpoint_gone(manager.uri(2))
    assert not checkpoint_gone("ftp://host/run/checkpoint_000001")  # no storage to ask: nothing is known


def test_a_prune_stopped_halfway_leaves_no_checkpoint_that_looks_committed(tmp_path, monkeypatch):
    """Pruning deleted a committed checkpoint's directory with its commit marker still in it: a delete that
    stopped halfway (a crash, an object store's partial delete) left files missing under a marker that says
    the checkpoint is whole. The marker now goes first."""
    manager = CheckpointManager(open_storage(tmp_path / "runs"), "run", keep=1)
    first = Path(save(manager, tmp_path, 1))
    manager.keep = 0  # the next save prunes nothing
    save(manager, tmp_path, 2)

    def stops_halfway(storage, path):
        raise OSError(f"{path}: connection reset")

    monkeypatch.setattr(cm, "delete_dir", stops_halfway)
    manager.keep = 1
    with pytest.raises(OSError, match="connection reset"):
        manager.prune()
    assert [c.step for c in manager.committed()] == [2]
    assert not (first / COMMIT_FILE).exists() and (first / "model.safetensors").exists()
    monkeypatch.undo()
    assert manager.prune() == [str(first)] and not first.exists()


def test_a_snapshot_of_a_runs_checkpoint_outlives_its_pruning_and_is_reused(tmp_path):
    manager = CheckpointManager(open_storage(tmp_path / "runs"), "run", keep=1)
    first = save(manager, tmp_path, 1)
    assert is_run_checkpoint(first) and not is_run_checkpoint("s3://b/run/checkpoint_000001")
    commit = (Path(first) / COMMIT_FILE).read_bytes()
    snap = snapshot_checkpoint(first)
    assert (
        snap == tmp_path / "runs/run/served" / f"checkpoint_000001-{hashlib.sha256(commit).hexdigest()[:12]}"
    )
    assert not is_run_checkpoint(str(snap))  # serving the snapshot itself takes no snapshot of it
    weights = snap / "model.safetensors"
    assert weights.stat().st_ino == (Path(first) / "model.safetensors").stat().st_ino  # a hard link
    assert sorted(os.listdir(snap.parent)) == [snap.name]  # no temporary left beside it
    assert (
        snapshot_checkpoint(first) == snap
        and weights.stat().st_ino == snap.joinpath(weights.name).stat().st_ino
    )
    before = tree(Path(first))
    save(manager, tmp_path, 2)  # keep=1: checkpoint 1 is pruned, its snapshot is not
    assert checkpoint_gone(first) and tree(snap) == before
    assert find_checkpoint(str(snap)) == str(snap)
    assert [c.step for c in manager.committed()] == [2] and manager.prune() == []


def test_a_snapshot_copies_where_links_are_refused_and_refuses_a_damaged_checkpoint(tmp_path, monkeypatch):
    manager = CheckpointManager(open_storage(tmp_path / "runs"), "run")
    first = Path(save(manager, tmp_path, 1))

    def no_links(src, dst):
        raise OSError(errno.EXDEV, "Invalid cross-device link")

    monkeypatch.setattr(os, "link", no_links)
    snap = snapshot_checkpoint(first)
    assert (
        tree(snap) == tree(first)
        and snap.joinpath("meta.json").stat().st_ino != first.joinpath("meta.json").stat().st_ino
    )
    monkeypatch.undo()
    second = Path(save(manager, tmp_path, 2))
    (second / "state_rank1.npz").write_bytes(b"cut")  # damaged after its commit: no snapshot of it
    with pytest.raises(
        CheckpointError, match=r"checkpoint_000002: state_rank1.npz has 3 bytes, committed with"
    ):
        snapshot_checkpoint(second)
    assert [p.name for p in (first.parent / "served").iterdir()] == [snap.name]


def test_the_runs_next_snapshot_deletes_snapshots_unused_for_a_day_and_nothing_else(tmp_path, monkeypatch):
    """Each `raychat serve` of a newer checkpoint of a training run added a snapshot in <run>/served/ that nothing
    deleted: once its checkpoint was pruned, a full copy's space for ever. The run's next snapshot deletes those
    no app has marked in use (mark_in_use) for SNAPSHOT_UNUSED_S; one marked within it stays, the one
    being made or reused stays (also when it was unused that long), and so do a link named like a snapshot
    (its target outside too) and any other name."""
    manager = CheckpointManager(open_storage(tmp_path / "runs"), "run", keep=1)
    first, second = (
        snapshot_checkpoint(save(manager, tmp_path, 1)),
        snapshot_checkpoint(save(manager, tmp_path, 2)),
    )
    third = save(manager, tmp_path, 3)  # keep=1: only checkpoint 3 is left, snapshots 1 and 2 hold 1 and 2
    served = first.parent
    outside = part(tmp_path / "outside", {"model.safetensors": b"theirs"})
    (served / "checkpoint_000009-0123456789ab").symlink_to(outside)
    (served / "mine").mkdir()
    for path in (first, served / "mine", outside):
        age(path, SNAPSHOT_UNUSED_S + 60)
    age(second, SNAPSHOT_UNUSED_S - 600)  # its app marked it last 23 h 50 min ago
    kept = tree(second)
    snap = snapshot_checkpoint(third)
    assert sorted(p.name for p in served.iterdir()) == sorted(
        [second.name, snap.name, "checkpoint_000009-0123456789ab", "mine"]
    )
    assert tree(second) == kept and tree(outside) == {
        "model.safetensors": hashlib.sha256(b"theirs").hexdigest()
    }
    # the snapshot being reused is marked first and stays, though unused for a day until now
    age(snap, SNAPSHOT_UNUSED_S + 60)
    age(second, SNAPSHOT_UNUSED_S + 60)
    inode = (snap / "model.safetensors").stat().st_ino
    assert snapshot_checkpoint(third) == snap and (snap / "model.safetensors").stat().st_ino == inode
    assert time.time() - snap.stat().st_mtime < 60
    assert sorted(p.name for p in served.iterdir()) == sorted(
        [snap.name, "checkpoint_000009-0123456789ab", "mine"]
    )
    # a server that marks a snapshot just as it is judged unused keeps it: it is looked at again once renamed
    again = snapshot_checkpoint(save(manager, tmp_path, 4))
    age(snap, SNAPSHOT_UNUSED_S + 60)
    files, real = tree(snap), cm.last_change

    def marked_meanwhile(path):
        seen = real(path)
        if Path(path) == snap:
            mark_in_use(snap)  # after the look, before the rename
        return seen

    monkeypatch.setattr(cm, "last_change", marked_meanwhile)
    assert cm.remove_unused_snapshots(served.parent, keep=again.name) == []
    assert sorted(p.name for p in served.iterdir()) == sorted(
        [snap.name, again.name, "checkpoint_000009-0123456789ab", "mine"]
    )
    assert tree(snap) == files
    monkeypatch.undo()
    age(snap, SNAPSHOT_UNUSED_S + 60)
    assert cm.remove_unused_snapshots(served.parent, keep=again.name) == [snap.name]


def test_a_snapshot_another_server_deletes_while_it_is_judged_unused_is_no_error(tmp_path, monkeypatch):
    """Two servers of one run start at once. One's remove_unused_snapshots renames a snapshot unused for a day
    to a leftover name to look at it again; the other's snapshot_checkpoint deletes that leftover just then (its
    files are idle for STAGING_IDLE_S). The first found it gone and failed its deploy (FileNotFoundError); it
    goes on now, and only the snapshot kept is left."""
    manager = CheckpointManager(open_storage(tmp_path / "runs"), "run", keep=1)
    unused = snapshot_checkpoint(save(manager, tmp_path, 1))
    kept = snapshot_checkpoint(save(manager, tmp_path, 2))
    age(unused, SNAPSHOT_UNUSED_S + 60)
    real = os.replace

    def replace(src, dst):
        real(src, dst)
        if Path(src) == unused:  # renamed away, not looked at again yet: the other server's first step
            assert remove_leftovers(unused.parent, idle_s=STAGING_IDLE_S) == [Path(dst).name]

    monkeypatch.setattr(cm.os, "replace", replace)
    assert cm.remove_unused_snapshots(unused.parent.parent, keep=kept.name) == []
    assert os.listdir(unused.parent) == [kept.name]


def test_a_served_snapshot_is_marked_in_use_until_its_holder_stops_or_is_gone(tmp_path):
    """MarkInUse, which every ingress and ChatServer replica serving a snapshot holds: it marks the snapshot at
    once and every `every_s`, and its thread ends with stop() or once the holder drops it (no thread left)."""
    snap = part(tmp_path / "run" / "served" / "checkpoint_000001-0123456789ab", {"meta.json": b"{}"})
    age(snap, SNAPSHOT_UNUSED_S + 60)
    marker = MarkInUse(str(snap), every_s=0.05)
    assert time.time() - snap.stat().st_mtime < 5
    for _ in range(2):  # marked again every 0.05 s
        age(snap, SNAPSHOT_UNUSED_S + 60)
        deadline = time.monotonic() + 5
        while time.time() - snap.stat().st_mtime > 60:
            assert time.monotonic() < deadline, "not marked again within 5 s"
            time.sleep(0.02)
    marker.stop()
    age(snap, SNAPSHOT_UNUSED_S + 60)
    time.sleep(0.2)
    assert time.time() - snap.stat().st_mtime > SNAPSHOT_UNUSED_S and not marker._thread.is_alive()
    thread = MarkInUse(str(snap), every_s=0.05)._thread  # dropped at once, as a replica that is gone
    gc.collect()
    thread.join(timeout=5)
    assert not thread.is_alive()
    assert not any(t.name == "mark-in-use" for t in threading.enumerate())


SNAPSHOT_STOPPED_BEFORE_ITS_RENAME = """
import raychat.checkpoint_manager as cm
real, calls = cm.verify, []
def verify(directory, *args, **kwargs):
    calls.append(directory)
    if len(calls) == 2:  # the staged snapshot, put together, before its rename
        stop()
    return real(directory, *args, **kwargs)
cm.verify = verify
print(cm.snapshot_checkpoint(sys.argv[3]))
"""


def test_a_killed_snapshots_staging_is_removed_and_a_live_one_keeps_the_snapshot_made_meanwhile(tmp_path):
    """A server killed while it snapshotted a checkpoint left `.checkpoint_000001-<hash>.<16 hex>` in served/
    for good: each one a full copy where hard links are refused. The next snapshot of that checkpoint removes
    it once it has been idle for STAGING_IDLE_S; the staging directory of a server snapshotting the same
    checkpoint right now stays, and that server finishes. An idle leftover of another checkpoint's snapshot (or
    of a stale snapshot whose deletion was killed) goes too: nothing else in served/ would ever remove it.
    The live server, finishing after the snapshot was made by the other, keeps that one (its replicas may be
    opening its files) and drops its own: it renamed it away, leaving served/ without it for a moment, before."""
    manager = CheckpointManager(open_storage(tmp_path / "runs"), "run")
    first = save(manager, tmp_path, 1)
    served = Path(first).parent / "served"
    code = SNAPSHOT_STOPPED_BEFORE_ITS_RENAME.replace("sys.argv[3]", repr(first))
    run_killed(code, tmp_path / "killed")
    (killed,) = served.iterdir()
    assert is_leftover(killed.name) and sorted(p.name for p in killed.iterdir()) == sorted(tree(Path(first)))
    age(killed, STAGING_IDLE_S + 60)
    other = served / ".checkpoint_000009-0123456789ab.0123456789abcdef"  # another checkpoint's, as old
    (other / "model.safetensors").parent.mkdir()
    (other / "model.safetensors").write_bytes(b"w")
    age(other, STAGING_IDLE_S + 60)
    recent = served / ".checkpoint_000009-0123456789ab.fedcba9876543210"  # another checkpoint's, live
    recent.mkdir()
    live = Held(code, tmp_path / "live")  # another server, its snapshot staged, not renamed yet
    (staging,) = set(served.iterdir()) - {killed, other, recent}
    snap = snapshot_checkpoint(first)
    assert sorted(p.name for p in served.iterdir()) == sorted([snap.name, staging.name, recent.name])
    made = snap.stat().st_ino
    assert live.go() == (0, f"{snap}\n")
    assert snap.stat().st_ino == made  # the snapshot made meanwhile, never renamed away
    assert sorted(p.name for p in served.iterdir()) == sorted([snap.name, recent.name])
    assert tree(snap) == tree(Path(first))


def test_a_crash_mid_save_is_never_loaded_and_the_next_save_cleans_it_up(tmp_path):
    runs = tmp_path / "runs"
    manager = CheckpointManager(open_storage(runs), "pre", keep=2)
    save(manager, tmp_path, 2)
    # step 4: rank 0's files reached storage (the weights truncated), rank 1 and the marker never did
    manager.prepare(4)
    manager.upload(part(tmp_path / "crash", {"model.safetensors": b"w" * 2, "meta.json": b'{"step": 4}'}), 4)
    old_layout = part(runs / "pre" / "checkpoint_2026-12-01_09-30-00.000002", {"meta.json": b'{"step": 99}'})
    committed = runs / "pre" / "checkpoint_000002"
    for ref in ("pre", "latest", f"{runs}/pre/latest", f"{runs}/pre"):
        assert find_checkpoint(ref, runs) == str(committed)
    with pytest.raises(CheckpointError, match=r"checkpoint_000004 is not committed \(no commit.json\)"):
        find_checkpoint(runs / "pre" / "checkpoint_000004")
    with pytest.raises(
        ValueError, match=r"has no committed checkpoint \(.* checkpoint_000001 \(uncommitted\)/"
    ):
        find_checkpoint(part(runs / "other" / "checkpoint_000001", {"meta.json": b"{}"}).parent)
    # the run goes on: the next commit removes the stale step-4 directory, never a directory of another name
    save(manager, tmp_path, 6)
    assert sorted(p.name for p in (runs / "pre").iterdir()) == sorted(
        ["checkpoint_000002", "checkpoint_000006", old_layout.name]
    )
    # a re-save of a step replaces everything an earlier attempt left there (here a rank of a larger world)
    part(runs / "pre" / "checkpoint_000008", {"state_rank3.npz": b"stale"})
    save(manager, tmp_path, 8)
    assert sorted(p.name for p in (runs / "pre" / "checkpoint_000008").iterdir()) == [
        COMMIT_FILE, "meta.json", "model.safetensors", "state_rank0.npz", "state_rank1.npz",
    ]  # fmt: skip
    assert [c.step for c in manager.committed()] == [6, 8]  # keep=2


def test_a_damaged_commit_marker_commits_nothing_and_is_named(tmp_path):
    """A marker that does not parse (empty, no step, not UTF-8, a size that is not an int) is skipped like a
    missing one, with a warning naming it: lookups, `latest` and pruning go on with the run's other
    checkpoints."""
    runs = tmp_path / "runs"
    manager = CheckpointManager(open_storage(runs), "run1", keep=2)
    save(manager, tmp_path, 2)
    damaged = {1: b"", 3: b'{"files": {}}', 5: b"\xff", 7: b'{"step": 7, "files": {"a": {"size": "1"}}}'}
    for step, marker in damaged.items():
        part(runs / "run1" / f"checkpoint_{step:06d}", {"meta.json": b"{}", COMMIT_FILE: marker})
    committed = str(runs / "run1" / "checkpoint_000002")
    with pytest.warns(UserWarning) as caught:
        for ref in ("run1", "latest", runs / "run1"):
            assert find_checkpoint(ref, runs) == committed
        assert [(c.step, c.path) for c in manager.committed()] == [(2, committed)]
    named = {str(w.message).split(": commit.json is unreadable")[0] for w in caught}
    assert named == {f"checkpoint {runs}/run1/checkpoint_{s:06d}" for s in damaged}
    # named directly, it is an error of one line naming the flag and the file
    for step, why in [
        (1, "JSONDecodeError"),
        (3, "KeyError('step')"),
        (5, "UnicodeDecodeError"),
        (7, "TypeError"),
    ]:
        with pytest.raises(
            CheckpointError,
            match=rf"^--checkpoint: checkpoint \S+_00000{step}: commit.json is unreadable \({re.escape(why)}",
        ):
            find_checkpoint(runs / "run1" / f"checkpoint_{step:06d}")
    # pruning reads the markers too; the damaged directories are not checkpoints
    with pytest.warns(UserWarning):
        save(manager, tmp_path, 4)
        assert [c.step for c in manager.committed()] == [2, 4]
    # like uncommitted leftovers: those older than the new commit are pruned, a newer one may be a save in progress
    assert sorted(p.name for p in (runs / "run1").iterdir()) == [
        "checkpoint_000002", "checkpoint_000004", "checkpoint_000005", "checkpoint_000007",
    ]  # fmt: skip


@pytest.mark.parametrize(
    "name", ["../../../outside.txt", "/etc/hostname", "a/../../b", "./meta.json", "a//b", "", "a\\b"]
)
def test_a_commit_marker_listing_a_file_outside_its_checkpoint_commits_nothing(tmp_path, name):
    """Every reader joins the marker's file names onto the checkpoint's directory, and a snapshot
    (snapshot_checkpoint, which `raychat serve` makes of a run's checkpoint) hard-links each of them: a marker
    from a shared volume that listed ../../../outside.txt passed verify, and the snapshot hard-linked that file,
    outside the storage root, to a path outside it too. Such a marker now commits nothing: named directly it is
    an error naming the checkpoint and the file; `latest` skips it with a warning; nothing is written."""
    runs = tmp_path / "runs"
    manager = CheckpointManager(open_storage(runs), "run", keep=3)
    save(manager, tmp_path, 1)
    ck = runs / "run" / "checkpoint_000002"
    part(ck, {"meta.json": b"{}"})
    (tmp_path / "outside.txt").write_bytes(b"precious")
    files = {"meta.json": {"size": 2, "sha256": hashlib.sha256(b"{}").hexdigest()},
             name: {"size": 8, "sha256": hashlib.sha256(b"precious").hexdigest()}}  # fmt: skip
    (ck / COMMIT_FILE).write_text(json.dumps({"format": 1, "step": 2, "stage": "pretrain", "files": files}))
    before = tree(tmp_path)
    said = f"commit.json lists {name!r}, not a path inside the checkpoint"
    with pytest.raises(CheckpointError, match=f"^checkpoint {ck}: {re.escape(said)}"):
        cm.verify(ck)
    with pytest.raises(CheckpointError, match=f"^checkpoint {ck}: {re.escape(said)}"):
        snapshot_checkpoint(ck)
    with pytest.raises(CheckpointError, match=f"^--checkpoint: checkpoint {ck}: {re.escape(said)}"):
        find_checkpoint(ck)
    with pytest.warns(UserWarning, match=re.escape(said)):
        assert find_checkpoint("latest", runs) == str(runs / "run" / "checkpoint_000001")
    assert tree(tmp_path) == before


def test_a_commit_marker_without_a_files_digest_is_named_not_a_key_error(tmp_path):
    ck = part(tmp_path / "runs" / "run" / "checkpoint_000001", {"meta.json": b"{}"})
    (ck / COMMIT_FILE).write_text(json.dumps({"step": 1, "files": {"meta.json": {"size": 2}}}))
    with pytest.raises(
        CheckpointError, match=rf"^checkpoint {ck}: commit.json is unreadable \(TypeError\(.*meta"
    ):
        cm.verify(ck, checksums=True)


def test_a_committed_copy_named_otherwise_is_not_one_of_the_runs_checkpoints(tmp_path):
    """checkpoint_<digits> names a run's checkpoints (is_run_checkpoint, which decides what `raychat serve`
    snapshots). A copy kept beside them under another name (checkpoint_best, checkpoint_000007.bak) was still
    counted as one because its name began with checkpoint_: pruning deleted checkpoint_best, served in place,
    and a copy of the newest step sorted after it, became `newest`, and pruning (keep 1) deleted the real one.
    Now such a copy is never picked by `latest` or a resume and never pruned; named directly, it loads."""
    runs = tmp_path / "runs"
    manager = CheckpointManager(open_storage(runs), "run", keep=1)
    save(manager, tmp_path, 1)
    best, bak = runs / "run" / "checkpoint_best", runs / "run" / "checkpoint_000007.bak"
    shutil.copytree(runs / "run" / "checkpoint_000001", best)
    assert find_checkpoint(best) == str(best) and not is_run_checkpoint(str(best))
    save(manager, tmp_path, 7)
    shutil.copytree(runs / "run" / "checkpoint_000007", bak)
    assert manager.newest().path == str(runs / "run" / "checkpoint_000007")
    save(manager, tmp_path, 9)
    assert sorted(p.name for p in (runs / "run").iterdir()) == [
        "checkpoint_000007.bak", "checkpoint_000009", "checkpoint_best",
    ]  # fmt: skip
    assert (
        find_checkpoint("latest", runs)
        == find_checkpoint("run", runs)
        == str(runs / "run" / "checkpoint_000009")
    )


def test_a_missing_top_level_directory_lists_the_root():
    with pytest.raises(ValueError, match=r"^--checkpoint: /no-such-raychat-dir does not exist \(/ holds: "):
        find_checkpoint("/no-such-raychat-dir")


def test_loading_checks_sizes_and_names_the_file(tmp_path, small_tokenizer):
    d = tmp_path / "ck"
    save_model(
        d, tiny_model(small_tokenizer.vocab_size), small_tokenizer, {"step": 3, "stage": "sft"}, commit=True
    )
    assert load_model(d)[2]["step"] == 3
    weights = d / "model.safetensors"
    size = weights.stat().st_size
    weights.write_bytes(weights.read_bytes()[: size // 2])
    with pytest.raises(CheckpointError) as e:
        load_model(d)
    assert str(e.value) == (
        f"checkpoint {d}: model.safetensors has {size // 2} bytes, committed with {size} (truncated or replaced)"
    )
    (d / COMMIT_FILE).unlink()
    with pytest.raises(CheckpointError, match="is not committed"):
        load_model(d)


def test_a_damaged_meta_or_weights_header_of_the_committed_size_is_named(tmp_path, small_tokenizer):
    """Damage the commit marker's sizes cannot see: load_model (and check_model, which reads no tensor) name
    the checkpoint and the file in one line instead of a JSON or safetensors error that names neither."""
    d = tmp_path / "ck"
    save_model(d, tiny_model(small_tokenizer.vocab_size), small_tokenizer, {"step": 3}, commit=True)
    meta, weights = d / "meta.json", d / "model.safetensors"
    good_meta, good_weights = meta.read_bytes(), weights.read_bytes()
    assert check_model(d)["step"] == 3
    meta.write_bytes(b"\0" * len(good_meta))
    for load in (check_model, load_model, read_meta):
        with pytest.raises(CheckpointError) as e:
            load(d)
        assert str(e.value) == (
            f"checkpoint {d}: meta.json is not valid JSON (Expecting value: line 1 column 1 (char 0))"
        )
    no_config = json.dumps({"step": 3}).encode()
    meta.write_bytes(no_config + b" " * (len(good_meta) - len(no_config)))
    with pytest.raises(CheckpointError) as e:
        load_model(d)
    assert str(e.value) == f"checkpoint {d}: meta.json has no valid model_config (KeyError('model_config'))"
    meta.write_bytes(good_meta)
    weights.write_bytes(b"\xff" * 8 + good_weights[8:])  # the header's length: past the file's end
    for load in (check_model, load_model):
        with pytest.raises(CheckpointError) as e:
            load(d)
        assert str(e.value) == (
            f"checkpoint {d}: model.safetensors is not a readable safetensors file (Error while deserializing "
            "header: header too large)"
        )


def test_no_run_name_reaches_the_root_or_outside_it(tmp_path):
    root = tmp_path / "runs"
    save(CheckpointManager(open_storage(root), "keep-me"), tmp_path, 1)
    (tmp_path / "outside.txt").write_text("precious")
    before = tree(tmp_path)
    storage = open_storage(root)
    for name in ("", ".", "..", "../escape", ".hidden", "a/b", "x y"):
        with pytest.raises(
            ConfigError, match=r"--run-name: .* is not a run name \(letters, digits and '._-'"
        ):
            CheckpointManager(storage, name)
    for path in (
        str(root),
        str(tmp_path),
        f"{root}/../outside.txt",
        f"{root}/a/../../outside.txt",
        f"{root}x/y",
    ):
        with pytest.raises(ValueError, match="is not below the storage root"):
            storage.inside(path)
    # a symbolic link below the root that leads out of it is refused; a root that is itself a link is not
    (root / "keep-me" / "away").symlink_to(tmp_path)
    with pytest.raises(ValueError, match=f"a symbolic link on the way leads to {tmp_path}/x: refused"):
        storage.inside(f"{root}/keep-me/away/x")
    (tmp_path / "mount").symlink_to(root)
    linked = open_storage(tmp_path / "mount")
    assert linked.inside(f"{tmp_path}/mount/keep-me/x") == f"{tmp_path}/mount/keep-me/x"
    (root / "keep-me" / "away").unlink()
    (tmp_path / "mount").unlink()
    assert tree(tmp_path) == before


def test_a_remote_checkpoint_is_checked_against_its_digests(tmp_path, s3_env):
    bucket = s3_env.make_bucket()
    storage = open_storage(f"s3://{bucket}/runs")
    manager = CheckpointManager(storage, "pre", keep=2)
    save(manager, tmp_path, 2)
    uri = save(manager, tmp_path, 5)
    assert uri == f"s3://{bucket}/runs/pre/checkpoint_000005"
    assert find_checkpoint("latest", storage) == uri
    got = resolve_checkpoint("pre", storage, cache_dir=tmp_path / "cache")
    assert (got / "model.safetensors").read_bytes() == b"w" * 5
    # the bucket's copy is replaced by other bytes of the same size: the download is refused, nothing cached
    with storage.fs.open_output_stream(f"{bucket}/runs/pre/checkpoint_000005/model.safetensors") as f:
        f.write(b"x" * 5)
    with pytest.raises(CheckpointError, match="model.safetensors differs from its committed sha256"):
        resolve_checkpoint("pre", storage, cache_dir=tmp_path / "other-cache")
    (lock,) = (tmp_path / "other-cache").iterdir()  # the fetch's flock file only: no copy, no staging
    assert (
        lock.name.startswith(".")
        and lock.name.endswith("-checkpoint_000005.lock")
        and lock.stat().st_size == 0
    )


READER_STOPPED_MID_READ = """
import json
from raychat.checkpoint_manager import resolve_checkpoint
d = resolve_checkpoint(REF, cache_dir=CACHE)
with open(os.path.join(d, "model.safetensors"), "rb") as f:
    weights = f.read(2)
    stop()  # the remote is committed again meanwhile, and resolved again
    weights += f.read()
with open(os.path.join(d, "meta.json"), "rb") as f:  # opened by its path once the weights are read
    meta = f.read()
print(json.dumps({"dir": str(d), "weights": weights.decode(), "meta": meta.decode()}))
"""


def test_a_remote_checkpoint_committed_again_goes_to_a_new_copy_beside_the_one_a_reader_reads(
    tmp_path, s3_env
):
    """A step committed again under the same name on S3 (a run restarted from an earlier step re-saves it)
    while a reader in another process (an eval, a serving replica) reads the node's cached copy: its files were
    replaced under it (renamed away and deleted, the new copy under the same name), so a file it opened next by
    its path was the new commit's (new meta.json beside the old weights). Now each commit has a copy of its own:
    the reader reads the old one whole, a second resolve gets the new one, and the old copy goes only once no
    resolve has returned it for CACHE_UNUSED_S (at the next resolve of that checkpoint)."""
    bucket = s3_env.make_bucket()
    manager = CheckpointManager(open_storage(f"s3://{bucket}/runs"), "pre")

    def commit_step_3(weights: bytes, meta: dict) -> str:
        manager.prepare(3)
        files = manager.upload(
            part(
                tmp_path / weights.decode(),
                {"model.safetensors": weights, "meta.json": json.dumps(meta).encode()},
            ),
            3,
        )
        return manager.commit(3, [files], "pretrain")

    uri = commit_step_3(b"old weights", {"run": "first"})
    cache = tmp_path / "cache"
    code = READER_STOPPED_MID_READ.replace("REF", repr(uri)).replace("CACHE", repr(str(cache)))
    reader = Held(code, tmp_path / "reader")
    assert commit_step_3(b"new weights", {"run": "restarted"}) == uri
    new = resolve_checkpoint(uri, cache_dir=cache)
    assert (new / "model.safetensors").read_bytes() == b"new weights"
    assert json.loads((new / "meta.json").read_text()) == {"run": "restarted"}
    status, out = reader.go()
    assert status == 0, out
    read = json.loads(out)
    assert (read["weights"], json.loads(read["meta"])) == ("old weights", {"run": "first"})
    old = Path(read["dir"])
    assert old != new and old.parent == new.parent == cache
    assert (old / "model.safetensors").read_bytes() == b"old weights"  # still there for its readers
    key = old.name.split("-")[0]
    assert sorted(p.name for p in cache.iterdir()) == sorted(
        [f".{key}-checkpoint_000003.lock", old.name, new.name]
    )
    age(old, cm.CACHE_UNUSED_S - 60)
    assert (
        resolve_checkpoint(uri, cache_dir=cache) == new and old.is_dir()
    )  # unused for less than a day: kept
    age(old, cm.CACHE_UNUSED_S + 60)
    assert resolve_checkpoint(uri, cache_dir=cache) == new
    assert sorted(p.name for p in cache.iterdir()) == sorted([f".{key}-checkpoint_000003.lock", new.name])
    assert (new / "model.safetensors").read_bytes() == b"new weights"
    # a tombstone (the copy renamed away by a remover killed before its delete) is never resolved: the copy
    # is fetched again under its own name, and the tombstone, idle for STAGING_IDLE_S, is deleted
    tomb = cache / f".{new.name}.{'e' * 16}"
    os.replace(new, tomb)
    age(tomb, STAGING_IDLE_S + 60)
    assert resolve_checkpoint(uri, cache_dir=cache) == new
    assert sorted(p.name for p in cache.iterdir()) == sorted([f".{key}-checkpoint_000003.lock", new.name])
    assert (new / "model.safetensors").read_bytes() == b"new weights"


def test_a_cached_copy_is_renamed_and_looked_at_again_before_it_is_deleted(tmp_path, monkeypatch):
    """remove_unused_versions deleted a cached copy of another commit unused for CACHE_UNUSED_S at once: a
    server marking it between that look and the delete (MarkInUse) lost the copy its engine reloads. Now each
    is renamed to a tombstone and looked at again: held between its look and its rename while the copy is
    marked, the remover renames it back. Plain case: the copies of that URI and name unused for a day go (the
    old one-copy-per-URI name too), the kept one, one marked within the day, another URI's, another
    checkpoint's and a link stay; no tombstone is left, and a killed remover's tombstone goes once idle
    STAGING_IDLE_S while a live fetch's staging stays."""
    cache, key, name = tmp_path / "cache", "0123456789abcdef", "checkpoint_000003"

    def copy(dirname: str) -> Path:
        return part(cache / dirname, {"model.safetensors": dirname.encode(), COMMIT_FILE: b"{}"})

    keep, unused, recent = (copy(f"{key}-{c * 12}-{name}") for c in "abc")
    legacy, other_uri = copy(f"{key}-{name}"), copy(f"fedcba9876543210-{'b' * 12}-{name}")
    other_step = copy(f"{key}-{'b' * 12}-checkpoint_000004")
    outside = part(tmp_path / "outside", {"model.safetensors": b"theirs"})
    (cache / f"{key}-{'d' * 12}-{name}").symlink_to(outside)
    for path in (keep, unused, legacy, other_uri, other_step, outside):
        age(path, cm.CACHE_UNUSED_S + 60)
    age(recent, cm.CACHE_UNUSED_S - 600)  # its server marked it last 23 h 50 min ago
    stays = sorted([keep.name, recent.name, other_uri.name, other_step.name, f"{key}-{'d' * 12}-{name}"])
    assert cm.remove_unused_versions(cache, key, name, keep=keep.name) == sorted([legacy.name, unused.name])
    assert sorted(os.listdir(cache)) == stays
    assert tree(outside) == {"model.safetensors": hashlib.sha256(b"theirs").hexdigest()}

    age(recent, cm.CACHE_UNUSED_S + 60)
    files, real, held = tree(recent), cm.fresh_dir, []

    def marked_meanwhile(target):  # the remover's step between its look and its rename
        tomb = real(target)
        if Path(target) == recent:
            held.append(tomb)
            mark_in_use(recent)  # the server's MarkInUse, just then
        return tomb

    monkeypatch.setattr(cm, "fresh_dir", marked_meanwhile)
    assert cm.remove_unused_versions(cache, key, name, keep=keep.name) == []
    assert held and held[0].parent == cache and is_leftover(held[0].name)  # it was renamed to a tombstone
    assert sorted(os.listdir(cache)) == stays and tree(recent) == files
    monkeypatch.undo()

    tomb = cache / f".{recent.name}.{'e' * 16}"  # a remover killed between its rename and its delete
    os.replace(recent, tomb)
    staging = copy(f".{keep.name}.{'f' * 16}")  # a live fetch's staging, written just now
    age(tomb, STAGING_IDLE_S + 60)
    assert cm.remove_unused_versions(cache, key, name, keep=keep.name) == []
    assert sorted(os.listdir(cache)) == sorted([*(set(stays) - {recent.name}), staging.name])


def test_idle_tombstones_of_every_uri_go_when_any_uri_is_resolved(tmp_path):
    """A killed remover's tombstone was deleted only by a later resolve of its own URI, so one of a URI never
    resolved again stayed forever. Now remove_unused_versions deletes the tombstones and stagings of every URI
    in the cache idle for STAGING_IDLE_S, another URI's under that URI's flock taken without waiting: one
    whose URI another process is resolving (its flock held), a fresh one and a link named like one stay."""
    cache, key, name = tmp_path / "cache", "0123456789abcdef", "checkpoint_000003"
    other, busy = "fedcba9876543210", "00112233aabbccdd"

    def copy(dirname: str, seconds: float) -> Path:
        path = part(cache / dirname, {"model.safetensors": dirname.encode(), COMMIT_FILE: b"{}"})
        age(path, seconds)
        return path

    keep = copy(f"{key}-{'a' * 12}-{name}", 0)
    gone = [
        copy(f".{other}-{'b' * 12}-{name}.{'e' * 16}", STAGING_IDLE_S + 60).name,  # another URI's
        copy(f".{other}-checkpoint_000007.{'e' * 16}", STAGING_IDLE_S + 60).name,  # one-copy-per-URI name
        copy(f".{key}-{'c' * 12}-{name}.{'e' * 16}", STAGING_IDLE_S + 60).name,  # this URI's
    ]
    fresh = copy(f".{other}-{'d' * 12}-{name}.{'e' * 16}", STAGING_IDLE_S - 600)
    held = copy(f".{busy}-{'b' * 12}-{name}.{'e' * 16}", STAGING_IDLE_S + 60)
    outside = copy("outside", STAGING_IDLE_S + 60)
    link = cache / f".{other}-{'f' * 12}-{name}.{'e' * 16}"
    link.symlink_to(outside)
    with open(cache / f".{busy}-{name}.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # another process resolving that URI
        assert cm.remove_unused_versions(cache, key, name, keep=keep.name) == []
    locks = {f".{other}-{name}.lock", f".{other}-checkpoint_000007.lock", f".{busy}-{name}.lock"}
    assert set(os.listdir(cache)) == {keep.name, fresh.name, held.name, outside.name, link.name, *locks}
    assert not set(gone) & set(os.listdir(cache))
    assert tree(outside) == {"model.safetensors": hashlib.sha256(b"outside").hexdigest(),
                             COMMIT_FILE: hashlib.sha256(b"{}").hexdigest()}  # fmt: skip
    assert cm.remove_unused_versions(cache, key, name, keep=keep.name) == []  # its resolver is done
    assert held.name not in os.listdir(cache) and fresh.is_dir() and link.is_symlink()


def test_a_live_servers_cached_copy_survives_new_commits_past_cache_unused_s(tmp_path, s3_env):
    """A serving replica resolves a remote checkpoint once, at start, and its engine process loads the
    node's cached copy again by path each time it restarts. A new commit of that checkpoint resolved more
    than CACHE_UNUSED_S later deleted that copy under it (nothing had marked it since its resolve), so the
    engine's next restart failed. Now the server marks its copy in use every IN_USE_MARK_S (MarkInUse,
    which ChatServer.from_checkpoint holds: tests/unit/test_engine_process.py): that copy stays, an unmarked
    copy of another commit as old goes, and the copy goes too once its marker stopped a day ago."""
    bucket = s3_env.make_bucket()
    manager = CheckpointManager(open_storage(f"s3://{bucket}/runs"), "pre")
    cache = tmp_path / "cache"

    def commit_and_resolve(weights: bytes) -> Path:
        manager.prepare(3)
        files = manager.upload(part(tmp_path / weights.decode(), {"model.safetensors": weights}), 3)
        return resolve_checkpoint(manager.commit(3, [files], "pretrain"), cache_dir=cache)

    served = commit_and_resolve(b"served")
    marker = MarkInUse(str(served), every_s=0.05)  # as the replica's ChatServer holds it
    unmarked = commit_and_resolve(b"unmarked")  # resolved once by a reader long gone
    for copy in (served, unmarked):
        age(copy, cm.CACHE_UNUSED_S + 60)
    deadline = time.monotonic() + 5
    while time.time() - served.stat().st_mtime > 60:  # the marker's next period, a day after the resolve
        assert time.monotonic() < deadline, "not marked again within 5 s"
        time.sleep(0.02)
    newest = commit_and_resolve(b"newest")
    assert sorted(p.name for p in cache.iterdir() if p.is_dir()) == sorted([served.name, newest.name])
    assert (served / "model.safetensors").read_bytes() == b"served"
    marker.stop()
    age(served, cm.CACHE_UNUSED_S + 60)
    assert resolve_checkpoint(f"s3://{bucket}/runs/pre/checkpoint_000003", cache_dir=cache) == newest
    assert [p.name for p in cache.iterdir() if p.is_dir()] == [newest.name]
