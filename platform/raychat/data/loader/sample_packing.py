"""Independent-sample packing of rendered conversations into rows of T+1 tokens (SFT, evaluation).

Each row holds whole samples one after another, then padding at the tail only:

    input_ids    [s0 ............][s1 ......][s2 ...][pad pad pad]
    supervised   per token, from the chat template; 0 on padding
    segment_ids  0 0 0 ...         1 1 ...    2 2 ...  3 3 3        (padding is its own segment)

`raychat.masks.make_batch(ids, bos_id, supervised=, segment_ids=, document_masking=True)` turns rows into
input_ids / labels / loss_mask / position_ids / segment_ids: attention is causal AND same-segment, positions
restart at 0 per sample, and no label crosses a sample boundary. Padding is never a target because its
supervised flag is 0 (masking never looks at the pad id, which may equal any real token).

Best fit (mode "bestfit"): from a buffer of `buffer_size` samples, repeatedly place the LONGEST sample that
fits in the row's remaining space (earliest arrival on ties); when none fits, pad the tail and start the next
row. Samples longer than the row are rejected with an error: `render_samples` truncates or drops them first
(render_conversation(max_tokens=row_len)), so one can never sit in the buffer forever.
Mode "pad": one sample per row, right-padded (for comparison).
Token efficiency = real tokens / tensor tokens, tensor tokens = rows * row_len.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from raychat.chat_template import RenderedConversation, render_conversation
from raychat.data.loader.best_fit import BestFitBuffer
from raychat.masks import make_batch
from raychat.tokenizer import Tokenizer

MODES = ("bestfit", "pad")


@dataclass
class PackItem:
    """One rendered sample ready to pack. input_ids/supervised: int32 arrays of equal length (<= row_len);
    ref: where it came from (the SFT stream item g, raychat.data.loader.sft_rows; -1 when not from a stream)."""

    sample_id: str
    input_ids: np.ndarray
    supervised: np.ndarray
    truncation: dict = field(default_factory=dict)
    ref: int = -1

    def __len__(self) -> int:
        return len(self.input_ids)

    @property
    def num_targets(self) -> int:
        return int(self.supervised.sum())

    @classmethod
    def from_rendered(cls, sample_id: str, rendered: RenderedConversation, ref: int = -1) -> PackItem:
        return cls(
            sample_id,
            np.asarray(rendered.ids, dtype=np.int32),
            np.asarray(rendered.supervised, dtype=np.int32),
            rendered.truncation.to_dict(),
            ref,
        )


@dataclass
class SampleStats:
    """Counts from rendering (samples, truncated, dropped, targets) and packing (rows, tokens)."""

    samples: int = 0
    truncated: int = 0
    dropped: int = 0
    targets_before: int = 0  # supervised tokens before truncation, over all samples
    targets_after: int = 0  # supervised tokens that survive (the ones trained on)
    drop_reasons: Counter = field(default_factory=Counter)
    rows: int = 0
    real_tokens: int = 0
    tensor_tokens: int = 0

    @property
    def token_efficiency(self) -> float:
        """real tokens / tensor tokens (rows * row_len); 0.0 before any row."""
        return self.real_tokens / self.tensor_tokens if self.tensor_tokens else 0.0

    def to_dict(self) -> dict:
        d = {k: v for k, v in vars(self).items() if k != "drop_reasons"}
        return {**d, "drop_reasons": dict(self.drop_reasons), "token_efficiency": self.token_efficiency}


def render_samples(
    tokenizer: Tokenizer,
    samples: Iterable[tuple[str, Mapping | Sequence]],
    row_len: int,
    stats: SampleStats | None = None,
    ref: int = -1,
) -> Iterator[PackItem]:
    """Render (sample_id, conversation) pairs with truncation to `row_len`; skip and count dropped ones.

    Args:
        row_len: T+1, the packed row length; every yielded item has len <= row_len.
        stats: updated in place (samples, truncated, dropped, drop_reasons, targets_before/after).
        ref: PackItem.ref of the yielded items.
    """
    stats = stats if stats is not None else SampleStats()
    for sample_id, conversation in samples:
        r = render_conversation(tokenizer, conversation, max_tokens=row_len)
        t = r.truncation
        stats.samples += 1
        stats.targets_before += t.targets_before
        stats.targets_after += t.targets_after
        if t.dropped:
            stats.dropped += 1
            stats.drop_reasons[t.reason] += 1
            continue
        stats.truncated += int(t.truncated)
        yield PackItem.from_rendered(sample_id, r, ref)


class SamplePacker:
    """Packs PackItems into rows of `row_len` = T+1 tokens (see the module docstring).

    Args:
        next_item: returns the next PackItem, or None when the stream is exhausted.
        row_len: T+1.
        pad_id: token id written into padding (any id: padding is masked by supervised = 0).
        mode: "bestfit" or "pad".
        buffer_size: samples buffered to choose from in best fit (1 = first fit in arrival order).
    Raises:
        ValueError: bad arguments, or an item longer than row_len / empty (truncate before packing).
    """

    def __init__(
        self,
        next_item: Callable[[], PackItem | None],
        row_len: int,
        pad_id: int,
        mode: str = "bestfit",
        buffer_size: int = 64,
    ):
        if row_len < 2:
            raise ValueError(f"row_len must be >= 2, got {row_len}")
        if mode not in MODES:
            raise ValueError(f"mode must be one of {list(MODES)}, got {mode!r}")
        if buffer_size < 1:
            raise ValueError(f"buffer_size must be >= 1, got {buffer_size}")
        self.next_item, self.row_len, self.pad_id, self.mode = next_item, row_len, pad_id, mode
        self.buffer_size = buffer_size if mode == "bestfit" else 1
        self._buffer: BestFitBuffer[PackItem] = BestFitBuffer()
        self._exhausted = False
        self.stats = SampleStats()

    @classmethod
    def from_items(cls, items: Iterable[PackItem], row_len: int, pad_id: int, **kw) -> SamplePacker:
        it = iter(items)
        return cls(lambda: next(it, None), row_len, pad_id, **kw)

    def _refill(self) -> None:
        while not self._exhausted and len(self._buffer) < self.buffer_size:
            item = self.next_item()
            if item is None:
                self._exhausted = True
                return
            if not 0 < len(item) <= self.row_len:
                raise ValueError(
                    f"sample {item.sample_id!r} has {len(item)} tokens; packing needs 1..row_len={self.row_len} "
                    "(truncate or drop it first: render_samples / render_conversation(max_tokens=row_len))"
                )
            self._buffer.push(item)

    def next_row(self) -> dict:
        """The next row. Raises StopIteration when no sample is left.

        Returns:
            dict with input_ids, supervised, segment_ids (int32 arrays of shape (row_len,)), sample_ids
            (list[str]), sample_refs (list[int], PackItem.ref), segment_offsets and segment_lengths (int32 arrays, one per sample), num_targets
            (int), truncation (JSON string: the samples' truncation decisions).
        """
        placed: list[PackItem] = []
        filled = 0
        while filled < self.row_len and not (self.mode == "pad" and placed):
            self._refill()
            item = self._buffer.take_fitting(self.row_len - filled)
            if item is None:
                break
            placed.append(item)
            filled += len(item)
        if not placed:
            raise StopIteration
        row = self._assemble(placed)
        self.stats.rows += 1
        self.stats.real_tokens += filled
        self.stats.tensor_tokens += self.row_len
        return row

    def _assemble(self, placed: list[PackItem]) -> dict:
        ids = np.full(self.row_len, self.pad_id, dtype=np.int32)
        sup = np.zeros(self.row_len, dtype=np.int32)
        seg = np.full(self.row_len, len(placed), dtype=np.int32)
        offsets, lengths, pos = [], [], 0
        for k, item in enumerate(placed):
            n = len(item)
            ids[pos : pos + n], sup[pos : pos + n], seg[pos : pos + n] = item.input_ids, item.supervised, k
            offsets.append(pos)
            lengths.append(n)
            pos += n
        return {
            "input_ids": ids,
            "supervised": sup,
            "segment_ids": seg,
            "sample_ids": [item.sample_id for item in placed],
            "sample_refs": [item.ref for item in placed],
            "segment_offsets": np.asarray(offsets, dtype=np.int32),
            "segment_lengths": np.asarray(lengths, dtype=np.int32),
            "num_targets": int(sup.sum()),
            "truncation": json.dumps([item.truncation for item in placed], sort_keys=True),
        }

    def __iter__(self) -> Iterator[dict]:
        while True:
            try:
                yield self.next_row()
            except StopIteration:
                return

    def next_batch(self, n: int) -> dict:
        """n rows stacked: input_ids/supervised/segment_ids (n, row_len) int32, metadata as lists of n.

        Raises StopIteration if fewer than n rows are left (the caller starts the next epoch).
        """
        return stack_rows([self.next_row() for _ in range(n)])

    # ---- exact resume ----------------------------------------------------------------------------------
    def buffered(self) -> list[PackItem]:
        """The buffered items in arrival order."""
        return self._buffer.in_arrival_order()

    def state_dict(self) -> dict:
        """References, not tokens: {"buffer": [PackItem.ref, ...] in arrival order, "stats", "exhausted"}
        (JSON-serializable). The caller also saves its source position."""
        stats = {k: v for k, v in vars(self.stats).items() if k != "drop_reasons"}
        return {"buffer": [it.ref for it in self.buffered()], "stats": stats, "exhausted": self._exhausted}

    def load_state_dict(self, state: Mapping, items: Sequence[PackItem]) -> None:
        """Restore a state_dict; `items` are its buffer's items rebuilt by the caller, in the same order.
        A state without "exhausted" (a re-dealt one: raychat.data.loader.row_source) restores a source not exhausted.

        Raises:
            ValueError: the items are not the ones the state refers to.
        """
        if [it.ref for it in items] != list(state["buffer"]):
            raise ValueError("the rebuilt items do not match the packer state's buffer")
        self._buffer = BestFitBuffer()
        for it in items:
            self._buffer.push(it)
        self.stats = SampleStats(**state["stats"])
        self._exhausted = bool(state.get("exhausted", False))


def stack_rows(rows: Sequence[Mapping]) -> dict:
    """Stack row dicts: array columns become (n, row_len) int32; metadata columns become lists of n."""
    if not rows:
        raise ValueError("stack_rows needs at least one row")
    out = {}
    for k in rows[0]:
        if k in ("input_ids", "supervised", "segment_ids"):
            out[k] = np.stack([r[k] for r in rows]).astype(np.int32)
        else:
            out[k] = [r[k] for r in rows]
    return out


def rows_to_batch(rows: Mapping, bos_id: int) -> dict[str, torch.Tensor]:
    """(n, T+1) packed arrays -> make_batch(..., document_masking=True): input_ids, labels (int64, (n, T)),
    loss_mask (bool), position_ids, segment_ids (int64)."""
    return make_batch(
        torch.as_tensor(np.asarray(rows["input_ids"])).long(),
        bos_id,
        supervised=torch.as_tensor(np.asarray(rows["supervised"])),
        segment_ids=torch.as_tensor(np.asarray(rows["segment_ids"])),
        document_masking=True,
    )


def compare_packing(items: Sequence[PackItem], row_len: int, pad_id: int, buffer_size: int = 64) -> dict:
    """Token efficiency of best fit vs right padding on the same items: {"bestfit": {...}, "pad": {...}},
    each with rows, real_tokens, tensor_tokens, token_efficiency."""
    out = {}
    for mode in MODES:
        packer = SamplePacker.from_items(items, row_len, pad_id, mode=mode, buffer_size=buffer_size)
        for _ in packer:
            pass
        s = packer.stats
        out[mode] = {
            "rows": s.rows,
            "real_tokens": s.real_tokens,
            "tensor_tokens": s.tensor_tokens,
            "token_efficiency": s.token_efficiency,
        }
    return out
