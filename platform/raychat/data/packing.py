"""BOS-aligned best-fit packing of a document stream into pretraining rows (continuous-stream semantics).

Every document arrives as [BOS, tokens...]. A row of T+1 tokens is filled by repeatedly placing the
LONGEST buffered document that fits in the remaining space; when none fits, the SHORTEST buffered document
is cropped to fill the row exactly and its tail is discarded. So every row starts with BOS, rows have no
padding, and the only loss is the cropped tails:  consumed = placed + cropped.
(The same rule as nanochat's BOS-aligned best-fit loader; crop fraction = cropped / consumed.)

The packer is deterministic (ties go to the document buffered first) and its state (the buffered
documents) is saved in every checkpoint so a resumed run continues exactly where it stopped.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import numpy as np


@dataclass
class PackingStats:
    rows: int = 0
    placed: int = 0  # tokens written into rows
    cropped: int = 0  # tokens discarded from cropped tails
    documents: int = 0  # documents taken from the stream

    @property
    def consumed(self) -> int:
        return self.placed + self.cropped

    @property
    def crop_fraction(self) -> float:
        return self.cropped / self.consumed if self.consumed else 0.0


class BestFitPacker:
    """Packs documents from `next_document()` into rows of `row_len` = T+1 tokens.

    Args:
        next_document: returns the next document's token ids (starting with BOS), or None when the
            stream is exhausted (the packer then raises StopIteration once the buffer cannot fill a row).
        row_len: tokens per row (T+1).
        buffer_size: documents kept buffered to choose from; larger = fewer crops, more memory.
    """

    def __init__(
        self, next_document: Callable[[], Sequence[int] | None], row_len: int, buffer_size: int = 256
    ):
        if row_len < 2:
            raise ValueError(f"row_len must be >= 2, got {row_len}")
        if buffer_size < 1:
            raise ValueError(f"buffer_size must be >= 1, got {buffer_size}")
        self.next_document = next_document
        self.row_len = row_len
        self.buffer_size = buffer_size
        self._keys: list[tuple[int, int]] = []  # sorted (length, arrival) for bisect
        self._docs: dict[int, Sequence[int]] = {}  # arrival -> tokens
        self._arrivals = 0
        self._exhausted = False
        self.stats = PackingStats()

    def _refill(self) -> None:
        while not self._exhausted and len(self._keys) < self.buffer_size:
            doc = self.next_document()
            if doc is None:
                self._exhausted = True
                break
            if len(doc) == 0:
                continue
            self._push(doc)
            self.stats.documents += 1

    def _push(self, doc: Sequence[int]) -> None:
        key = (len(doc), self._arrivals)
        self._arrivals += 1
        bisect.insort(self._keys, key)
        self._docs[key[1]] = doc

    def _pop(self, index: int) -> Sequence[int]:
        _, arrival = self._keys.pop(index)
        return self._docs.pop(arrival)

    def next_row(self) -> np.ndarray:
        """The next row: int32 array of shape (row_len,), starting with BOS. Raises StopIteration at the end."""
        row: list[Sequence[int]] = []
        filled = 0
        while filled < self.row_len:
            self._refill()
            if not self._keys:
                raise StopIteration
            space = self.row_len - filled
            # longest document with length <= space, earliest arrival among equal lengths
            i = bisect.bisect_right(self._keys, (space, float("inf"))) - 1
            if i >= 0:
                length = self._keys[i][0]
                i = bisect.bisect_left(self._keys, (length, -1))
                doc = self._pop(i)
                row.append(doc)
                filled += len(doc)
                self.stats.placed += len(doc)
            else:  # nothing fits: crop the shortest
                doc = self._pop(0)
                row.append(doc[:space])
                filled += space
                self.stats.placed += space
                self.stats.cropped += len(doc) - space
        self.stats.rows += 1
        return np.concatenate([np.asarray(piece, dtype=np.int32) for piece in row])

    def __iter__(self) -> Iterator[np.ndarray]:
        while True:
            try:
                yield self.next_row()
            except StopIteration:
                return

    # ---- exact resume ------------------------------------------------------------------------------
    def state_dict(self) -> dict:
        docs = [np.asarray(self._docs[a]).tolist() for _, a in sorted(self._keys, key=lambda k: k[1])]
        return {"buffer": docs, "stats": vars(self.stats).copy()}

    def load_state_dict(self, state: dict) -> None:
        self._keys, self._docs, self._arrivals = [], {}, 0
        for doc in state["buffer"]:
            self._push(np.asarray(doc, dtype=np.int32))
        self.stats = PackingStats(**state["stats"])
