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

from raychat.checkpoint_manager import CACHE_UNUSED_S, IN_USE_MARK_S, SNAPSHOT_UNUSED_S, mark_in_use

log = logging.getLogger(__name__)


class MarkInUse:
    """Marks `directory` (a snapshot, or a cached copy of a remote checkpoint) in use (mark_in_use) now and
    then every `every_s` seconds from a daemon thread, until stop() or until this object is garbage collected
    (with the replica that holds it). A mark that fails is logged as a warning (once, until one succeeds
    again) and tried again at the next period; nothing is raised."""

    def __init__(self, directory: str, every_s: float = IN_USE_MARK_S):
        self.directory, self._stop = directory, threading.Event()
        failing = _mark(directory, False)
        self._thread = threading.Thread(
            target=_mark_every,
            args=(directory, every_s, self._stop, failing),
            daemon=True,
            name="mark-in-use",
        )
        self._thread.start()
        weakref.finalize(self, self._stop.set)  # the thread holds no reference to self

    def stop(self) -> None:
        """Stop marking; returns once the thread has ended."""
        self._stop.set()
        self._thread.join()


def _mark_every(directory: str, every_s: float, stop: threading.Event, failing: bool) -> None:
    while not stop.wait(every_s):
        failing = _mark(directory, failing)


def _mark(directory: str, failing: bool) -> bool:
    """mark_in_use(directory); returns whether it failed, warning when it starts failing."""
    try:
        mark_in_use(directory)
        return False
    except OSError as e:
        if not failing:
            log.warning(
                "%s: cannot mark it in use (%s); unmarked for %g h, it may be deleted (the run's next snapshot, "
                "or the next resolve of a new commit of its remote checkpoint)",
                directory,
                e,
                min(SNAPSHOT_UNUSED_S, CACHE_UNUSED_S) / 3600,
            )
        return True
