"""Optimizers and the learning-rate schedule.

Muon (raychat.train.muon: torch.optim.Muon's update, momentum + Newton-Schulz orthogonalization, Jordan et
al. 2024, in the dtype the device computes fast and sharded over data-parallel ranks) updates the hidden
weight matrices; AdamW updates the embedding, the LM head and the norm weights. AdamW learning rates are
scaled by (width / 768) ** -0.5 as in nanochat, so the defaults transfer across depths.
"""

from __future__ import annotations

import torch

from raychat.model import GPT
from raychat.train.muon import Muon, NSDtypeChoice, choose_ns_dtype


def split_parameters(model: GPT) -> tuple[list, list, list, list]:
    """(hidden matrices, embedding, lm_head, the rest): Muon takes every 2-D weight except the embedding and
    the LM head; AdamW the other three."""
    matrices, embedding, head, scalars = [], [], [], []
    for name, p in model.named_parameters():
        if name == "model.embed_tokens.weight":
            embedding.append(p)
        elif name == "lm_head.weight":
            head.append(p)
        elif p.ndim == 2:
            matrices.append(p)
        else:
            scalars.append(p)
    return matrices, embedding, head, scalars


def muon_ns_choice(model: GPT, ns_dtype: str = "auto") -> NSDtypeChoice:
    """The Newton-Schulz dtype build_optimizers uses for `model` on its device (choose_ns_dtype), with the
    reason; `.describe()` is a line for the printed plan.

    Raises:
        ValueError: ns_dtype not in "auto", "float32", "bfloat16".
    """
    return choose_ns_dtype(ns_dtype, split_parameters(model)[0][0].device)


def planned_ns_choice(ns_dtype: str, use_gpu: bool) -> str:
    """What the workers' Muon will orthogonalize in, as the driver can tell before they start: the choice
    for this machine's CPU (workers on other machines check their own), or for this machine's GPU; with
    use_gpu on a driver without CUDA, the rule each GPU worker applies."""
    if use_gpu and not torch.cuda.is_available():
        if ns_dtype != "auto":
            return f"Newton-Schulz in {ns_dtype} (requested)"
        return "Newton-Schulz dtype chosen on each GPU worker: bfloat16 at compute capability >= 8.0, else float32"
    return choose_ns_dtype(ns_dtype, "cuda" if use_gpu else "cpu").describe()


def adamw_lr_scale(width: int) -> float:
    """The factor AdamW's learning rates (--embedding-lr, --unembedding-lr, --scalar-lr) are multiplied by for a
    model of `width` (n_embd): (width / 768) ** -0.5, nanochat's, so the defaults transfer across depths."""
    return (width / 768) ** -0.5


def peak_lrs_text(o, width: int) -> str:
    """The peak learning rates as the optimizers apply them to a model of `width` (n_embd), as training's and
    RL's plans print them; `o`: a config OptimSection. E.g. "Muon 0.0002 for the hidden matrices; AdamW x 3.464
    (= (width 64 / 768) ** -0.5): embedding 0.003464, lm_head 0.003464, norms 0.003464"."""
    scale = adamw_lr_scale(width)
    return (
        f"Muon {o.matrix_lr:g} for the hidden matrices; AdamW x {scale:.4g} (= (width {width} / 768) ** -0.5): "
        f"embedding {o.embedding_lr * scale:.4g}, lm_head {o.unembedding_lr * scale:.4g}, norms "
        f"{o.scalar_lr * scale:.4g}"
    )


def build_optimizers(model: GPT, cfg, *, shard: bool = True) -> list[torch.optim.Optimizer]:
    """[Muon(hidden matrices), AdamW(embedding, lm_head, norms)]; each group records its peak lr as 'initial_lr'.

    cfg (raychat.config.train.OptimSection) supplies matrix_lr, embedding_lr, unembedding_lr, scalar_lr,
    weight_decay and ns_dtype ("auto", "float32", "bfloat16": Muon's Newton-Schulz dtype, muon_ns_choice).
    Muon shards its orthogonalization over the ranks whenever a torch.distributed group is initialized at
    step time, which needs the gradients to be the same on every rank (DDP, or the RL learner's all-reduce);
    shard=False never shards (a process whose torch.distributed group is not its data-parallel group: a
    single RL learner in a gloo weight-broadcast group).

    Raises:
        ValueError: cfg.ns_dtype not in "auto", "float32", "bfloat16".
    """
    scale = adamw_lr_scale(model.config.n_embd)
    matrices, embedding, head, scalars = split_parameters(model)
    muon = Muon(
        matrices,
        lr=cfg.matrix_lr,
        momentum=0.95,
        weight_decay=cfg.weight_decay,
        ns_dtype=muon_ns_choice(model, cfg.ns_dtype).dtype,
        shard=shard,
    )
    adamw = torch.optim.AdamW(
        [
            {"params": embedding, "lr": cfg.embedding_lr * scale},
            {"params": head, "lr": cfg.unembedding_lr * scale},
            {"params": scalars, "lr": cfg.scalar_lr * scale},
        ],
        betas=(0.8, 0.95),
        eps=1e-10,
        weight_decay=0.0,
    )
    optimizers = [muon, adamw]
    for opt in optimizers:
        for group in opt.param_groups:
            group["initial_lr"] = group["lr"]
    return optimizers


def lr_multiplier(
    step: int, num_iterations: int, warmup_ratio: float, warmdown_ratio: float, final_lr_frac: float
) -> float:
    """The lr multiplier (a float, 1 = the peak) of optimizer step `step` (0-based) of `num_iterations`:
    warmup U = round(warmup_ratio x N) steps at (step + 1) / U, so from 1 / U up to 1 at step U - 1; then 1;
    then warmdown W = round(warmdown_ratio x N) steps from step N - W at p + (1 - p) x final_lr_frac,
    p = (N - step) / W: 1 at step N - W, down to 1 / W + (1 - 1 / W) x final_lr_frac at the last step, N - 1.
    The schedule reaches final_lr_frac at step N, after the last update, so no step trains at lr 0 with the
    default final_lr_frac 0, and a warmdown (or warmup) of 1 step leaves the lr at the peak: nanochat's
    get_lr_multiplier (scripts/base_train.py), its warmup in ratios. A step at or past the end gets the end's
    value (final_lr_frac; 1 without a warmdown)."""
    warmup = round(warmup_ratio * num_iterations)
    warmdown = round(warmdown_ratio * num_iterations)
    if step < warmup:
        return (step + 1) / warmup
    if step < num_iterations - warmdown or warmdown == 0:
        return 1.0
    progress = max(num_iterations - step, 0) / warmdown
    return progress + (1 - progress) * final_lr_frac


def warmdown_start(num_iterations: int, warmdown_ratio: float) -> int:
    """The warmdown's first step (0-based, as lr_multiplier's: add 1 for the step lines' count; its multiplier is
    still 1, each later one is lower)."""
    return num_iterations - round(warmdown_ratio * num_iterations)


def lr_peak_from(
    step: int, num_iterations: int, warmup_ratio: float, warmdown_ratio: float, final_lr_frac: float
) -> float:
    """The largest lr_multiplier of the steps from `step` (0-based) to the end: the schedule rises only
    through its warmup (to 1 at the warmup's last step) and never after it."""
    last_warmup_step = min(round(warmup_ratio * num_iterations), num_iterations) - 1
    return lr_multiplier(
        max(step, last_warmup_step), num_iterations, warmup_ratio, warmdown_ratio, final_lr_frac
    )


def set_lr(optimizers: list[torch.optim.Optimizer], multiplier: float) -> float:
    """Scale every group's peak lr; returns the Muon lr now in force (for logging)."""
    for opt in optimizers:
        for group in opt.param_groups:
            group["lr"] = group["initial_lr"] * multiplier
    return optimizers[0].param_groups[0]["lr"]
