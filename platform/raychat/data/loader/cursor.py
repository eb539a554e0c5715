"""The global data cursor: one ordered stream of items that does not depend on the number of workers.

The stream. Item g (an int) is position p = g % N of epoch e = g // N, where N is the number of items in an
epoch (documents of the training shards, or examples of the SFT mixture) and each epoch has its own order,
drawn from the seed (`epoch_permutation`; pretraining: raychat.data.loader.document_order). The stream is endless:
epoch e + 1 starts right after the last item of epoch e, so every item is in the stream once per epoch.

A deal spreads the stream over one world of W ranks:

    S = pending ++ [frontier, frontier + 1, ...]      rank r takes S[r], S[r + W], S[r + 2W], ...

Each element of S is a reference (g, offset): offset 0 is the whole item; offset k > 0 (only in `pending`) is
the tail of document g from token k on, a split piece that was waiting in a packer buffer (raychat.data.loader.packing).
The deal (W, frontier, pending) is the same on every rank; a rank's own position is `taken`, how many elements
of its share it has handed to its packer. Nothing else is needed to find any rank's next item.

Resuming on the same W: every rank continues its share from `taken` and refills its packer buffer with the
pieces it held, in the same order, so the run continues bit for bit. Resuming on W' != W (`redeal`): the
states of all old ranks are merged into one new deal of width W':

    pending'  = sorted(holes ++ old pending beyond the furthest taken element ++ every old rank's buffered pieces)
    frontier' = the old frontier moved past every element any rank took

where the holes are the elements of S before the furthest taken one that their rank had not reached yet
(ranks take items at slightly different rates). So no item is repeated or skipped and buffered pieces are
dealt again, not lost; the new ranks start with empty buffers. pending' holds O(W x (buffer size + the
ranks' drift)) references, small next to the stream.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

Ref = tuple[int, int]  # (stream item g, token offset)


def epoch_permutation(n: int, seed: int, epoch: int, *key: int) -> np.ndarray:
    """The order of n things in `epoch`: a permutation of range(n) (int64) from numpy's PCG64 seeded with
    SeedSequence([seed, epoch, *key]); the same arguments give the same order on every machine."""
    return np.random.default_rng([seed, epoch, *key]).permutation(n)


@dataclass(frozen=True)
class Deal:
    """How the stream is spread over one world (see the module docstring).

    Args:
        world: W, the number of ranks.
        frontier: first stream item not yet dealt through `pending`.
        pending: references dealt before the frontier, in stream order.
    """

    world: int
    frontier: int = 0
    pending: tuple[Ref, ...] = ()

    def __post_init__(self):
        if self.world < 1:
            raise ValueError(f"world must be >= 1, got {self.world}")

    def element(self, j: int) -> Ref:
        """S[j]: the j-th reference of the dealt sequence."""
        n = len(self.pending)
        return self.pending[j] if j < n else (self.frontier + j - n, 0)

    def share(self, rank: int, start: int, count: int) -> list[Ref]:
        """Elements start .. start+count-1 of rank's share: S[rank + k * world] for those k."""
        return [self.element(rank + k * self.world) for k in range(start, start + count)]

    def to_dict(self) -> dict:
        return {"world": self.world, "frontier": self.frontier, "pending": [list(r) for r in self.pending]}

    @classmethod
    def from_dict(cls, d: Mapping) -> Deal:
        return cls(int(d["world"]), int(d["frontier"]), tuple((int(g), int(o)) for g, o in d["pending"]))


def redeal(deal: Deal, taken: Sequence[int], buffers: Sequence[Sequence[Ref]], world: int) -> Deal:
    """The deal of width `world` that continues where every rank of `deal` stopped.

    Args:
        deal: the old world's deal (the same on all its ranks).
        taken: per old rank r (deal.world entries), how many elements of its share it took.
        buffers: per old rank, the references still in its packer buffer (taken, not yet placed in rows).
        world: the new number of ranks.
    Returns:
        The new deal; each new rank starts at taken = 0 with an empty buffer.
    Raises:
        ValueError: taken/buffers do not have one entry per old rank, or a reference appears twice.
    """
    W = deal.world
    if len(taken) != W or len(buffers) != W:
        raise ValueError(f"need the state of all {W} ranks of the old world, got {len(taken)}")
    done = [r + (c - 1) * W for r, c in enumerate(taken) if c > 0]
    end = max(done) + 1 if done else 0  # one past the furthest taken element of S
    start = min(r + c * W for r, c in enumerate(taken))  # every element before it was taken
    holes = [deal.element(j) for j in range(start, end) if j // W >= taken[j % W]]
    rest = list(deal.pending[end:])
    refs = holes + rest + [tuple(r) for b in buffers for r in b]
    if len({g for g, _ in refs}) != len(refs):
        raise ValueError("a stream item is both pending and buffered (or buffered twice): corrupt data state")
    frontier = deal.frontier + max(0, end - len(deal.pending))
    return Deal(world, frontier, tuple(sorted((int(g), int(o)) for g, o in refs)))


def whole_world(deals: Sequence[Deal], ranks: Sequence[int]) -> Deal:
    """The deal of the old world whose ranks' states gave `deals` and `ranks` (one entry per state).

    Raises:
        ValueError: the states are not those of ranks 0..W-1 of one world, in rank order.
    """
    deal = deals[0]
    if list(ranks) != list(range(deal.world)) or any(d != deal for d in deals):
        raise ValueError(
            f"need the data states of ranks 0..{deal.world - 1} of one world, in order; got ranks {list(ranks)}"
        )
    return deal


def sum_stats(stats: Sequence[Mapping]) -> dict:
    """Counters of several ranks added up (the new rank 0 keeps the run's totals after a re-deal)."""
    return {k: sum(s[k] for s in stats) for k in stats[0]} if stats else {}


class RankCursor:
    """One rank's position in a deal: its share's next element is deal.share(rank, taken, 1)[0]."""

    def __init__(self, deal: Deal, rank: int, taken: int = 0):
        if not 0 <= rank < deal.world:
            raise ValueError(f"rank {rank} outside the deal's world of {deal.world}")
        self.deal, self.rank, self.taken = deal, rank, taken

    def upcoming(self, count: int, skip: int = 0) -> list[Ref]:
        """The next `count` references of this rank's share after skipping `skip`, without taking them."""
        return self.deal.share(self.rank, self.taken + skip, count)

    def take(self, ref: Ref) -> None:
        """Mark the next element taken; `ref` must be it (a stream delivered out of order is a bug)."""
        expected = self.deal.element(self.rank + self.taken * self.deal.world)
        if tuple(ref) != expected:
            raise RuntimeError(
                f"rank {self.rank}: stream delivered {tuple(ref)}, the cursor expects {expected}"
            )
        self.taken += 1
