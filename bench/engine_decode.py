"""The engine at serving scale, before (commit 76453d3) vs after (this tree), side by side in one run.

Each measurement runs in a fresh subprocess, once with raychat imported from `git archive 76453d3` and once
from this checkout, alternating which goes first; both get the same torch thread count.
1. decode tokens/s of the continuous-batching Scheduler at 1, 8, 32, 64 concurrent requests: random prompts
   of --prompt-len tokens, sampling (temperature 0.8, top-k 50, top-p 0.95, one seed per request) and
   max_tokens spread over --min-new..--max-new in a scrambled order, so requests finish at staggered,
   non-adjacent slots. tokens/s = completion tokens / wall seconds of the whole run (prefill included).
2. inter-token latency of 8 streaming requests while 1,000-token prompts arrive (one every 30 steps, 5 in
   all, 4 tokens each): p50 / p99 / max over every gap between two tokens of the 8 streams.
3. bytes moved by one decode step at depth 20 / 8 rows / 2048 cached tokens (fp32, vocab 65536), counted
   from the code path: one ModelRunner.decode on the meta device (shapes only) under a dispatch mode that
   adds up the bytes every aten op writes (bench/_engine_common.ByteCounter). The old path decodes rows
   0,1,2,4,5,6,7,9 of a 10-row cache (non-adjacent, as after scattered finishes), the new one rows 0..7
   (its compaction keeps busy rows adjacent).
Writes bench/results/engine_decode.md (atomically).

Usage: python bench/engine_decode.py [--depth 8] [--rows 1,8,32,64] [--threads 1]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch
from _common import machine, uptime
from _engine_common import (
    REPO,
    ByteCounter,
    archive,
    random_model,
    random_prompts,
    run_worker,
    synthetic_tokenizer,
)

from raychat.engine import KVCache, ModelRunner, SamplingParams, Scheduler

BASE = "76453d3"
SAMPLING = dict(temperature=0.8, top_k=50, top_p=0.95)


def scheduler(engine, max_slots: int, max_len: int, chunk: int = 0) -> Scheduler:
    """A Scheduler of either version (prefill_chunk_tokens exists only after 76453d3)."""
    extra = {"prefill_chunk_tokens": chunk} if chunk else {}
    return Scheduler(engine, max_slots=max_slots, max_len=max_len, **extra)


def work_decode(a) -> dict:
    rows = int(a.rows)
    tok = synthetic_tokenizer(a.vocab)
    engine = ModelRunner(random_model(tok, a.depth, a.prompt_len + a.max_new + 1), tok)
    prompts = random_prompts(tok, rows, a.prompt_len)
    span = a.max_new - a.min_new
    limits = [a.min_new + ((i * 7919) % rows) * span // max(rows - 1, 1) for i in range(rows)]
    warm = scheduler(engine, 2, a.prompt_len + 9)
    for p in prompts[:2]:
        warm.submit(p, SamplingParams(max_tokens=8, temperature=0.0))
    while warm.step():
        pass
    sched = scheduler(engine, rows, a.prompt_len + a.max_new)
    t0 = time.perf_counter()
    streams = [
        sched.submit(p, SamplingParams(max_tokens=n, seed=i, **SAMPLING))
        for i, (p, n) in enumerate(zip(prompts, limits))
    ]
    steps = 0
    while sched.step():
        steps += 1
    seconds = time.perf_counter() - t0
    tokens = sum(len(ev.token_ids) for s in streams for ev in s._events)
    return {"tokens": tokens, "seconds": seconds, "steps": steps, "expected": sum(limits)}


def work_itl(a) -> dict:
    tok = synthetic_tokenizer(a.vocab)
    long_len, new = 1000, 160
    engine = ModelRunner(random_model(tok, a.depth, long_len + new + 8), tok)
    sched = scheduler(engine, 10, long_len + new, a.chunk)
    streams = [
        sched.submit(p, SamplingParams(max_tokens=new, seed=i, **SAMPLING))
        for i, p in enumerate(random_prompts(tok, 8, 64))
    ]
    longs = random_prompts(tok, 5, long_len, seed=2)
    arrivals: dict[str, list[float]] = {s.request_id: [] for s in streams}
    seen = {s.request_id: 0 for s in streams}
    step = 0
    while sched.step():
        now = time.perf_counter()
        for s in streams:
            got = sum(len(ev.token_ids) for ev in list(s._events))
            arrivals[s.request_id] += [now] * (got - seen[s.request_id])
            seen[s.request_id] = got
        step += 1
        if step % 30 == 10 and longs:
            sched.submit(longs.pop(), SamplingParams(max_tokens=4, temperature=0.0))
    gaps = [b - a for times in arrivals.values() for a, b in zip(times, times[1:])]
    q = statistics.quantiles(gaps, n=100)
    return {"p50_ms": q[49] * 1e3, "p99_ms": q[98] * 1e3, "max_ms": max(gaps) * 1e3, "gaps": len(gaps)}


def work_bytes(a) -> dict:
    tok = synthetic_tokenizer(65536)
    model = random_model(tok, 20, 2048, device="meta")
    engine = ModelRunner(model, tok)
    old_layout = not hasattr(engine, "forward_rows")
    cache = engine.new_cache(10, 2048)
    rows = [0, 1, 2, 4, 5, 6, 7, 9] if old_layout else list(range(8))
    cache.lengths[rows] = 2047
    with ByteCounter() as counter:
        engine.decode(cache, rows, [tok.bos_id] * 8)
    bpt = KVCache.bytes_per_token(model.config, torch.float32)
    return {"total": counter.total, "by_op": counter.by_op, "bytes_per_token": bpt}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--depth", type=int, default=8)
    ap.add_argument("--vocab", type=int, default=4096)
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--min-new", type=int, default=64)
    ap.add_argument("--max-new", type=int, default=320)
    ap.add_argument("--rows", default="1,8,32,64")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", default=str(REPO / "bench" / "results" / "engine_decode.md"))
    ap.add_argument("--worker", choices=["decode", "itl", "bytes"], help=argparse.SUPPRESS)
    ap.add_argument("--chunk", type=int, default=0, help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    torch.set_num_threads(a.threads)
    if a.worker:
        print(json.dumps({"decode": work_decode, "itl": work_itl, "bytes": work_bytes}[a.worker](a)))
        return 0

    old, new = archive(BASE), REPO / "platform"
    script = Path(__file__).resolve()
    load_before = uptime()
    common = ["--depth", str(a.depth), "--vocab", str(a.vocab), "--prompt-len", str(a.prompt_len),
              "--min-new", str(a.min_new), "--max-new", str(a.max_new)]  # fmt: skip

    def both(kind: str, extra: list[str], k: int) -> dict:
        order = [("old", old), ("new", new)] if k % 2 == 0 else [("new", new), ("old", old)]
        res = {name: run_worker(script, path, [kind, *common, *extra], a.threads) for name, path in order}
        print(
            kind,
            extra,
            json.dumps({n: {x: y for x, y in r.items() if x != "by_op"} for n, r in res.items()}),
            flush=True,
        )
        return res

    decode = {int(r): both("decode", ["--rows", r], k) for k, r in enumerate(a.rows.split(","))}
    itl = both("itl", [], 0)
    itl["new128"] = run_worker(script, new, ["itl", *common, "--chunk", "128"], a.threads)
    moved = both("bytes", [], 1)
    load_after = uptime()

    lines = [
        "# Engine at serving scale: before (76453d3) vs after, one run",
        "",
        f"Command: `python bench/engine_decode.py {' '.join(argv if argv is not None else sys.argv[1:])}`",
        "",
        f"Machine: {machine()}; {a.threads} torch thread(s) per run. Load: `{load_before}` before, "
        f"`{load_after}` after (the machine is shared: ratios are more stable than absolute numbers).",
        f"Model: random fp32, depth {a.depth} (ModelConfig.from_depth), vocab {a.vocab}. Before = the engine "
        f"of commit {BASE} (`git archive`), after = this tree; each number is one fresh subprocess.",
        "",
        f"## 1. Decode tokens/s, Scheduler, prompts of {a.prompt_len} tokens, max_tokens "
        f"{a.min_new}..{a.max_new} finishing in a scrambled order, sampling {SAMPLING}",
        "",
        "| concurrent requests | tokens | before s | before tokens/s | after s | after tokens/s | after / before |",
        "|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for rows, r in decode.items():
        o, n = r["old"], r["new"]
        ratio = (n["tokens"] / n["seconds"]) / (o["tokens"] / o["seconds"])
        lines.append(
            f"| {rows} | {n['tokens']} | {o['seconds']:.2f} | {o['tokens'] / o['seconds']:.0f} | "
            f"{n['seconds']:.2f} | {n['tokens'] / n['seconds']:.0f} | **{ratio:.2f}x** |"
        )
    o, n = itl["old"], itl["new"]
    lines += [
        "",
        "## 2. Inter-token latency of 8 streams (160 tokens each) with 1,000-token prompts arriving",
        "",
        f"Five 1,000-token prompts arrive, one every 30 steps; the new Scheduler prefills at most 512 prompt "
        f"tokens per step (its default `prefill_chunk_tokens`). Gaps between consecutive tokens: {n['gaps']}.",
        "",
        "| | p50 ms | p99 ms | max ms |",
        "|---|---:|---:|---:|",
        f"| before | {o['p50_ms']:.1f} | {o['p99_ms']:.1f} | {o['max_ms']:.1f} |",
        f"| after | {n['p50_ms']:.1f} | {n['p99_ms']:.1f} | {n['max_ms']:.1f} |",
        f"| after, prefill_chunk_tokens=128 | {itl['new128']['p50_ms']:.1f} | {itl['new128']['p99_ms']:.1f} | "
        f"{itl['new128']['max_ms']:.1f} |",
        f"| before / after | {o['p50_ms'] / n['p50_ms']:.2f}x | {o['p99_ms'] / n['p99_ms']:.2f}x | "
        f"{o['max_ms'] / n['max_ms']:.2f}x |",
    ]
    o, n = moved["old"], moved["new"]
    bpt = n["bytes_per_token"]
    lines += [
        "",
        "## 3. Bytes moved by one decode step: depth 20, 8 rows x 2048 cached tokens, fp32, vocab 65536",
        "",
        f"Counted from the code path (meta device, every aten op's written bytes). KV cache: {bpt:,} bytes per "
        f"token; attention reads the 8 x 2048 x {bpt:,} = {8 * 2048 * bpt / 1e9:.2f} GB of history in both "
        "(reads are not counted below: they are the same).",
        "",
        "| | bytes written per step | largest contributors |",
        "|---|---:|---|",
    ]
    for name, r in (("before", o), ("after", n)):
        top = sorted(r["by_op"].items(), key=lambda kv: -kv[1])[:3]
        lines.append(
            f"| {name} | {r['total']:,} | " + ", ".join(f"{k} {v / 1e6:,.1f} MB" for k, v in top) + " |"
        )
    lines += [
        "",
        f"before / after: **{o['total'] / n['total']:.0f}x** fewer bytes written per decode step.",
        "",
    ]
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".tmp")
    tmp.write_text("\n".join(lines))
    os.replace(tmp, out)
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
