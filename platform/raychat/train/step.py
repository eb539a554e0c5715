"""The optimizer step every training stage shares: clip the global gradient norm, step, clear gradients; and
the numerical-fault stop.

Gradients arrive already reduced over the data-parallel ranks (DistributedDataParallel all-reduces them in
the last backward of the step), so every rank computes the same norm, takes the same step, and meets a
non-finite loss or norm at the same step: every rank stops there together, without a collective.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

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


def all_reduce_sum(x: torch.Tensor) -> torch.Tensor:
    """Sum `x` over the process group in place (a no-op without one); returns x."""
    if dist.is_available() and dist.is_initialized():
        dist.all_reduce(x)
    return x


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
