"""Muon for hidden weight matrices: momentum, Nesterov, Newton-Schulz orthogonalization.

The update of `torch.optim.Muon` (torch 2.13, torch/optim/_muon.py; Jordan et al. 2024,
https://kellerjordan.github.io/posts/muon/), with two things torch's class cannot be told:
  - the dtype of the Newton-Schulz iteration. torch always casts to bfloat16, which a CPU without native
    bf16 matmul emulates far slower than fp32, while one with AVX512-BF16 runs it faster than fp32
    (bench/results/muon_step.md). `choose_ns_dtype` picks
    the fast dtype of the device by a capability check (bf16 tensor cores on CUDA, AVX512-BF16 on CPU).
  - sharding the orthogonalization over the ranks of a data-parallel group (`Muon(shard=True)`), as
    nanochat's DistMuon does: each rank orthogonalizes its share of the matrices, the results are
    all-gathered, and every rank applies the same update. Momentum buffers stay replicated (every rank
    updates all of them), so optimizer state is identical on all ranks.

One step, for each matrix parameter W (m x n) with gradient G, momentum mu, lr gamma, weight decay lambda
(torch's exact operations in brackets):
    B <- mu B + (1 - mu) G                           [buf.lerp_(grad, 1 - mu)]
    U <- (1 - mu) G + mu B if nesterov, else B       [grad.lerp(buf, mu)]
    O <- NS_k(U)                                     (zeropower_via_newtonschulz)
    W <- W (1 - gamma lambda)                        (decoupled weight decay with the unadjusted lr)
    W <- W - gamma' O,  gamma' = gamma sqrt(max(1, m / n))   ("original", Keller Jordan's scaling)
                        or gamma' = 0.2 gamma sqrt(max(m, n)) ("match_rms_adamw", Liu et al. 2025)
With ns_dtype=torch.bfloat16 this is bit-identical to torch.optim.Muon (tests/unit/test_muon.py checks it).
The param_groups carry torch.optim.Muon's keys, so checkpoints of either load into the other.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist

from raychat.model import fast_bf16

# Quintic Newton-Schulz coefficients from Keller Jordan's Muon (https://github.com/KellerJordan/Muon,
# muon.py at f90a42b), the defaults of torch.optim.Muon: chosen to maximize the slope at zero, so 5 steps
# map every singular value in [0.005, 1] into [0.68, 1.16] rather than exactly to 1.
NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)
NS_STEPS = 5
EPS = 1e-7
ADJUST_LR_FNS = (None, "original", "match_rms_adamw")
NS_DTYPES = ("auto", "float32", "bfloat16")  # --ns-dtype; auto: choose_ns_dtype


def zeropower_via_newtonschulz(
    grad: torch.Tensor,
    coefficients: tuple[float, float, float] = NS_COEFFICIENTS,
    steps: int = NS_STEPS,
    eps: float = EPS,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """Approximate orthogonalization U S' V^T of G = U S V^T (S' near 1), as torch.optim.Muon computes it.

    X = G / max(||G||_F, eps) in `dtype` (so every singular value is <= 1), transposed when m > n so the
    Gram matrix is the smaller one; then `steps` times:  A = X X^T;  X = a X + (b A + c A A) X.
    Each step maps every singular value s of X to p(s) = a s + b s^3 + c s^5 and keeps the singular vectors.

    Args:
        grad: (m, n) matrix, any float dtype; not modified.
        coefficients: (a, b, c) of the quintic p.
        steps: iterations (< 100).
        eps: lower bound of the Frobenius norm in the normalization.
        dtype: dtype of the iteration (torch.optim.Muon: torch.bfloat16).
    Returns:
        (m, n) tensor of `dtype` (a transposed view when m > n).
    Raises:
        ValueError: grad is not 2-D, steps >= 100, or coefficients is not 3 values.
    """
    if steps >= 100:
        raise ValueError(f"ns_steps must be < 100, got {steps}")
    if grad.ndim != 2:
        raise ValueError(f"Newton-Schulz needs a 2-D matrix, got shape {tuple(grad.shape)}")
    if len(coefficients) != 3:
        raise ValueError(f"ns_coefficients must be 3 values (a, b, c), got {coefficients}")
    a, b, c = coefficients
    x = grad.to(dtype, copy=True)  # a copy even when grad already has `dtype`: div_ below is in place
    if grad.size(0) > grad.size(1):
        x = x.T
    x.div_(x.norm().clamp(min=eps))
    for _ in range(steps):
        gram = x @ x.T
        poly = torch.addmm(gram, gram, gram, beta=b, alpha=c)
        x = torch.addmm(x, poly, x, beta=a)
    return x.T if grad.size(0) > grad.size(1) else x


def ns_flops(shape: tuple[int, int], steps: int = NS_STEPS) -> int:
    """Multiply-add FLOPs of zeropower_via_newtonschulz on an (m, n) matrix: with s = min(m, n) and
    w = max(m, n), each step costs X X^T (2 s^2 w) + A A (2 s^3) + (.) X (2 s^2 w)."""
    s, w = sorted(shape)
    return steps * (4 * s * s * w + 2 * s**3)


@dataclass(frozen=True)
class NSDtypeChoice:
    """The Newton-Schulz dtype chosen for a device, and why (for the trainer's printed plan).

    dtype: torch.float32 or torch.bfloat16. device: e.g. "cpu", "cuda:0". reason: a short phrase.
    """

    dtype: torch.dtype
    device: str
    reason: str

    def describe(self) -> str:
        return f"Newton-Schulz in {str(self.dtype).removeprefix('torch.')} on {self.device} ({self.reason})"


def choose_ns_dtype(request: str = "auto", device: str | torch.device = "cpu") -> NSDtypeChoice:
    """The dtype to run Newton-Schulz in on `device`.

    "float32" / "bfloat16": that dtype. "auto": bfloat16 where the device has native bf16 matrix math,
    else float32:
      CUDA: compute capability >= 8.0 (bf16 tensor cores: A100, H100, L4, ...);
      CPU: the AVX512-BF16 instructions (Intel Cooper Lake / Sapphire Rapids and later, AMD Zen 4 and later;
           torch's cpuinfo check torch.cpu._is_avx512_bf16_supported), where oneDNN's bf16 GEMM is faster
           than fp32; without them bf16 is emulated, far slower than fp32 (bench/results/muon_step.md);
      any other device: float32.
    A rule rather than a timing, so every run and every resume on the same machine chooses the same
    (exact resume; a timing near a tie flips between runs). bench/muon_step.py times both dtypes to check
    the rule on a machine.

    Raises:
        ValueError: `request` is not one of NS_DTYPES (names the ns_dtype setting).
    """
    if request not in NS_DTYPES:
        raise ValueError(f"ns_dtype must be one of {NS_DTYPES}, got {request!r}")
    dev = str(torch.device(device))
    if request != "auto":
        return NSDtypeChoice(getattr(torch, request), dev, "requested")
    fast, reason = fast_bf16(device)  # the rule (raychat.model), shared with the engine's KV-cache dtype
    return NSDtypeChoice(torch.bfloat16 if fast else torch.float32, dev, reason)


def assign_owners(shapes: list[tuple[int, int]], world_size: int) -> list[int]:
    """Rank that orthogonalizes each matrix, balancing Newton-Schulz FLOPs (ns_flops) over ranks.

    Greedy longest-processing-time first (Graham 1969): matrices in decreasing cost (index breaks ties)
    each go to the least-loaded rank (lowest rank on ties). Deterministic, so every rank computes the same
    assignment from the same shapes.
    """
    load = [0] * world_size
    owners = [0] * len(shapes)
    for i in sorted(range(len(shapes)), key=lambda i: (-ns_flops(shapes[i]), i)):
        r = min(range(world_size), key=lambda r: (load[r], r))
        owners[i] = r
        load[r] += ns_flops(shapes[i])
    return owners


def adjusted_lr(lr: float, adjust_lr_fn: str | None, shape: torch.Size) -> float:
    """torch.optim.Muon's lr scaling for an (m, n) matrix: None / "original" -> lr sqrt(max(1, m / n))
    (Keller Jordan); "match_rms_adamw" -> 0.2 lr sqrt(max(m, n)) (Liu et al. 2025, "Muon is Scalable")."""
    m, n = shape[:2]
    if adjust_lr_fn == "match_rms_adamw":
        return lr * 0.2 * math.sqrt(max(m, n))
    return lr * math.sqrt(max(1, m / n))


_WIRE_DTYPES = (torch.float32, torch.bfloat16)  # ns_dtype's code in the one-time broadcast from rank 0


class Muon(torch.optim.Optimizer):
    """Muon over 2-D parameters: torch.optim.Muon's update (module docstring) with a chosen Newton-Schulz
    dtype and the orthogonalization optionally sharded over data-parallel ranks.

    Args:
        params: 2-D parameters or param groups.
        lr, weight_decay, momentum, nesterov, ns_coefficients, eps, ns_steps, adjust_lr_fn: as
            torch.optim.Muon, with its defaults (1e-3, 0.1, 0.95, True, NS_COEFFICIENTS, 1e-7, 5, None).
        ns_dtype: dtype of the Newton-Schulz iteration, torch.float32 or torch.bfloat16 (see
            choose_ns_dtype). Not saved in the state_dict: it belongs to the machine, not the run.
        shard: when a torch.distributed process group is initialized at step time, each rank
            orthogonalizes the matrices assign_owners gives it and one all_gather shares the results; the
            update is the same as unsharded. The first such step broadcasts rank 0's ns_dtype so every rank
            computes in the same dtype. Precondition: every rank has the same gradients for the same
            parameters when it steps (DDP averages them; raychat.rl.learner all-reduces them).
        process_group: the data-parallel group (None: the default group).
    Raises:
        ValueError: a hyperparameter out of range, an unknown adjust_lr_fn or ns_dtype, or a parameter
            that is not 2-D.
    """

    def __init__(
        self,
        params,
        lr: float = 1e-3,
        weight_decay: float = 0.1,
        momentum: float = 0.95,
        nesterov: bool = True,
        ns_coefficients: tuple[float, float, float] = NS_COEFFICIENTS,
        eps: float = EPS,
        ns_steps: int = NS_STEPS,
        adjust_lr_fn: str | None = None,
        *,
        ns_dtype: torch.dtype = torch.float32,
        shard: bool = True,
        process_group: dist.ProcessGroup | None = None,
    ):
        for name, value in (("lr", lr), ("momentum", momentum), ("weight_decay", weight_decay)):
            if not value >= 0:
                raise ValueError(f"Muon {name} must be >= 0, got {value}")
        if adjust_lr_fn not in ADJUST_LR_FNS:
            raise ValueError(f"Muon adjust_lr_fn must be one of {ADJUST_LR_FNS}, got {adjust_lr_fn!r}")
        if ns_dtype not in _WIRE_DTYPES:
            raise ValueError(f"Muon ns_dtype must be one of {_WIRE_DTYPES}, got {ns_dtype}")
        defaults = {
            "lr": lr,
            "weight_decay": weight_decay,
            "momentum": momentum,
            "nesterov": nesterov,
            "ns_coefficients": ns_coefficients,
            "eps": eps,
            "ns_steps": ns_steps,
            "adjust_lr_fn": adjust_lr_fn,
        }
        super().__init__(params, defaults)
        for group in self.param_groups:
            for p in group["params"]:
                if p.ndim != 2:
                    raise ValueError(f"Muon only supports 2-D parameters, got one of shape {tuple(p.shape)}")
        self.ns_dtype = ns_dtype
        self.shard = shard
        self.process_group = process_group
        self._dtype_agreed = False

    @torch.no_grad()
    def step(self, closure=None):
        """One update of every parameter that has a gradient (see the module docstring); returns the
        closure's loss, if a closure is given.

        Raises:
            RuntimeError: a complex parameter or a sparse gradient.
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        work = []  # (group, parameter, momentum update U)
        for group in self.param_groups:
            mu = group["momentum"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                if torch.is_complex(p):
                    raise RuntimeError("Muon does not support complex parameters")
                if p.grad.is_sparse:
                    raise RuntimeError("Muon does not support sparse gradients")
                state = self.state[p]
                if "momentum_buffer" not in state:
                    state["momentum_buffer"] = torch.zeros_like(p.grad, memory_format=torch.preserve_format)
                buf = state["momentum_buffer"]
                buf.lerp_(p.grad, 1 - mu)
                work.append((group, p, p.grad.lerp(buf, mu) if group["nesterov"] else buf))
        if not work:
            return loss
        if self.shard and dist.is_available() and dist.is_initialized():
            updates = self._orthogonalize_sharded(work)
        else:
            updates = [self._orthogonalize(group, u) for group, _, u in work]
        for (group, p, _), o in zip(work, updates, strict=True):
            p.mul_(1 - group["lr"] * group["weight_decay"])
            p.add_(o, alpha=-adjusted_lr(group["lr"], group["adjust_lr_fn"], p.shape))
        return loss

    def _orthogonalize(self, group: dict, u: torch.Tensor) -> torch.Tensor:
        return zeropower_via_newtonschulz(
            u, group["ns_coefficients"], group["ns_steps"], group["eps"], self.ns_dtype
        )

    def _orthogonalize_sharded(self, work: list) -> list[torch.Tensor]:
        """NS of this rank's matrices, packed into one flat buffer padded to the largest rank's load, then
        all_gather; returns every matrix's result (a view into the gathered buffers)."""
        pg = self.process_group
        rank, world = dist.get_rank(pg), dist.get_world_size(pg)
        device = work[0][2].device
        if not self._dtype_agreed:
            code = torch.tensor([_WIRE_DTYPES.index(self.ns_dtype)], device=device)
            dist.broadcast(code, group_src=0, group=pg)
            self.ns_dtype, self._dtype_agreed = _WIRE_DTYPES[int(code.item())], True
        owners = assign_owners([tuple(u.shape) for *_, u in work], world)
        offsets, load = [], [0] * world
        for owner, (*_, u) in zip(owners, work):
            offsets.append(load[owner])
            load[owner] += u.numel()
        mine = torch.empty(max(load), dtype=self.ns_dtype, device=device)
        for owner, offset, (group, _, u) in zip(owners, offsets, work):
            if owner == rank:
                mine[offset : offset + u.numel()].view(u.shape).copy_(self._orthogonalize(group, u))
        gathered = [torch.empty_like(mine) for _ in range(world)]
        dist.all_gather(gathered, mine, group=pg)
        return [
            gathered[owner][offset : offset + u.numel()].view(u.shape)
            for owner, offset, (*_, u) in zip(owners, offsets, work)
        ]
