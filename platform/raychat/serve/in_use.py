"""A served directory marked in use for as long as its server runs: each ChatIngress and ChatServer replica of
an app that serves a run's snapshot (<run>/served/, raychat.checkpoint_manager.snapshot_checkpoint) holds a
MarkInUse, so the next snapshot of that run (remove_unused_snapshots) keeps it for the replicas that Serve
starts later. The ingress keeps marking while ChatServer is scaled to zero; the replicas mark where the
ingress' node does not see the run directory (a directory only the deploying node has). A ChatServer of a
remote checkpoint holds one on its node's cached copy (raychat.checkpoint_manager.resolve_checkpoint), which
its engine process loads again when it restarts, so a later resolve of a new commit of that checkpoint
(remove_unused_versions) keeps it."""

from __future__ import annotations

import logging
import threading
import weakref

from raychat.checkpoint_manager import CACHE_UNUSED_S, SNAPSHOT_MARK_S, SNAPSHOT_UNUSED_S, mark_snapshot_used

log = logging.getLogger(__name__)


class MarkInUse:
    """Marks the directory `snapshot` (a snapshot, or a cached copy of a remote checkpoint) in use
    (mark_snapshot_used) now and then every `every_s` seconds from a daemon thread, until stop() or until this
    object is garbage collected (with the replica that holds it). A mark that fails is logged as a warning
    (once, until one succeeds again) and tried again at the next period; nothing is raised."""

    def __init__(self, snapshot: str, every_s: float = SNAPSHOT_MARK_S):
        self.snapshot, self._stop = snapshot, threading.Event()
        failing = _mark(snapshot, False)
        self._thread = threading.Thread(
            target=_mark_every, args=(snapshot, every_s, self._stop, failing), daemon=True, name="mark-in-use"
        )
        self._thread.start()
        weakref.finalize(self, self._stop.set)  # the thread holds no reference to self

    def stop(self) -> None:
        """Stop marking; returns once the thread has ended."""
        self._stop.set()
        self._thread.join()


def _mark_every(snapshot: str, every_s: float, stop: threading.Event, failing: bool) -> None:
    while not stop.wait(every_s):
        failing = _mark(snapshot, failing)


def _mark(snapshot: str, failing: bool) -> bool:
    """mark_snapshot_used(snapshot); returns whether it failed, warning when it starts failing."""
    try:
        mark_snapshot_used(snapshot)
        return False
    except OSError as e:
        if not failing:
            log.warning(
                "%s: cannot mark it in use (%s); unmarked for %g h, it may be deleted (the run's next snapshot, "
                "or the next resolve of a new commit of its remote checkpoint)",
                snapshot,
                e,
                min(SNAPSHOT_UNUSED_S, CACHE_UNUSED_S) / 3600,
            )
        return True
