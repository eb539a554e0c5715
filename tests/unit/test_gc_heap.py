"""raychat.gc_heap: start-up garbage collected, the rest frozen out of the cyclic GC's scans."""

from __future__ import annotations

import gc
import weakref

from raychat.gc_heap import freeze_gc_heap


class Node:
    def __init__(self):
        self.other = None


def test_freeze_collects_start_up_garbage_then_freezes_what_is_alive():
    gc.unfreeze()
    try:
        cycle = Node()
        cycle.other = Node()
        cycle.other.other = cycle  # garbage only a collection frees
        gone = weakref.ref(cycle)
        del cycle
        kept = [Node() for _ in range(1000)]
        frozen = freeze_gc_heap()
        assert gone() is None  # collected before the freeze, not frozen with the rest
        # frozen objects whose reference count drops to zero still leave (another thread of this process, e.g.
        # one that ends, may free some right now): the count only falls after the freeze
        assert frozen >= gc.get_freeze_count() >= len(kept)
        assert not any(o is kept for o in gc.get_objects())  # collections no longer walk it
        later = [Node()]
        assert any(o is later for o in gc.get_objects())  # what is made afterwards is scanned as before
    finally:
        gc.unfreeze()
