"""Freezing the Python heap once a long-running process has started: the cyclic GC then scans only what the
process makes afterwards.

CPython's cyclic garbage collector now and then runs a full collection that walks every tracked object. In
a process that has imported torch and loaded a model that is ~170,000 objects, none of which ever becomes
garbage. Measured here (bench/gc_pauses.py: one thread, 8 streams decoding continuously, 2,500 steps): one
full collection, 78-105 ms over three runs, a stall of every stream's next token; it came soon after
start-up, later ones only each time the objects surviving since reach a quarter of the heap. With the heap
frozen, the collections of those steps took 0.5-1.5 ms in all, the longest 0.2-0.4 ms
(bench/results/decode_overhead.md). `gc.freeze()` moves every object alive
at that moment to a permanent generation that collections skip; objects made later are collected as
before. vLLM freezes its heap the same way after start-up (`freeze_gc_heap`), and nanochat's training loop
after its first step.
"""

from __future__ import annotations

import gc


def freeze_gc_heap() -> int:
    """Collect the garbage of start-up, then freeze every object alive now (gc.freeze).

    Call once a process has loaded what it keeps for its lifetime (a serving replica or rollout actor after
    its model, a training loop after its first step). Calling again freezes what was made since. Frozen
    objects are never scanned again: a reference cycle among them that later becomes unreachable is not
    freed (objects whose reference count drops to zero still are).

    Returns:
        The number of objects in the permanent generation (gc.get_freeze_count()).
    """
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()
