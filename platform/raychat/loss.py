"""Token-normalized cross entropy over a whole optimizer step.

    step loss = sum over all micro-batches and ranks of CE(target tokens)  /  N
    N         = number of target tokens (loss_mask True) over all micro-batches, all-reduced over ranks

(never a mean of per-micro-batch or per-rank means, which would weight short batches up). In a DDP trainer
that averages gradients over W ranks, each micro-batch backpropagates W x `loss_sum / N` so the averaged
gradient equals the gradient of the step loss. A step with N = 0 gives loss 0 (division by max(N, 1)).
Masking uses `loss_mask` only, never a token id: the pad id may equal <|assistant_end|> or any real token.
TokenCrossEntropy is this loss as the training step runs it (raychat.train.step.forward_backward, which
applies the W).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.nn.functional as F


def cross_entropy_sum(
    logits: torch.Tensor, labels: torch.Tensor, loss_mask: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sum of token cross entropies (nats) over the positions where loss_mask is True.

    Args:
        logits: (B, T, V) float logits (computed in float32 here).
        labels: (B, T) int64 target ids; any valid id at masked positions (they are ignored).
        loss_mask: (B, T) bool, True where the position's label is trained on.
    Returns:
        (loss_sum, n_targets): float32 scalar with grad, int64 scalar. Masked positions add exactly 0 to
        loss_sum even when their logits are inf or NaN (selected with torch.where, not multiplied).
    Raises:
        ValueError: shapes do not match.
    """
    if logits.ndim != 3 or logits.shape[:2] != labels.shape or labels.shape != loss_mask.shape:
        raise ValueError(
            f"logits (B, T, V), labels and loss_mask (B, T) must match; got {tuple(logits.shape)}, "
            f"{tuple(labels.shape)}, {tuple(loss_mask.shape)}"
        )
    mask = loss_mask.bool()
    per_token = F.cross_entropy(logits.float().flatten(0, 1), labels.flatten().long(), reduction="none")
    per_token = torch.where(mask.flatten(), per_token, torch.zeros_like(per_token))
    return per_token.sum(), mask.sum()


def global_target_count(loss_masks: Iterable[torch.Tensor], group=None) -> int:
    """N: target tokens summed over the step's micro-batches, then all-reduced (SUM) over the ranks of
    `group` when torch.distributed is initialized (else this process only).

    Call it once per step, before the backward passes, with every micro-batch's loss_mask.
    """
    masks = list(loss_masks)
    device = masks[0].device if masks else torch.device("cpu")
    total = torch.zeros((), dtype=torch.int64, device=device)
    for m in masks:
        total += m.bool().sum()
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.all_reduce(total, op=torch.distributed.ReduceOp.SUM, group=group)
    return int(total.item())


def normalize(loss_sum: torch.Tensor, n_targets: int, world_size: int = 1) -> torch.Tensor:
    """The term a micro-batch backpropagates: loss_sum * world_size / max(n_targets, 1).

    world_size is the number of ranks whose gradients DDP averages (1 without DDP); with it, the averaged
    gradient equals d(step loss). n_targets = global_target_count(...). Zero targets -> 0, never NaN.
    """
    if n_targets < 0:
        raise ValueError(f"n_targets must be >= 0, got {n_targets}")
    return loss_sum * (world_size / max(n_targets, 1))


class TokenCrossEntropy:
    """The pretraining / SFT loss component of raychat.train.step.forward_backward (its StepLoss).

    counts(batch) -> int64 (1,): the micro-batch's target tokens (loss_mask True).
    __call__(logits, batch, totals) -> (share, stats): share = the micro-batch's CE sum / max(N, 1), a float32
    scalar with grad, N = totals[0] (target tokens of the step, all micro-batches and ranks); stats = float64
    (1,) that CE sum (nats). The step loss is stats[0] / max(N, 1) once stats are summed over the step.
    batch: labels (B, T) int64 and loss_mask (B, T) bool (raychat.masks.make_batch); logits (B, T, V).
    """

    def counts(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        return batch["loss_mask"].bool().sum().reshape(1)

    def __call__(
        self, logits: torch.Tensor, batch: dict[str, torch.Tensor], totals: list[int]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        ce_sum, _ = cross_entropy_sum(logits, batch["labels"], batch["loss_mask"])
        return normalize(ce_sum, totals[0]), ce_sum.detach().double().reshape(1)
