"""Inference benchmark (nanochat's scripts/infer_bench.py as the model): latency, tokens/s, memory and MBU of
ModelRunner.generate_batch over a sweep of decode batch sizes, on this machine's CPU; then the accuracy cost
of a bfloat16 KV cache against float32 on a trained model.

Decode is memory-bound: every step reads all the weights and every row's KV cache for a little math. MBU
(model bandwidth utilization, the decode counterpart of MFU) = bytes a decode step must read / step time /
peak memory bandwidth, where
  bytes a step must read = the weights a token passes through (every parameter but the embedding table, of
      which a step reads B rows; the LM head is untied and counted) + B * KV bytes per token * context,
      context = prompt + decode/2 (the mean context of the decode steps, as nanochat's context_mid);
  peak bandwidth = this machine's measured copy bandwidth (a 256 MiB tensor copied with dst.copy_(src),
      bytes read + written, best of 5, on the same number of torch threads as the decode).
Each batch size: one warm-up generation, then generate_batch(one prompt, num_samples=B) timed twice, with
max_tokens=1 (prefill + cache replication + first sample: TTFT) and max_tokens=--decode-tokens; a decode
step = (second - first) / (decode_tokens - 1). Times are CPU seconds of this single-threaded process (the
machine is shared; wall seconds are printed beside them). Memory: the KV cache's and weights' bytes, and
the process' peak RSS. Random depth-derived model (special-token LM-head rows zero: no row stops early),
greedy, fp32 weights (the engine's default dtype on CPU).

Accuracy (--accuracy-steps > 0): a depth-2 model trained for that many AdamW steps on this repository's
Markdown docs (byte-pair synthetic tokenizer of bench/_engine_common), then for 16 held-out prompts of 64
tokens: greedy completions of 48 tokens with the KV cache in float32 and in bfloat16 (token agreement:
positions equal up to the first difference, and completions identical), and the largest |logprob
difference| over the whole vocabulary along the float32 greedy path (teacher-forced, both caches fed the
same tokens).

The last line of stdout is one JSON document with everything printed. Writes --out (markdown) if given.

    python bench/infer_bench.py --out bench/results/infer_bench.md
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from _common import machine, uptime
from _engine_common import REPO, random_model, random_prompts, synthetic_tokenizer

from raychat.engine import KVCache, ModelRunner
from raychat.model import GPT, ModelConfig, fast_bf16


def copy_bandwidth(mib: int = 256, repeats: int = 5) -> float:
    """Bytes per CPU second of dst.copy_(src) for `mib` MiB fp32 tensors (read + write), best of repeats."""
    src = torch.randn(mib * 2**18)
    dst = torch.empty_like(src)
    dst.copy_(src)
    best = float("inf")
    for _ in range(repeats):
        c0 = time.process_time()
        dst.copy_(src)
        best = min(best, time.process_time() - c0)
    return 2 * src.numel() * src.element_size() / best


def timed(fn) -> tuple[float, float]:
    c0, w0 = time.process_time(), time.perf_counter()
    fn()
    return time.process_time() - c0, time.perf_counter() - w0


def sweep_point(engine: ModelRunner, prompt: list[int], rows: int, decode_tokens: int) -> dict:
    engine.generate_batch([prompt], num_samples=rows, max_tokens=4, temperature=0.0)  # warm-up
    ttft_cpu, ttft_wall = timed(
        lambda: engine.generate_batch([prompt], num_samples=rows, max_tokens=1, temperature=0.0)
    )
    out = []
    total_cpu, total_wall = timed(
        lambda: out.extend(
            engine.generate_batch([prompt], num_samples=rows, max_tokens=decode_tokens, temperature=0.0)
        )
    )
    assert all(len(r.completion_tokens) == decode_tokens for r in out), "a row stopped early"
    steps = decode_tokens - 1
    step_cpu = (total_cpu - ttft_cpu) / steps
    step_wall = (total_wall - ttft_wall) / steps
    return dict(rows=rows, ttft_s=ttft_cpu, ttft_wall_s=ttft_wall, step_s=step_cpu, step_wall_s=step_wall,
                tokens_per_s=rows / step_cpu, tokens_per_s_wall=rows / step_wall)  # fmt: skip


def read_bytes(model: GPT, rows: int, context: int, kv_dtype: torch.dtype) -> int:
    """Bytes one decode step of `rows` rows at `context` cached tokens must read (module docstring)."""
    emb = model.model.embed_tokens.weight
    weights = sum(p.numel() * p.element_size() for p in model.parameters()) - emb.numel() * emb.element_size()
    return (
        weights
        + rows * emb.shape[1] * emb.element_size()
        + rows * context * KVCache.bytes_per_token(model.config, kv_dtype)
    )


def attention_vs_floor(cfg, rows: int, context: int, dtype: torch.dtype, n: int = 20) -> dict:
    """One layer's decode attention as the engine runs it (CacheBatch.attend: write the new key/value, SDPA
    over the cache view, no copies) against reading the same keys and values once (a sum over each), in
    CPU ms per call (best of 3 runs of n calls) and the bytes of K and V over those times."""
    cache = KVCache(1, rows, cfg.n_kv_head, context + 1, cfg.head_dim, dtype)
    cache.lengths[:] = context
    q = torch.randn(rows, cfg.n_head, 1, cfg.head_dim, dtype=dtype)
    k = torch.randn(rows, cfg.n_kv_head, 1, cfg.head_dim, dtype=dtype)
    batch = cache.batch(0, rows, 1)

    def best(fn) -> float:
        fn()
        out = float("inf")
        for _ in range(3):
            c0 = time.process_time()
            for _ in range(n):
                fn()
            out = min(out, (time.process_time() - c0) / n)
        return out

    with torch.inference_mode():
        attend = best(lambda: batch.attend(0, q, k, k))
        floor = best(lambda: (cache.k[0, :, :, : context + 1].sum(), cache.v[0, :, :, : context + 1].sum()))
    nbytes = 2 * rows * cfg.n_kv_head * (context + 1) * cfg.head_dim * cache.k.element_size()
    return dict(rows=rows, dtype=str(dtype).removeprefix("torch."), attend_ms=attend * 1e3,
                read_once_ms=floor * 1e3, kv_bytes=nbytes, attend_gb_s=nbytes / attend / 1e9,
                read_once_gb_s=nbytes / floor / 1e9)  # fmt: skip


def sgemm_rate(n: int = 1024, repeats: int = 5) -> float:
    """FLOP per CPU second of an (n, n) @ (n, n) fp32 matmul, best of repeats: the machine's large-matmul rate."""
    a, b = torch.randn(n, n), torch.randn(n, n)
    a @ b
    best = float("inf")
    for _ in range(repeats):
        c0 = time.process_time()
        a @ b
        best = min(best, time.process_time() - c0)
    return 2 * n**3 / best


def read_bandwidth(mib: int = 256, repeats: int = 5) -> float:
    """Bytes per CPU second of reading a `mib` MiB fp32 tensor once (a sum), best of repeats: the read floor
    of data that does not stay in cache (a decode step's KV cache of many rows and layers)."""
    x = torch.randn(mib * 2**18)
    x.sum()
    best = float("inf")
    for _ in range(repeats):
        c0 = time.process_time()
        x.sum()
        best = min(best, time.process_time() - c0)
    return x.numel() * x.element_size() / best


LINEAR_OPS = ("mkldnn::_linear_pointwise", "aten::mm", "aten::addmm", "aten::linear")
ATTENTION_OPS = ("aten::_scaled_dot_product_flash_attention_for_cpu",)


def step_split(engine: ModelRunner, prompt: list[int], rows: int, context: int, steps: int = 8) -> dict:
    """Where one decode step's CPU time goes, at `rows` rows of `context` cached tokens: the Linears (the
    engine's matmul kernels), attention (SDPA), and everything else, from torch.profiler's self CPU time
    over `steps` decode forwards (ModelRunner.forward_rows, sampling excluded), with the Linears' FLOPs."""
    from torch.profiler import ProfilerActivity, profile

    cfg = engine.config
    cache = engine.new_cache(rows, context + steps + 2)
    with torch.inference_mode():
        engine.prefill(cache, [0], [(prompt * (context // len(prompt) + 1))[:context]])
        cache.replicate(0, list(range(rows)))
        engine.forward_rows(cache, 0, [[1]] * rows)  # warm-up
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            c0 = time.process_time()
            for _ in range(steps):
                engine.forward_rows(cache, 0, [[1]] * rows)
            total = (time.process_time() - c0) / steps
    by_op = {e.key: e.self_cpu_time_total / 1e6 / steps for e in prof.key_averages()}
    profiled = sum(by_op.values())
    linears = sum(by_op.get(k, 0.0) for k in LINEAR_OPS)
    attention = sum(by_op.get(k, 0.0) for k in ATTENTION_OPS)
    macs = sum(m.in_features * m.out_features for m in engine.model.modules() if type(m) is torch.nn.Linear)
    return dict(rows=rows, step_s=total, profiled_s=profiled, linears_s=linears, attention_s=attention,
                other_s=profiled - linears - attention, linear_flop=2 * rows * macs,
                kv_bytes=rows * context * KVCache.bytes_per_token(cfg, engine.kv_dtype))  # fmt: skip


# ---- accuracy of a bfloat16 KV cache on a trained model -------------------------------------------------
def docs_tokens(tok) -> list[int]:
    text = "\n\n".join(p.read_text() for p in sorted([REPO / "README.md", *(REPO / "docs").glob("*.md")]))
    return tok.encode(text)


def train_tiny(tok, ids: list[int], steps: int, seq: int = 128, batch: int = 16) -> GPT:
    """A depth-2 model trained with AdamW (lr 3e-3) on random windows of `ids`."""
    cfg = ModelConfig.from_depth(2, vocab_size=tok.vocab_size, max_seq_len=256)
    torch.manual_seed(0)
    model = GPT(cfg).init_weights(seed=0)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.0)
    data = torch.tensor(ids)
    g = torch.Generator().manual_seed(0)
    for _ in range(steps):
        at = torch.randint(0, len(data) - seq - 1, (batch,), generator=g)
        x = torch.stack([data[i : i + seq] for i in at])
        y = torch.stack([data[i + 1 : i + seq + 1] for i in at])
        loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
    model.final_loss = float(loss.detach())
    return model.eval()


def teacher_forced_logprobs(engine: ModelRunner, prompt: list[int], tokens: list[int]) -> torch.Tensor:
    """(len(tokens), V) fp32 log-probabilities of the next token after prompt + tokens[:i], i = 0..n-1."""
    cache = engine.new_cache(1, len(prompt) + len(tokens) + 1)
    out = [engine.prefill(cache, [0], [prompt])[0]]
    for t in tokens[:-1]:
        out.append(engine.decode(cache, [0], [t])[0])
    return torch.log_softmax(torch.stack(out).float(), dim=-1)


def accuracy(steps: int, new: int = 48, n_prompts: int = 16, prompt_len: int = 64) -> dict:
    tok = synthetic_tokenizer(4096)
    ids = docs_tokens(tok)
    split = int(len(ids) * 0.9)
    model = train_tiny(tok, ids[:split], steps)
    held = ids[split:]
    prompts = [[tok.bos_id, *held[i * 97 : i * 97 + prompt_len - 1]] for i in range(n_prompts)]
    e32 = ModelRunner(model, tok, kv_dtype="float32", prefix_cache_tokens=0)
    e16 = ModelRunner(model, tok, kv_dtype="bfloat16", prefix_cache_tokens=0)
    g32 = e32.generate_batch(prompts, max_tokens=new, temperature=0.0)
    g16 = e16.generate_batch(prompts, max_tokens=new, temperature=0.0)
    agree, total, identical, max_diff, max_chosen = 0, 0, 0, 0.0, 0.0
    for p, a, b in zip(prompts, g32, g16):
        x, y = a.completion_tokens, b.completion_tokens
        same = next((i for i, (s, t) in enumerate(zip(x, y)) if s != t), min(len(x), len(y)))
        agree, total, identical = agree + same, total + len(x), identical + (x == y)
        lp32 = teacher_forced_logprobs(e32, p, x)
        lp16 = teacher_forced_logprobs(e16, p, x)
        max_diff = max(max_diff, float((lp32 - lp16).abs().max()))
        chosen = torch.tensor(x)[:, None]
        max_chosen = max(max_chosen, float((lp32.gather(1, chosen) - lp16.gather(1, chosen)).abs().max()))
    return dict(train_steps=steps, final_train_loss=round(model.final_loss, 3), prompts=n_prompts,
                new_tokens=new, agreement=agree / total, identical_completions=identical,
                max_abs_logprob_diff=max_diff, max_abs_chosen_logprob_diff=max_chosen)  # fmt: skip


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--depth", type=int, default=8)
    ap.add_argument("--vocab", type=int, default=4096)
    ap.add_argument("--prompt-tokens", type=int, default=256)
    ap.add_argument("--decode-tokens", type=int, default=64)
    ap.add_argument("--batch-sizes", default="1,8,32")
    ap.add_argument("--kv-dtype", default="model,auto",
                    help="comma-separated KV-cache dtypes to sweep (ModelRunner kv_dtype: model, auto, "
                         "float32, bfloat16, float16)")  # fmt: skip
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--accuracy-steps", type=int, default=300, help="0 = skip the bf16 accuracy measurement")
    ap.add_argument("--out", default=None, help="also write a markdown report here")
    a = ap.parse_args(argv)
    torch.set_num_threads(a.threads)
    load_before = uptime()
    tok = synthetic_tokenizer(a.vocab)
    model = random_model(tok, a.depth, a.prompt_tokens + a.decode_tokens + 8)
    prompt = random_prompts(tok, 1, a.prompt_tokens)[0]
    bw = copy_bandwidth()
    cfg = model.config
    context = a.prompt_tokens + a.decode_tokens // 2
    fast, why = fast_bf16("cpu")
    payload = {
        "machine": machine(), "threads": a.threads, "depth": a.depth, "n_embd": cfg.n_embd,
        "num_params": sum(p.numel() for p in model.parameters()), "prompt_tokens": a.prompt_tokens,
        "decode_tokens": a.decode_tokens, "context_mid": context, "peak_bandwidth_bytes_per_s": bw,
        "fast_bf16": [fast, why], "sweep": [],
    }  # fmt: skip
    print(f"{machine()}; {a.threads} thread(s); load {load_before}")
    print(f"model: depth {a.depth}, width {cfg.n_embd}, {payload['num_params']:,} params (fp32), "
          f"context {a.prompt_tokens} + {a.decode_tokens}; measured copy bandwidth {bw / 1e9:.2f} GB/s; "
          f"bf16 rule: {fast} ({why})")  # fmt: skip
    header = (f"{'kv dtype':>9} {'batch':>5} {'TTFT ms':>8} {'step ms':>8} {'tok/s':>8} {'MBU':>6} "
              f"{'read MB':>8} {'KV MiB':>7} {'RSS MiB':>8} {'wall tok/s':>10}")  # fmt: skip
    print(header)
    for kv in a.kv_dtype.split(","):
        engine = ModelRunner(model, tok, kv_dtype=kv, prefix_cache_tokens=0)
        for rows in (int(b) for b in a.batch_sizes.split(",")):
            r = sweep_point(engine, prompt, rows, a.decode_tokens)
            need = read_bytes(model, rows, context, engine.kv_dtype)
            r |= dict(kv_dtype=str(engine.kv_dtype).removeprefix("torch."), kv_option=kv, bytes_per_step=need,
                      mbu=need / r["step_s"] / bw, mbu_wall=need / r["step_wall_s"] / bw,
                      kv_cache_bytes=rows * (a.prompt_tokens + a.decode_tokens)
                      * KVCache.bytes_per_token(cfg, engine.kv_dtype),
                      peak_rss_bytes=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)  # fmt: skip
            payload["sweep"].append(r)
            print(f"{r['kv_dtype']:>9} {rows:>5} {r['ttft_s'] * 1e3:>8.1f} {r['step_s'] * 1e3:>8.2f} "
                  f"{r['tokens_per_s']:>8.0f} {r['mbu']:>6.2f} {need / 1e6:>8.1f} "
                  f"{r['kv_cache_bytes'] / 2**20:>7.1f} {r['peak_rss_bytes'] / 2**20:>8.0f} "
                  f"{r['tokens_per_s_wall']:>10.0f}", flush=True)  # fmt: skip
    payload["attention"] = []
    for kv in sorted({e["kv_dtype"] for e in payload["sweep"]}):
        for rows in (int(b) for b in a.batch_sizes.split(",")):
            r = attention_vs_floor(cfg, rows, context, getattr(torch, kv))
            payload["attention"].append(r)
            print(f"one layer's decode attention, {kv}, {rows} rows x {context + 1} slots: attend "
                  f"{r['attend_ms']:.3f} ms ({r['attend_gb_s']:.1f} GB/s of K+V), read K+V once "
                  f"{r['read_once_ms']:.3f} ms ({r['read_once_gb_s']:.1f} GB/s)", flush=True)  # fmt: skip
    payload["sgemm_flop_per_s"], payload["read_bytes_per_s"] = sgemm_rate(), read_bandwidth()
    payload["step_split"] = []
    engine = ModelRunner(model, tok, prefix_cache_tokens=0)
    weight_bytes = read_bytes(model, 0, 0, engine.kv_dtype)
    for rows in (int(b) for b in a.batch_sizes.split(",")):
        r = step_split(engine, prompt, rows, context)
        need = read_bytes(model, rows, context, engine.kv_dtype)
        # the fastest this thread could run the step: Linears at the larger of their compute floor (FLOPs at
        # the large-matmul rate) and their weight-read floor, attention at the read floor of its KV bytes
        floor = max(
            r["linear_flop"] / payload["sgemm_flop_per_s"], weight_bytes / payload["read_bytes_per_s"]
        )
        floor += r["kv_bytes"] / payload["read_bytes_per_s"]
        r |= dict(mbu_ceiling=need / bw / floor, floor_s=floor,
                  linear_flop_per_s=r["linear_flop"] / r["linears_s"] if r["linears_s"] else 0.0)  # fmt: skip
        payload["step_split"].append(r)
        print(f"decode step at {rows} rows (profiled, fp32): {r['profiled_s'] * 1e3:.2f} ms = Linears "
              f"{r['linears_s'] * 1e3:.2f} ({r['linear_flop_per_s'] / 1e9:.0f} GFLOP/s) + attention "
              f"{r['attention_s'] * 1e3:.2f} + other {r['other_s'] * 1e3:.2f}; floor {floor * 1e3:.2f} ms, "
              f"MBU ceiling {r['mbu_ceiling']:.2f}", flush=True)  # fmt: skip
    if a.accuracy_steps:
        payload["bf16_kv_accuracy"] = acc = accuracy(a.accuracy_steps)
        print(
            f"bf16 KV cache vs fp32 on a trained depth-2 model ({a.accuracy_steps} steps, train loss "
            f"{acc['final_train_loss']}): greedy agreement {acc['agreement']:.3f}, identical completions "
            f"{acc['identical_completions']}/{acc['prompts']}, max |logprob diff| "
            f"{acc['max_abs_logprob_diff']:.4f} (chosen tokens {acc['max_abs_chosen_logprob_diff']:.4f})"
        )
    payload["load"] = [load_before, uptime()]
    if a.out:
        write_markdown(Path(a.out), payload, argv if argv is not None else sys.argv[1:])
    print(json.dumps(payload))
    return 0


def write_markdown(out: Path, p: dict, argv: list[str]) -> None:
    lines = [
        "# infer_bench: decode latency, tokens/s, memory and MBU; bf16 KV-cache accuracy",
        "",
        f"Command: `python bench/infer_bench.py {' '.join(argv)}`",
        "",
        f"Machine: {p['machine']}; {p['threads']} torch thread(s). Load: `{p['load'][0]}` before, "
        f"`{p['load'][1]}` after. Times are CPU seconds of the single-threaded process (the machine is "
        "shared); wall tokens/s beside them.",
        f"Model: random, depth {p['depth']}, width {p['n_embd']}, {p['num_params']:,} parameters, fp32 "
        f"weights; prompt {p['prompt_tokens']} tokens, {p['decode_tokens']} decoded per row, greedy, "
        f"one prompt replicated to B rows (generate_batch num_samples=B). Measured copy bandwidth "
        f"**{p['peak_bandwidth_bytes_per_s'] / 1e9:.2f} GB/s** (read + write, 1 thread). bf16 rule "
        f"(raychat.model.fast_bf16): {p['fast_bf16'][0]} ({p['fast_bf16'][1]}).",
        "",
        "| KV dtype | batch | TTFT ms | step ms | tokens/s | **MBU** | bytes read/step MB | KV cache MiB "
        "| peak RSS MiB | tokens/s (wall) | MBU (wall) |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in p["sweep"]:
        lines.append(
            f"| {r['kv_dtype']} ({r['kv_option']}) | {r['rows']} | {r['ttft_s'] * 1e3:.1f} | "
            f"{r['step_s'] * 1e3:.2f} | {r['tokens_per_s']:.0f} | **{r['mbu']:.2f}** | "
            f"{r['bytes_per_step'] / 1e6:.1f} | {r['kv_cache_bytes'] / 2**20:.1f} | "
            f"{r['peak_rss_bytes'] / 2**20:.0f} | {r['tokens_per_s_wall']:.0f} | {r['mbu_wall']:.2f} |"
        )
    lines += [
        "",
        "## Decode attention: does it read the cache once?",
        "",
        f"One layer, context {p['context_mid'] + 1} slots: `CacheBatch.attend` as a decode step runs it (write "
        "the new key/value in place, SDPA over the cache view: no history copied or gathered) against reading "
        "the same K and V once (a sum over each: the read floor). GB/s = bytes of K and V / time.",
        "",
        "| KV dtype | rows | K+V MB | attend ms | attend GB/s | read-once ms | read-once GB/s | attend / read-once |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in p["attention"]:
        lines.append(
            f"| {r['dtype']} | {r['rows']} | {r['kv_bytes'] / 1e6:.1f} | {r['attend_ms']:.3f} | "
            f"{r['attend_gb_s']:.1f} | {r['read_once_ms']:.3f} | {r['read_once_gb_s']:.1f} | "
            f"{r['attend_ms'] / r['read_once_ms']:.2f} |"
        )
    if p.get("step_split"):
        lines += [
            "",
            "## Where a decode step goes, and the MBU this thread could reach",
            "",
            f"One decode forward (ModelRunner.forward_rows, fp32 weights and KV cache, sampling excluded), "
            f"torch.profiler self CPU time per step over 8 steps at {p['context_mid']} cached tokens. The "
            f"machine's large-matmul rate: **{p['sgemm_flop_per_s'] / 1e9:.0f} GFLOP/s** (1024^3 fp32 "
            f"matmul, 1 thread); read rate of data that does not stay in cache: "
            f"**{p['read_bytes_per_s'] / 1e9:.2f} GB/s** (sum of a 256 MiB tensor). Floor = the Linears at "
            "the larger of FLOPs / that matmul rate and weight bytes / that read rate, plus the KV cache's "
            "bytes / that read rate; MBU ceiling = bytes a step must read / copy bandwidth / floor.",
            "",
            "| rows | step ms (profiled) | Linears ms | Linears GFLOP/s | attention ms | other ms "
            "| floor ms | **MBU ceiling** |",
            "|---:|---:|---:|---:|---:|---:|---:|---:|",
        ]
        for r in p["step_split"]:
            lines.append(
                f"| {r['rows']} | {r['profiled_s'] * 1e3:.2f} | {r['linears_s'] * 1e3:.2f} | "
                f"{r['linear_flop_per_s'] / 1e9:.0f} | {r['attention_s'] * 1e3:.2f} | "
                f"{r['other_s'] * 1e3:.2f} | {r['floor_s'] * 1e3:.2f} | **{r['mbu_ceiling']:.2f}** |"
            )
    acc = p.get("bf16_kv_accuracy")
    if acc:
        lines += [
            "",
            "## Accuracy cost of a bfloat16 KV cache (vs float32, same fp32 weights)",
            "",
            f"Depth-2 model trained {acc['train_steps']} AdamW steps on this repository's docs (final train "
            f"loss {acc['final_train_loss']}); {acc['prompts']} held-out prompts of 64 tokens, "
            f"{acc['new_tokens']} greedy tokens each.",
            "",
            "| greedy agreement (tokens before the first difference) | identical completions "
            "| max abs logprob diff (whole vocab, teacher-forced) | max abs logprob diff (chosen token) |",
            "|---:|---:|---:|---:|",
            f"| {acc['agreement']:.3f} | {acc['identical_completions']}/{acc['prompts']} | "
            f"{acc['max_abs_logprob_diff']:.4f} | {acc['max_abs_chosen_logprob_diff']:.4f} |",
        ]
    lines.append("")
    tmp = out.with_name(out.name + ".tmp")
    tmp.write_text("\n".join(lines))
    os.replace(tmp, out)


if __name__ == "__main__":
    sys.exit(main())
