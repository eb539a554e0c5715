"""Replay records: enough to rebuild a packed SFT batch bit for bit and prove it is the same.

A record holds, per batch: the raw sample ids of every row with their segment offsets and lengths (the pack
groups), each sample's truncation decision, the template and tokenizer versions, the mixture description
and seed, and sha256 hashes of the model inputs: input_ids, labels, loss_mask, and the attention metadata
(position_ids, segment_ids; the attention mask is a function of segment_ids).

Hash of a tensor = sha256 over "<name>|<shape>|" followed by its values as little-endian int64 bytes
(bool -> 0/1), so it does not depend on the device or the in-memory dtype.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import torch

from raychat.chat_template import TEMPLATE_VERSION, render_conversation
from raychat.data.sample_packing import rows_to_batch
from raychat.tokenizer import Tokenizer

HASHED = ("input_ids", "labels", "loss_mask", "position_ids", "segment_ids")


def tensor_sha256(name: str, t: torch.Tensor | np.ndarray) -> str:
    a = np.ascontiguousarray(np.asarray(t.cpu() if isinstance(t, torch.Tensor) else t).astype("<i8"))
    h = hashlib.sha256(f"{name}|{list(a.shape)}|".encode())
    h.update(a.tobytes())
    return h.hexdigest()


def batch_hashes(batch: Mapping[str, torch.Tensor]) -> dict[str, str]:
    """sha256 of each of HASHED in a make_batch(...) dict (document_masking=True)."""
    return {k: tensor_sha256(k, batch[k]) for k in HASHED}


@dataclass
class ReplayRecord:
    """One batch's provenance; JSON-serializable (to_dict / from_dict, save / load)."""

    step: int
    seed: int
    mixture: dict
    template_version: str
    tokenizer_version: str
    row_len: int
    pad_id: int
    rows: list[dict]  # per row: sample_ids, segment_offsets, segment_lengths, truncation (list of dicts)
    hashes: dict[str, str] = field(default_factory=dict)

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: Mapping) -> ReplayRecord:
        return cls(**d)

    def save(self, path: str | os.PathLike) -> Path:
        """Write JSON atomically (tmp + os.replace)."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(json.dumps(self.to_dict(), sort_keys=True))
        os.replace(tmp, path)
        return path

    @classmethod
    def load(cls, path: str | os.PathLike) -> ReplayRecord:
        return cls.from_dict(json.loads(Path(path).read_text()))


def make_replay_record(
    rows: Mapping, tokenizer: Tokenizer, step: int, seed: int, mixture: dict, pad_id: int
) -> ReplayRecord:
    """Record for a batch of stacked rows (SamplePacker.next_batch / stack_rows output)."""
    ids = np.asarray(rows["input_ids"])
    per_row = [
        {
            "sample_ids": list(rows["sample_ids"][r]),
            "segment_offsets": [int(x) for x in rows["segment_offsets"][r]],
            "segment_lengths": [int(x) for x in rows["segment_lengths"][r]],
            "truncation": json.loads(rows["truncation"][r]),
        }
        for r in range(ids.shape[0])
    ]
    return ReplayRecord(
        step=step,
        seed=seed,
        mixture=mixture,
        template_version=TEMPLATE_VERSION,
        tokenizer_version=tokenizer.version,
        row_len=int(ids.shape[1]),
        pad_id=pad_id,
        rows=per_row,
        hashes=batch_hashes(rows_to_batch(rows, tokenizer.bos_id)),
    )


def rebuild_rows(
    record: ReplayRecord, get_conversation: Callable[[str], Mapping], tokenizer: Tokenizer
) -> dict:
    """Re-render every recorded sample (same truncation rule) and place it at its recorded offset.

    Returns:
        {"input_ids", "supervised", "segment_ids"}: (rows, row_len) int32 arrays.
    Raises:
        ValueError: a re-rendered sample's truncation decision or length differs from the record.
    """
    n, L = len(record.rows), record.row_len
    ids = np.full((n, L), record.pad_id, dtype=np.int32)
    sup = np.zeros((n, L), dtype=np.int32)
    seg = np.zeros((n, L), dtype=np.int32)
    for r, row in enumerate(record.rows):
        seg[r, :] = len(row["sample_ids"])
        for k, (sid, off, length, trunc) in enumerate(
            zip(row["sample_ids"], row["segment_offsets"], row["segment_lengths"], row["truncation"])
        ):
            rendered = render_conversation(tokenizer, get_conversation(sid), max_tokens=L)
            if rendered.truncation.to_dict() != trunc or len(rendered) != length:
                raise ValueError(
                    f"row {r} sample {sid!r}: re-rendered truncation {rendered.truncation.to_dict()} / length "
                    f"{len(rendered)} differ from the record {trunc} / {length}"
                )
            ids[r, off : off + length], sup[r, off : off + length], seg[r, off : off + length] = (
                rendered.ids,
                rendered.supervised,
                k,
            )
    return {"input_ids": ids, "supervised": sup, "segment_ids": seg}


def verify_replay(
    record: ReplayRecord, get_conversation: Callable[[str], Mapping], tokenizer: Tokenizer
) -> list[str]:
    """Rebuild the batch and compare; returns the list of mismatches (empty = identical)."""
    problems = []
    if record.template_version != TEMPLATE_VERSION:
        problems.append(f"template_version {record.template_version} != current {TEMPLATE_VERSION}")
    if record.tokenizer_version != tokenizer.version:
        problems.append(f"tokenizer_version {record.tokenizer_version} != current {tokenizer.version}")
    try:
        rebuilt = batch_hashes(
            rows_to_batch(rebuild_rows(record, get_conversation, tokenizer), tokenizer.bos_id)
        )
    except ValueError as e:
        return [*problems, str(e)]
    problems += [f"{k} hash differs" for k in HASHED if rebuilt[k] != record.hashes.get(k)]
    return problems
