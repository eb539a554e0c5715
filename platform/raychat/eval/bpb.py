"""Bits per byte (BPB): a tokenizer-independent language-modeling metric.

BPB = sum over target tokens of -ln p(target) / (ln 2 * sum of the targets' UTF-8 byte lengths).
Special tokens have 0 bytes and are excluded from both sums (as nanochat's evaluate_bpb).
bpb_sums returns the two sums, so BPB over several row sets is their added sums' ratio.
Sums are all-reduced over ranks before dividing, so the result is the same for any world size.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterable

import numpy as np
import torch
import torch.nn.functional as F

from raychat.masks import make_batch
from raychat.model import eval_mode


@torch.no_grad()
def bpb_sums(
    model: torch.nn.Module,
    rows: dict[str, np.ndarray],
    token_bytes: torch.Tensor,
    bos_id: int,
    batch_size: int,
    document_masking: bool = False,
    device: torch.device | str = "cpu",
    autocast=None,
) -> tuple[float, float]:
    """(nats, bytes): sums over the targets of `rows` (this rank's share), all-reduced over ranks.

    Args:
        rows: {"input_ids": (N, T+1) int token rows, optional "supervised" and "segment_ids" (N, T+1)}
            as produced by the pretraining or sample packers.
        token_bytes: (vocab_size,) int64 UTF-8 length of each token, 0 for special tokens.
    Raises:
        ValueError: the rows hold no target bytes.
    """
    nats = torch.zeros((), dtype=torch.float64, device=device)
    nbytes = torch.zeros((), dtype=torch.float64, device=device)
    token_bytes = token_bytes.to(device)
    with eval_mode(model):
        for i in range(0, len(rows["input_ids"]), batch_size):
            part = {k: torch.from_numpy(np.asarray(v[i : i + batch_size])) for k, v in rows.items()}
            b = make_batch(part.pop("input_ids"), bos_id, document_masking=document_masking, **part)
            b = {k: v.to(device) for k, v in b.items()}
            with autocast() if autocast else torch.autocast("cpu", enabled=False):
                logits = model(
                    b["input_ids"], position_ids=b["position_ids"], segment_ids=b.get("segment_ids")
                )
            loss = F.cross_entropy(logits.float().flatten(0, 1), b["labels"].flatten(), reduction="none")
            nb = token_bytes[b["labels"].flatten()] * b["loss_mask"].flatten()
            keep = nb > 0
            nats += loss[keep].double().sum()
            nbytes += nb[keep].double().sum()
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.all_reduce(nats)
        torch.distributed.all_reduce(nbytes)
    if nbytes.item() == 0:
        raise ValueError("validation rows hold no target bytes")
    return nats.item(), nbytes.item()


def bpb_coverage(rows: dict[str, np.ndarray], token_bytes: list[int], bos_id: int) -> tuple[int, int, int]:
    """What bpb_sums scores of `rows`, all of them: (samples, tokens, bytes): the documents or conversations
    (segments of a row) with at least one scored target, the targets in the loss mask with at least one UTF-8
    byte, and those bytes (the sum BPB divides by). rows: as bpb_sums; token_bytes: (vocab_size,) UTF-8 length
    of each token, 0 for special tokens (Tokenizer.token_bytes)."""
    part = {k: torch.from_numpy(np.asarray(v)) for k, v in rows.items()}
    b = make_batch(part.pop("input_ids"), bos_id, document_masking=True, **part)
    nb = torch.tensor(token_bytes, dtype=torch.int64)[b["labels"]] * b["loss_mask"]
    rows_at, _ = torch.nonzero(nb > 0, as_tuple=True)
    samples = torch.stack([rows_at, b["segment_ids"][nb > 0]]).unique(dim=1).shape[1]
    return samples, int((nb > 0).sum()), int(nb.sum())


def unigram_bpb(
    train_docs: Iterable[list[int]], val_docs: Iterable[list[int]], token_bytes: list[int]
) -> float:
    """BPB of a unigram model (add-one smoothed token frequencies of the training text) on validation text.

    The floor that any model that learned only token frequencies reaches; a trained model must go far below.
    Every token with > 0 bytes is a target (as in bpb_sums, where the BOS targets count 0 bytes).
    """
    counts = Counter()
    for doc in train_docs:
        counts.update(doc)
    vocab = len(token_bytes)
    total = sum(counts.values()) + vocab
    nats = nbytes = 0.0
    for doc in val_docs:
        for t in doc:
            if token_bytes[t] > 0:
                nats -= math.log((counts[t] + 1) / total)
                nbytes += token_bytes[t]
    return nats / (math.log(2) * nbytes)
