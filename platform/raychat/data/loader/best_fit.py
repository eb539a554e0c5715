"""The buffer of both best-fit packers (raychat.data.loader.packing: documents; .sample_packing: SFT samples):
items kept sorted by (length, arrival) so that the longest one that fits a row's free space is found by bisection,
the earliest arrival among equal lengths first (a deterministic packing)."""

from __future__ import annotations

import bisect
from collections.abc import Sized
from typing import Generic, TypeVar

Item = TypeVar("Item", bound=Sized)


class BestFitBuffer(Generic[Item]):
    """Buffered items (anything with a len(): its tokens), in arrival order and by length."""

    def __init__(self) -> None:
        self._keys: list[tuple[int, int]] = []  # sorted (length, arrival)
        self._items: dict[int, Item] = {}  # arrival -> item
        self._arrivals = 0

    def __len__(self) -> int:
        return len(self._keys)

    def push(self, item: Item) -> None:
        """Buffer `item` as the newest arrival."""
        key = (len(item), self._arrivals)
        self._arrivals += 1
        bisect.insort(self._keys, key)
        self._items[key[1]] = item

    def take_fitting(self, space: int) -> Item | None:
        """Remove and return the longest item of length <= `space` tokens (the earliest arrival among equal
        lengths); None when none fits."""
        i = bisect.bisect_right(self._keys, (space, float("inf"))) - 1
        if i < 0:
            return None
        return self._take(bisect.bisect_left(self._keys, (self._keys[i][0], -1)))

    def take_shortest(self) -> Item:
        """Remove and return the shortest item (the earliest arrival among equal lengths). Raises IndexError
        when the buffer is empty."""
        return self._take(0)

    def _take(self, index: int) -> Item:
        _, arrival = self._keys.pop(index)
        return self._items.pop(arrival)

    def in_arrival_order(self) -> list[Item]:
        """The buffered items, the earliest arrival first."""
        return [self._items[a] for a in sorted(self._items)]
