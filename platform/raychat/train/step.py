"""The optimizer step every training stage shares: clip the global gradient norm, step, clear gradients.

Gradients arrive already reduced over the data-parallel ranks (DistributedDataParallel all-reduces them in
the last backward of the step), so every rank clips the same norm and takes the same step.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.distributed as dist


def all_reduce_sum(x: torch.Tensor) -> torch.Tensor:
    """Sum `x` over the process group in place (a no-op without one); returns x."""
    if dist.is_available() and dist.is_initialized():
        dist.all_reduce(x)
    return x


def optimizer_step(parameters: Iterable[torch.nn.Parameter], optimizers: list, grad_clip: float) -> float:
    """Clip the global L2 norm of the gradients to grad_clip (0 = no clipping), step every optimizer, set the
    gradients to None. Returns the norm before clipping (torch.nn.utils.clip_grad_norm_)."""
    clip = grad_clip if grad_clip > 0 else float("inf")
    grad_norm = torch.nn.utils.clip_grad_norm_(list(parameters), clip).item()
    for opt in optimizers:
        opt.step()
    for opt in optimizers:
        opt.zero_grad(set_to_none=True)
    return grad_norm
