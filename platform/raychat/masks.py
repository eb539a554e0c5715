"""The sequence-construction contract: label shift, loss mask, position_ids and attention masks.

Three masks, never substitutes for one another (see ARCHITECTURE.md):
  attention_mask  what a position may see: causal AND same segment
  loss_mask       which predicted tokens are optimized
  position_ids    where a token sits; restarts at 0 per segment in independent-sample packing

A packed row holds T+1 tokens. The label shift happens once, here: inputs = ids[:-1], labels = ids[1:].
Target eligibility follows the PREDICTED token: loss_mask[i] = supervised[i+1] and
segment_ids[i] == segment_ids[i+1], so the first token of a segment is never a target of the previous one.
"""

from __future__ import annotations

import torch


def shift_labels(
    ids: torch.Tensor, supervised: torch.Tensor, segment_ids: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Split rows of T+1 tokens into inputs and labels.

    Args:
        ids: (B, T+1) int token ids.
        supervised: (B, T+1) bool/int, 1 where the token is a training target when predicted.
        segment_ids: (B, T+1) int, the sample/document each token belongs to (padding: its own segment).
    Returns:
        input_ids (B, T) int64, labels (B, T) int64, loss_mask (B, T) bool, segment_ids (B, T) int64.
    Example:
        ids [10,11,12,20,21], supervised [0,0,1,1,1], segments [0,0,0,1,1]
        -> labels [11,12,20,21], loss_mask [False, True, False, True].
    """
    if ids.shape != supervised.shape or ids.shape != segment_ids.shape:
        raise ValueError(
            f"ids {tuple(ids.shape)}, supervised {tuple(supervised.shape)} and segment_ids "
            f"{tuple(segment_ids.shape)} must have the same shape"
        )
    if ids.shape[-1] < 2:
        raise ValueError(f"rows need at least 2 tokens (T+1), got {ids.shape[-1]}")
    ids, segment_ids = ids.long(), segment_ids.long()
    same_segment = segment_ids[:, :-1] == segment_ids[:, 1:]
    loss_mask = supervised[:, 1:].bool() & same_segment
    return ids[:, :-1], ids[:, 1:], loss_mask, segment_ids[:, :-1]


def segment_ids_from_bos(ids: torch.Tensor, bos_id: int) -> torch.Tensor:
    """(B, T) segment ids for a BOS-delimited stream: a new segment starts at every BOS token."""
    return torch.cumsum((ids == bos_id).long(), dim=-1)


def position_ids_from_segments(segment_ids: torch.Tensor) -> torch.Tensor:
    """(B, T) int64 positions that restart at 0 at every segment change.

    Example: segments [0,0,0,1,1,1,1,1] -> [0,1,2,0,1,2,3,4].
    """
    B, T = segment_ids.shape
    idx = torch.arange(T, device=segment_ids.device).expand(B, T)
    starts = torch.ones_like(segment_ids, dtype=torch.bool)
    starts[:, 1:] = segment_ids[:, 1:] != segment_ids[:, :-1]
    start_idx = torch.where(starts, idx, torch.zeros_like(idx))
    return idx - torch.cummax(start_idx, dim=-1).values


def document_causal_mask(segment_ids: torch.Tensor) -> torch.Tensor:
    """(B, 1, T, T) bool attention mask, True where query i may attend key j: j <= i and same segment.

    The diagonal is always True, so no row of the softmax is empty (padding attends to itself).
    """
    T = segment_ids.shape[-1]
    causal = torch.ones(T, T, dtype=torch.bool, device=segment_ids.device).tril()
    same = segment_ids[:, :, None] == segment_ids[:, None, :]
    return (causal & same)[:, None]


def make_batch(
    ids: torch.Tensor,
    bos_id: int,
    supervised: torch.Tensor | None = None,
    segment_ids: torch.Tensor | None = None,
    document_masking: bool = False,
) -> dict[str, torch.Tensor]:
    """Turn packed rows of T+1 tokens into the model's training inputs.

    Args:
        ids: (B, T+1) token ids of packed rows.
        bos_id: id of <|bos|>; used to find documents when segment_ids is None (pretraining stream).
        supervised: (B, T+1) target eligibility; default all ones (pretraining).
        segment_ids: (B, T+1) sample ids from independent-sample packing; default from BOS positions.
        document_masking: if True, attention is causal AND same-segment and positions restart per
            segment; if False (continuous-stream pretraining) attention is plain causal over the row.
            The loss mask never crosses a segment boundary either way.
    Returns:
        dict with input_ids, labels (int64, (B, T)), loss_mask (bool), position_ids (int64) and,
        when document_masking, segment_ids (int64).
    """
    if supervised is None:
        supervised = torch.ones_like(ids, dtype=torch.bool)
    if segment_ids is None:
        segment_ids = segment_ids_from_bos(ids, bos_id)
    input_ids, labels, loss_mask, seg = shift_labels(ids, supervised, segment_ids)
    batch = {"input_ids": input_ids, "labels": labels, "loss_mask": loss_mask}
    if document_masking:
        batch["position_ids"] = position_ids_from_segments(seg)
        batch["segment_ids"] = seg
    else:
        batch["position_ids"] = torch.arange(input_ids.shape[1]).expand_as(input_ids)
    return batch
