"""BOS-aligned best-fit packing of a document stream into pretraining rows (continuous-stream semantics).

Every document arrives as [BOS, tokens...]. A row of T+1 tokens is filled by repeatedly placing the
LONGEST buffered piece that fits in the remaining space; when none fits, the SHORTEST buffered piece fills
the row exactly and what is left of it (its tail) is handled by the overflow policy:

  crop   the tail is discarded (nanochat's BOS-aligned best-fit loader)
  split  the tail goes back into the buffer as a new piece [BOS] + tail, so nothing is discarded; a tail
         shorter than `min_fragment` tokens is discarded (and counted) instead

So every row starts with BOS and rows have no padding. Token accounting (PackingStats), per piece taken
out of the buffer into a row:  consumed = placed + dropped + requeued.  E.g. capacity 50 left, buffer
[500, 200, 100, 300] tokens: nothing fits, the 100-token document is the shortest: 50 tokens placed, and
its 50-token tail is dropped (crop) or requeued as a 51-token piece (split; the extra token is its BOS).

A piece remembers where it came from (Piece.doc, Piece.offset) and every row reports its segments
(Segment), so a row can be rebuilt from the documents alone (raychat.data.replay.records). The packer is
deterministic: ties go to the piece buffered first; a requeued tail counts as the newest arrival.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass

import numpy as np

from raychat.data.loader.best_fit import BestFitBuffer

# What happens to a document longer than the row's free space (--overflow): dropped past the row, or cut and
# its tail returned to the buffer as a new BOS-prefixed document.
OVERFLOW_POLICIES = ("crop", "split")


@dataclass(frozen=True)
class Piece:
    """Tokens waiting in the buffer. doc: the document's id (the stream item g; any int to the packer);
    offset: 0 = the whole document as it arrived, k > 0 = its tail from token k on, stored as
    [BOS] + document[k:]; tokens: int32 (the document's own BOS first, or the inserted one)."""

    doc: int
    offset: int
    tokens: np.ndarray

    def __len__(self) -> int:
        return len(self.tokens)


def piece_tokens(document: np.ndarray, offset: int) -> np.ndarray:
    """Piece.tokens of (document, offset): the document itself, or [BOS] + document[offset:]."""
    document = np.asarray(document, dtype=np.int32)
    return document if offset == 0 else np.concatenate([document[:1], document[offset:]])


@dataclass(frozen=True)
class Segment:
    """The part of one piece placed in a row: piece (doc, offset), where it sits in the row (row_offset,
    length tokens: piece.tokens[:length]), and what happened to the rest: decision "whole" (nothing left),
    "crop" (tail of `tail` tokens discarded), "split" (tail requeued) or "drop" (split, but the tail was
    shorter than min_fragment: discarded)."""

    doc: int
    offset: int
    row_offset: int
    length: int
    decision: str
    tail: int


@dataclass
class PackingStats:
    """Counters in tokens unless named otherwise; consumed = placed + dropped + requeued."""

    rows: int = 0
    documents: int = 0  # pieces taken from the stream
    consumed: int = 0  # tokens of pieces taken out of the buffer into rows
    placed: int = 0  # tokens written into rows (inserted BOS tokens included)
    dropped: int = 0  # tail tokens discarded
    requeued: int = 0  # tail tokens put back into the buffer (before their inserted BOS)
    splits: int = 0  # tails requeued = BOS tokens inserted
    short_tails: int = 0  # split tails dropped for being shorter than min_fragment

    @property
    def drop_fraction(self) -> float:
        """Discarded / document tokens that left the buffer (placed ones without inserted BOS, + discarded)."""
        resolved = self.placed - self.splits + self.dropped
        return self.dropped / resolved if resolved else 0.0

    @property
    def bos_fraction(self) -> float:
        """Inserted BOS tokens / row tokens (the split policy's overhead)."""
        return self.splits / self.placed if self.placed else 0.0


class BestFitPacker:
    """Packs the pieces from `next_document()` into rows of `row_len` = T+1 tokens.

    Args:
        next_document: the next document: a Piece, or token ids starting with BOS (then Piece(doc=its
            arrival number, offset=0)); None when the stream is exhausted (the packer then raises
            StopIteration once the buffer cannot fill a row).
        row_len: tokens per row (T+1).
        buffer_size: pieces kept buffered to choose from; larger = fewer overflows, more memory.
        overflow: "crop" or "split" (module docstring).
        min_fragment: split: tails shorter than this (tokens, before the inserted BOS) are discarded.
    Raises:
        ValueError: row_len < 2, buffer_size < 1, min_fragment < 1 or an unknown overflow policy.
    """

    def __init__(
        self,
        next_document: Callable[[], Piece | Sequence[int] | None],
        row_len: int,
        buffer_size: int = 256,
        overflow: str = "crop",
        min_fragment: int = 32,
    ):
        if row_len < 2:
            raise ValueError(f"row_len must be >= 2, got {row_len}")
        if buffer_size < 1:
            raise ValueError(f"buffer_size must be >= 1, got {buffer_size}")
        if overflow not in OVERFLOW_POLICIES:
            raise ValueError(f"overflow must be one of {list(OVERFLOW_POLICIES)}, got {overflow!r}")
        if min_fragment < 1:
            raise ValueError(f"min_fragment must be >= 1, got {min_fragment}")
        self.next_document = next_document
        self.row_len, self.buffer_size = row_len, buffer_size
        self.overflow, self.min_fragment = overflow, min_fragment
        self._buffer: BestFitBuffer[Piece] = BestFitBuffer()
        self._exhausted = False
        self.stats = PackingStats()

    def _refill(self) -> None:
        while not self._exhausted and len(self._buffer) < self.buffer_size:
            doc = self.next_document()
            if doc is None:
                self._exhausted = True
                break
            piece = (
                doc if isinstance(doc, Piece) else Piece(self.stats.documents, 0, np.asarray(doc, np.int32))
            )
            self.stats.documents += 1
            if len(piece):
                self._buffer.push(piece)

    def pack_row(self) -> tuple[np.ndarray, list[Segment]]:
        """The next row, int32 of shape (row_len,) starting with BOS, and its segments in row order.
        Raises StopIteration at the end of the stream."""
        parts: list[np.ndarray] = []
        segments: list[Segment] = []
        taken: list[Piece] = []
        filled = consumed = 0
        while filled < self.row_len:
            self._refill()
            if not self._buffer:  # the end of a finite stream: the partial row's (whole) pieces stay buffered
                for piece in taken:
                    self._buffer.push(piece)
                raise StopIteration
            space = self.row_len - filled
            piece = self._buffer.take_fitting(space)
            if piece is not None:
                taken.append(piece)
                parts.append(piece.tokens)
                segments.append(Segment(piece.doc, piece.offset, filled, len(piece), "whole", 0))
                n = len(piece)
            else:  # nothing fits: the shortest fills the row, its tail overflows
                piece = self._buffer.take_shortest()
                parts.append(piece.tokens[:space])
                segments.append(
                    Segment(piece.doc, piece.offset, filled, space, *self._overflow(piece, space))
                )
                n = space
            filled += n
            consumed += len(piece)
        self.stats.rows += 1
        self.stats.placed += filled
        self.stats.consumed += consumed
        return np.concatenate(parts).astype(np.int32, copy=False), segments

    def _overflow(self, piece: Piece, space: int) -> tuple[str, int]:
        tail = piece.tokens[space:]
        if self.overflow == "split" and len(tail) >= self.min_fragment:
            offset = piece.offset + space - (1 if piece.offset else 0)  # document index of tail[0]
            self._buffer.push(Piece(piece.doc, offset, np.concatenate([piece.tokens[:1], tail])))
            self.stats.requeued += len(tail)
            self.stats.splits += 1
            return "split", len(tail)
        self.stats.dropped += len(tail)
        if self.overflow == "split":
            self.stats.short_tails += 1
            return "drop", len(tail)
        return "crop", len(tail)

    def next_row(self) -> np.ndarray:
        """pack_row() without the segments."""
        return self.pack_row()[0]

    def __iter__(self) -> Iterator[np.ndarray]:
        while True:
            try:
                yield self.next_row()
            except StopIteration:
                return

    # ---- exact resume ------------------------------------------------------------------------------
    def buffered(self) -> list[Piece]:
        """The buffered pieces in arrival order."""
        return self._buffer.in_arrival_order()

    def state_dict(self) -> dict:
        """References only (no tokens): {"buffer": [[doc, offset], ...] in arrival order, "stats": {...}}."""
        return {"buffer": [[p.doc, p.offset] for p in self.buffered()], "stats": asdict(self.stats)}

    def load_state_dict(self, state: dict, pieces: Sequence[Piece]) -> None:
        """Restore a state_dict; `pieces` are its buffer's pieces rebuilt by the caller, in the same order.

        Raises:
            ValueError: the pieces are not the ones the state refers to.
        """
        if [[p.doc, p.offset] for p in pieces] != [list(r) for r in state["buffer"]]:
            raise ValueError("the rebuilt pieces do not match the packer state's buffer")
        self._buffer = BestFitBuffer()
        for piece in pieces:
            self._buffer.push(piece)
        self.stats = PackingStats(**state["stats"])
