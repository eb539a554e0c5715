"""Where one decode step's CPU time goes: ModelRunner.forward_rows over --rows rows of --context cached
tokens (different lengths: the "lengths" plan), random depth-derived model, one torch thread.

Prints (1) CPU ms per step through the packed weights (PackedGPT, the default on CPU) and through the
model's own forward (packed_weights=False); (2) the default path's step split by torch.profiler op
into attention (the decode kernel's matmuls + softmax), Linears, and everything else (norms, RoPE, KV
write, residual adds, views); (3) one layer's decode attention at these shapes: SDPA's CPU flash kernel
with the dense mask (what the engine runs) vs the same attention as two batched matmuls, and each matmul
alone, beside the time to read the same keys and values once (a sum over them: the memory floor).

    python bench/engine_step_profile.py --rows 19 --context 400
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F
from _common import machine, uptime
from _engine_common import random_model, synthetic_tokenizer
from torch.profiler import profile

from raychat.engine import ModelRunner
from raychat.engine.attention import dense_mask

ATTENTION_OPS = ("aten::bmm", "aten::_softmax", "aten::_scaled_dot_product_flash_attention_for_cpu")
LINEAR_OPS = ("mkldnn::_linear_pointwise", "aten::mm", "aten::addmm")


def two_matmuls(q, keys, values, bias):
    """softmax(K q^T / sqrt(D) + bias) V: the eager alternative to SDPA for one query per head."""
    scores = torch.matmul(keys, q.transpose(-1, -2)).transpose(-1, -2) * q.shape[-1] ** -0.5
    return torch.matmul(torch.softmax(scores + bias, dim=-1), values)


def best_ms(fn, n: int, repeats: int = 3) -> float:
    """Best over `repeats` of the mean CPU milliseconds of n calls of fn(i)."""
    best = float("inf")
    for _ in range(repeats):
        c0 = time.process_time()
        for i in range(n):
            fn(i)
        best = min(best, (time.process_time() - c0) / n * 1e3)
    return best


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--depth", type=int, default=8)
    p.add_argument("--vocab", type=int, default=4096)
    p.add_argument("--rows", type=int, default=19, help="decoding rows (19 = the mean of the 32-row bench)")
    p.add_argument("--context", type=int, default=400, help="cached tokens of the longest row")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--threads", type=int, default=1)
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    tok = synthetic_tokenizer(a.vocab)
    model = random_model(tok, a.depth, a.context + 4 * a.steps + 2)
    B, S = a.rows, a.context
    print(f"{machine()}; {a.threads} thread(s); load `{uptime()}`")
    print(f"depth {a.depth}, {B} rows, cached tokens {S - B + 1}..{S} (one per row apart)\n")

    def stepper(engine):
        cache = engine.new_cache(B, S + 4 * a.steps + 2)
        cache.lengths[:] = torch.arange(S, S - B, -1)
        return lambda i: engine.forward_rows(cache, 0, [[5]] * B)

    for name, packed in (("packed weights (default)", "auto"), ("the model's forward", False)):
        engine = ModelRunner(model, tok, packed_weights=packed)
        step = stepper(engine)
        step(0)
        print(f"CPU ms per decode step, {name}: {best_ms(step, a.steps):.1f}")

    step = stepper(ModelRunner(model, tok))
    step(0)  # packs the weights
    with profile() as prof:
        for i in range(a.steps):
            step(i)
    by_op = {e.key: e.self_cpu_time_total / 1e3 / a.steps for e in prof.key_averages()}
    total = sum(by_op.values())
    attn = sum(v for k, v in by_op.items() if k in ATTENTION_OPS)
    lin = sum(v for k, v in by_op.items() if k in LINEAR_OPS)
    print(f"\nprofiled step: {total:.1f} ms = attention {attn:.1f} ({attn / total:.0%}) + Linears {lin:.1f} "
          f"({lin / total:.0%}) + other {total - attn - lin:.1f} ({(total - attn - lin) / total:.0%})")  # fmt: skip
    top = sorted(((v, k) for k, v in by_op.items() if k not in ATTENTION_OPS + LINEAR_OPS), reverse=True)
    print("  largest other ops (ms/step): " + ", ".join(f"{k} {v:.2f}" for v, k in top[:8]))

    cfg = model.config
    H, D = cfg.n_kv_head, cfg.head_dim
    M = S + S // 2  # a cache row holds more slots than are filled: views with the cache's strides
    layers = [
        (torch.randn(B, H, M, D)[:, :, :S], torch.randn(B, H, M, D)[:, :, :S]) for _ in range(cfg.n_layer)
    ]
    q = torch.randn(B, H, 1, D)
    starts = torch.arange(S - 1, S - 1 - B, -1)
    mask = dense_mask(starts, 1, S)
    bias = torch.zeros(mask.shape).masked_fill(~mask, float("-inf"))
    probs = torch.softmax(torch.randn(B, H, 1, S), dim=-1)
    kv = lambda i: layers[i % len(layers)]  # noqa: E731 - cycle the layers: out of cache, as in a step
    rows = {
        "SDPA flash kernel, dense mask": lambda i: F.scaled_dot_product_attention(q, *kv(i), attn_mask=mask),
        "two matmuls + softmax": lambda i: two_matmuls(q, *kv(i), bias),
        "  K q^T alone": lambda i: torch.matmul(kv(i)[0], q.transpose(-1, -2)),
        "  P V alone": lambda i: torch.matmul(probs, kv(i)[1]),
        "read K and V once (sum)": lambda i: (kv(i)[0].sum(), kv(i)[1].sum()),
    }
    mb = 2 * B * H * S * D * 4 / 1e6
    print(f"\none layer's decode attention, {B} rows x {H} heads x {S} slots x {D} ({mb:.1f} MB of K and V):")
    for name, fn in rows.items():
        ms = best_ms(fn, 4 * cfg.n_layer)
        print(f"  {name:32s} {ms:6.2f} ms")


if __name__ == "__main__":
    main()
