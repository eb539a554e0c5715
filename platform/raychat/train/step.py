"""The optimizer step every training stage shares (pretraining, SFT and RL):

  forward_backward:  the step's micro-batches through the model under autocast; each backpropagates its share
                     of the step loss (a loss component: raychat.loss.TokenCrossEntropy,
                     raychat.rl.objective.PolicyGradientLoss) times the world size, DDP gradient all-reduce in
                     the last backward only (no_sync before); the loss's stats summed and all-reduced once
  optimizer_step:    clip the global gradient norm, step, clear gradients; the numerical-fault stop

Gradients arrive already reduced over the data-parallel ranks (DistributedDataParallel all-reduces them in
the last backward of the step), so every rank computes the same norm, takes the same step, and meets a
non-finite loss or norm at the same step: every rank stops there together, without a collective.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.distributed as dist


class NonFiniteError(FloatingPointError):
    """A non-finite loss or gradient norm at optimizer step `step` (1-based, as logged and checkpointed): the
    update was skipped. The training loop stops cleanly on it (raychat.train.worker returns it to the driver
    instead of raising, so Ray Train does not retry: a retry would replay the same data into the same
    fault), and the last checkpoint stays the last good one.

    Attributes: what ("loss" | "grad norm"), value (the non-finite float), step.
    """

    def __init__(self, what: str, value: float, step: int):
        self.what, self.value, self.step = what, value, step
        super().__init__(
            f"{what} is {value} at step {step}: the update was skipped and the run stopped (not retried); "
            "the last checkpoint is the last good one (lower the lr or check the data of that step)"
        )

    def __reduce__(self):  # pickles with its fields (Ray ships it between processes)
        return type(self), (self.what, self.value, self.step)


def autocast_for(device: torch.device) -> Callable[[], contextlib.AbstractContextManager]:
    """() -> a context manager: bf16 autocast on CUDA, nothing on CPU."""
    if device.type == "cuda":
        return lambda: torch.autocast("cuda", dtype=torch.bfloat16)
    return contextlib.nullcontext


def all_reduce_sum(x: torch.Tensor, world: int) -> torch.Tensor:
    """Sum `x` in place over the `world` data-parallel ranks (the default process group); returns x.

    A no-op when world == 1, even with a process group: a lone RL learner's default group may be the weight
    broadcast group it shares with the rollout actors (raychat.rl.weights), which must not carry it.
    """
    if world > 1:
        dist.all_reduce(x)
    return x


class StepLoss(Protocol):
    """A loss component: what forward_backward needs of a training objective (raychat.loss.TokenCrossEntropy,
    raychat.rl.objective.PolicyGradientLoss)."""

    def counts(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """int64 (K,) on the batch's device: what this micro-batch adds to the step's normalizers (target
        tokens, sequences)."""
        ...

    def __call__(
        self, logits: torch.Tensor, batch: dict[str, torch.Tensor], totals: list[int]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(this micro-batch's share of the step loss, a scalar with grad, normalized by `totals` (the counts
        summed over every micro-batch and rank) so that the shares sum to the step loss; float64 (M,) stats
        that are summed over the micro-batches and ranks)."""
        ...


@dataclass
class StepSums:
    """What forward_backward returns: the loss's counts (ints) and stats (floats), each summed over the step's
    micro-batches and the ranks (in the order the loss component gives them)."""

    totals: list[int]
    stats: list[float]


def forward_backward(
    model: torch.nn.Module,
    micro: list[dict[str, torch.Tensor]],
    loss: StepLoss,
    autocast: Callable[[], contextlib.AbstractContextManager],
    world: int,
) -> StepSums:
    """Backpropagate every micro-batch's share of one optimizer step's loss; the gradients accumulate in
    `model`'s parameters (optimizer_step applies and clears them).

    Args:
        model: what the step calls (compiled and/or DistributedDataParallel-wrapped); called as
            model(input_ids, position_ids=, segment_ids=) -> (B, T, V) logits.
        micro: the step's micro-batches on the model's device: input_ids (B, T) int64, optional
            position_ids / segment_ids (B, T), and whatever `loss` reads (labels, loss_mask, ...).
        loss: the loss component (StepLoss).
        autocast: () -> the forward's autocast context (autocast_for).
        world: data-parallel ranks whose gradients DDP averages (1 without DDP).
    Returns:
        StepSums: the counts and stats, summed over micro-batches, then all-reduced once over the ranks.
    Raises:
        ValueError: `micro` is empty.

    Each micro-batch backpropagates world x its share: DDP averages gradients over the ranks, so the
    gradient is d(step loss), the step loss being the sum of every rank's shares (the token-normalized step
    loss of raychat.loss; the RL normalizations of raychat.rl.objective). DDP all-reduces the gradients in the
    last micro-batch's backward only (no_sync before it). Scaling by a power-of-two world is exact, so
    (CE sum / N) x 2 has the bits of the CE sum x (2 / N) that the Trainer backpropagated before.
    """
    if not micro:
        raise ValueError("forward_backward needs at least one micro-batch")
    totals = all_reduce_sum(sum(loss.counts(mb) for mb in micro), world).tolist()
    stats = None
    for i, mb in enumerate(micro):
        sync = i == len(micro) - 1 or not hasattr(model, "no_sync")
        with contextlib.nullcontext() if sync else model.no_sync():
            with autocast():
                logits = model(
                    mb["input_ids"], position_ids=mb.get("position_ids"), segment_ids=mb.get("segment_ids")
                )
            share, mb_stats = loss(logits, mb, totals)
            (share * world).backward()
        stats = mb_stats if stats is None else stats + mb_stats
    return StepSums(totals, all_reduce_sum(stats, world).tolist())


def clear_grads(optimizers: list) -> None:
    for opt in optimizers:
        opt.zero_grad(set_to_none=True)


def optimizer_step(
    parameters: Iterable[torch.nn.Parameter], optimizers: list, grad_clip: float, step: int
) -> float:
    """Clip the global L2 norm of the gradients to grad_clip (0 = no clipping), step every optimizer, set the
    gradients to None. Returns the norm before clipping (torch.nn.utils.clip_grad_norm_).

    Raises:
        NonFiniteError: the norm is nan or inf; no optimizer stepped (the gradients are cleared).
    """
    clip = grad_clip if grad_clip > 0 else float("inf")
    grad_norm = torch.nn.utils.clip_grad_norm_(list(parameters), clip).item()
    if not math.isfinite(grad_norm):
        clear_grads(optimizers)
        raise NonFiniteError("grad norm", grad_norm, step)
    for opt in optimizers:
        opt.step()
    clear_grads(optimizers)
    return grad_norm
