"""Muon's share of a training step at the cpu preset: torch.optim.Muon vs raychat.train.muon, in one run.

    python bench/muon_step.py --steps 5 --skip 1 --out bench/results/muon_step.md

The cpu preset's model and batch: GPT depth 4 (width 256, 4 heads, SwiGLU 704), vocab 4096, 8 rows x 256
tokens per micro-batch, 4 micro-batches (8192 tokens) per optimizer step, fp32, no compile. Token ids are
uniform random (the step's compute does not depend on their values). Every variant has its own copy of
the same model and the variants take turns step by step, so load drift on this shared machine hits all.
A step is what raychat.train.trainer.Trainer does: forward+backward of each micro-batch (token-normalized CE), clip
the grad norm, Muon step, AdamW step (raychat.train.optim.build_optimizers; torch's Muon swapped in for
the "torch.optim.Muon" rows).

1 process, 2 torch threads: torch.optim.Muon (Newton-Schulz in bf16) | ours in fp32 | ours "auto".
2 gloo processes, 1 thread each (the preset's 2 workers), DDP as Ray Train's prepare_model sets it up, 2
micro-batches per rank: torch.optim.Muon | ours fp32 unsharded | ours fp32 sharded | ours "auto" sharded.
In the 2-process rows the gradient all-reduce is timed apart from fwd+bwd (every backward under no_sync,
then one coalesced all_reduce of the gradients: the same average DDP computes, without its overlap with the
last backward); the times are rank 0's (Muon's sharded all_gather waits for the slower rank, so its time
includes that imbalance). Data loading is not in this script (token ids are generated): the Ray runs of
bench/train_throughput.py measure it (their "data wait" column).
Medians over the steps after the first --skip. Also printed: one bf16 vs fp32 matmul pair on the 704x256
matrix shape (X X^T, then A X: what Newton-Schulz does) beside the dtype that choose_ns_dtype's capability
rule picks here, to check the rule against a measurement.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from _common import append_result, command_line, machine, uptime

from raychat.config import TrainConfig, from_dict
from raychat.loss import cross_entropy_sum, global_target_count, normalize
from raychat.masks import make_batch
from raychat.model import GPT, ModelConfig
from raychat.ports import free_ports
from raychat.train.optim import build_optimizers, muon_ns_choice

CFG = TrainConfig().optim  # the preset's learning rates (cpu.yaml keeps TrainConfig's optimizer defaults)
VOCAB, DEPTH, ROWS, SEQ, MICRO = 4096, 4, 8, 256, 4
PHASES = ("fwd_bwd", "all_reduce", "clip", "muon", "adamw")


def model_and_optimizers(variant: str) -> tuple[GPT, list]:
    """A fresh copy of the model (seed 0) and the optimizers of `variant`."""
    torch.manual_seed(0)
    model = GPT(ModelConfig.from_depth(DEPTH, VOCAB, SEQ)).init_weights(0)
    cfg = from_dict(TrainConfig, {"ns_dtype": "auto" if "auto" in variant else "float32"}).optim
    opts = build_optimizers(model, cfg)
    if variant.startswith("torch"):
        group = opts[0].param_groups[0]
        opts[0] = torch.optim.Muon(
            group["params"], lr=group["lr"], momentum=group["momentum"], weight_decay=group["weight_decay"]
        )
    opts[0].shard = "unsharded" not in variant
    return model, opts


def micro_batches(step: int, ranks: range) -> list[dict]:
    g = torch.Generator().manual_seed(step)
    ids = [torch.randint(1, VOCAB, (ROWS, SEQ + 1), generator=g) for _ in range(MICRO)]
    return [make_batch(ids[i], bos_id=0) for i in ranks]


def all_reduce_mean(model: GPT, world: int) -> None:
    """Average the gradients over the ranks in one coalesced all_reduce (what DDP's buckets do)."""
    grads = [p.grad for p in model.parameters()]
    flat = torch._utils._flatten_dense_tensors(grads)
    dist.all_reduce(flat)
    flat /= world
    for g, reduced in zip(grads, torch._utils._unflatten_dense_tensors(flat, grads)):
        g.copy_(reduced)


def timed_step(model, train_model, opts, micro: list[dict], world: int) -> dict[str, float]:
    """One optimizer step; seconds per phase. With world > 1 every backward runs under DDP's no_sync and
    the gradients are then averaged by all_reduce_mean, so the all-reduce is timed on its own (DDP would
    overlap it with the last backward)."""
    t0 = time.perf_counter()
    n = global_target_count(mb["loss_mask"] for mb in micro)
    for mb in micro:
        with train_model.no_sync() if world > 1 else contextlib.nullcontext():
            logits = train_model(mb["input_ids"], position_ids=mb["position_ids"])
            normalize(cross_entropy_sum(logits, mb["labels"], mb["loss_mask"])[0], n, world).backward()
    t1 = time.perf_counter()
    if world > 1:
        all_reduce_mean(model, world)
    t_ar = time.perf_counter()
    torch.nn.utils.clip_grad_norm_(model.parameters(), CFG.grad_clip)
    t2 = time.perf_counter()
    opts[0].step()
    t3 = time.perf_counter()
    opts[1].step()
    t4 = time.perf_counter()
    for opt in opts:
        opt.zero_grad(set_to_none=True)
    return dict(zip(PHASES, (t1 - t0, t_ar - t1, t2 - t_ar, t3 - t2, t4 - t3)))


def run_variants(variants: list[str], steps: int, rank: int = 0, world: int = 1) -> dict:
    """Per-variant lists of phase times, the Newton-Schulz dtype each ran in, and the final weights. The
    variants take turns step by step, in an order rotated every step (no variant always runs first)."""
    setups = {v: model_and_optimizers(v) for v in variants}
    wrapped = {
        v: torch.nn.parallel.DistributedDataParallel(m) if world > 1 else m for v, (m, _) in setups.items()
    }
    times = {v: [] for v in variants}
    share = range(rank * MICRO // world, (rank + 1) * MICRO // world)
    for step in range(steps):
        micro = micro_batches(step, share)
        for v in variants[step % len(variants) :] + variants[: step % len(variants)]:
            model, opts = setups[v]
            if world > 1:
                dist.barrier()
            times[v].append(timed_step(model, wrapped[v], opts, micro, world))
    return {
        "times": times,
        "dtypes": {v: str(getattr(o[0], "ns_dtype", torch.bfloat16)) for v, (_, o) in setups.items()},
        "weights": {v: [p.detach() for p in m.parameters()] for v, (m, _) in setups.items()},
    }


def _rank(rank, world, port, variants, steps, out):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        result = run_variants(variants, steps, rank, world)
        if rank == 0:
            out["result"] = result
    finally:
        dist.destroy_process_group()


def matmul_pair_ms(dtype: torch.dtype, repeats: int = 10) -> float:
    """Median time of X X^T then A X for X of shape (256, 704), milliseconds, at the current thread count."""
    x = torch.randn(256, 704).to(dtype)
    ts = []
    for _ in range(repeats + 1):
        t0 = time.perf_counter()
        a = x @ x.T
        a @ x
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts[1:]) * 1e3


def table(title: str, result: dict, skip: int, base: str) -> str:
    times = result["times"]
    med = {v: {k: statistics.median(t[k] for t in ts[skip:]) for k in PHASES} for v, ts in times.items()}
    lines = [
        f"**{title}** (median s over {len(next(iter(times.values()))) - skip} steps)",
        "",
        "| variant | NS dtype | fwd+bwd s | all-reduce s | clip s | Muon s | AdamW s | step s | optimizer share "
        "| tokens/s | step vs first |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    base_step = sum(med[base].values())
    for v, m in med.items():
        step = sum(m.values())
        lines.append(
            f"| {v} | {result['dtypes'][v].removeprefix('torch.')} | {m['fwd_bwd']:.3f} | {m['all_reduce']:.4f} "
            f"| {m['clip']:.4f} | {m['muon']:.3f} | {m['adamw']:.4f} | {step:.3f} | "
            f"{100 * (m['muon'] + m['adamw']) / step:.1f}% | {ROWS * SEQ * MICRO / step:,.0f} | "
            f"{step / base_step:.2f}x |"
        )
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=5, help="steps per variant (default 5)")
    ap.add_argument("--skip", type=int, default=1, help="warm-up steps left out of the medians (default 1)")
    ap.add_argument("--out", default=None, help="append the markdown result here")
    args = ap.parse_args()
    load_before = uptime()

    torch.set_num_threads(2)
    pair = {name: matmul_pair_ms(dt) for name, dt in (("bf16", torch.bfloat16), ("fp32", torch.float32))}
    choice = muon_ns_choice(GPT(ModelConfig.from_depth(DEPTH, VOCAB, SEQ)))
    faster = "bfloat16" if pair["bf16"] < pair["fp32"] else "float32"
    auto = "ours auto"
    base = "torch.optim.Muon (bf16 NS)"
    one = run_variants([base, "ours fp32", auto], args.steps)

    variants = [base, "ours fp32 unsharded", "ours fp32 sharded", f"{auto} sharded"]
    with mp.Manager() as manager:
        out = manager.dict()
        mp.spawn(_rank, args=(2, free_ports(1)[0], variants, args.steps, out), nprocs=2, join=True)
        two = dict(out)["result"]
    w = two["weights"]
    sharding_diff = max(
        (a - b).abs().max().item() for a, b in zip(w["ours fp32 unsharded"], w["ours fp32 sharded"])
    )

    text = "\n\n".join(
        [
            f"## Muon step share, cpu preset model ({time.strftime('%Y-%m-%d %H:%M')})",
            f"`{command_line()}`\n\n{machine()}; uptime before: `{load_before}`; after: `{uptime()}`",
            f"matmul pair on (256, 704) (X X^T, A X), 2 threads: bf16 {pair['bf16']:.2f} ms, fp32 "
            f"{pair['fp32']:.2f} ms (bf16 / fp32 = {pair['bf16'] / pair['fp32']:.2f}x). "
            f"choose_ns_dtype('auto') here: {choice.describe()}; the faster dtype by the timing: {faster}.",
            table("1 process, 2 threads, 4 micro-batches", one, args.skip, base),
            table("2 gloo processes (DDP), 1 thread each, 2 micro-batches each", two, args.skip, base),
            f"Sharded vs unsharded weights after {args.steps} steps (2 processes): max |diff| = {sharding_diff:.1e}.",
        ]
    )
    print(text)
    if args.out:
        append_result(args.out, text)


if __name__ == "__main__":
    main()
