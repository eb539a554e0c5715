"""The engine at serving scale, before (commit 76453d3) vs after (this tree), side by side in one run.

Each measurement runs in a fresh subprocess with raychat imported from `git archive 76453d3` (before) or
from this checkout (after), --repeats times each in ABBA order (the best run of each counts); every run
uses the same single torch thread. The machine is shared, so every timing is taken twice: wall seconds
and the process' CPU seconds (time.process_time; with one thread that is the work done, without the time
spent waiting for a core). Ratios are computed on CPU seconds; wall numbers are printed beside them.
1. decode tokens/s of the continuous-batching Scheduler at 1, 8, 32, 64 concurrent requests: random prompts
   of --prompt-len tokens, sampling (temperature 0.8, top-k 50, top-p 0.95, one seed per request) and
   max_tokens spread over --min-new..--max-new in a scrambled order, so requests finish at staggered,
   non-adjacent slots. tokens/s = completion tokens / seconds of the whole run (prefill included).
2. inter-token latency of 8 streaming requests while 1,000-token prompts arrive (one every 30 steps, 5 in
   all, 4 tokens each): p50 / p99 / max over every gap between two tokens of the 8 streams, in CPU
   seconds of the engine process (and wall seconds).
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
    t0, c0 = time.perf_counter(), time.process_time()
    streams = [
        sched.submit(p, SamplingParams(max_tokens=n, seed=i, **SAMPLING))
        for i, (p, n) in enumerate(zip(prompts, limits))
    ]
    steps = 0
    while sched.step():
        steps += 1
    seconds, cpu = time.perf_counter() - t0, time.process_time() - c0
    tokens = sum(len(ev.token_ids) for s in streams for ev in s._events)
    return {"tokens": tokens, "seconds": seconds, "cpu_s": cpu, "steps": steps, "expected": sum(limits)}


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
    arrivals: dict[str, list[tuple[float, float]]] = {s.request_id: [] for s in streams}
    seen = {s.request_id: 0 for s in streams}
    step = 0
    while sched.step():
        now = (time.process_time(), time.perf_counter())
        for s in streams:
            got = sum(len(ev.token_ids) for ev in list(s._events))
            arrivals[s.request_id] += [now] * (got - seen[s.request_id])
            seen[s.request_id] = got
        step += 1
        if step % 30 == 10 and longs:
            sched.submit(longs.pop(), SamplingParams(max_tokens=4, temperature=0.0))
    out = {}
    for clock, name in ((0, "cpu"), (1, "wall")):
        gaps = [b[clock] - a[clock] for times in arrivals.values() for a, b in zip(times, times[1:])]
        q = statistics.quantiles(gaps, n=100)
        out |= {
            f"{name}_p50_ms": q[49] * 1e3,
            f"{name}_p99_ms": q[98] * 1e3,
            f"{name}_max_ms": max(gaps) * 1e3,
        }
    return out | {"gaps": len(gaps)}


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
    ap.add_argument("--repeats", type=int, default=2, help="runs of each version, ABBA order; best counts")
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

    def best(runs: list[dict]) -> dict:
        """Each metric's best (smallest time; the other fields from the first run)."""
        out = dict(runs[0])
        for key in runs[0]:
            if key.endswith(("seconds", "cpu_s", "_ms")):
                out[key] = min(r[key] for r in runs)
        return out

    def both(kind: str, extra: list[str], versions=(("old", old), ("new", new))) -> dict:
        runs: dict[str, list[dict]] = {name: [] for name, _ in versions}
        for k in range(a.repeats):
            for name, path in versions if k % 2 == 0 else versions[::-1]:
                runs[name].append(run_worker(script, path, [kind, *common, *extra], a.threads))
        res = {name: best(r) for name, r in runs.items()}
        shown = {
            n: {x: round(y, 3) if isinstance(y, float) else y for x, y in r.items() if x != "by_op"}
            for n, r in res.items()
        }
        print(kind, extra, json.dumps(shown), flush=True)
        return res

    decode = {int(r): both("decode", ["--rows", r]) for r in a.rows.split(",")}
    itl = both("itl", [])
    itl |= both("itl", ["--chunk", "128"], (("new128", new),))
    moved = both("bytes", [])
    load_after = uptime()

    lines = [
        "# Engine at serving scale: before (76453d3) vs after, one run",
        "",
        f"Command: `{' '.join(['python', 'bench/engine_decode.py', *(argv if argv is not None else sys.argv[1:])])}`",
        "",
        f"Machine: {machine()}; {a.threads} torch thread(s) per run. Load: `{load_before}` before, "
        f"`{load_after}` after. The machine is shared with other jobs: ratios use CPU seconds of the "
        "single-threaded engine process (the work done); wall numbers are shown beside them.",
        f"Model: random fp32, depth {a.depth} (ModelConfig.from_depth), vocab {a.vocab}. Before = the engine "
        f"of commit {BASE} (`git archive`), after = this tree; best of {a.repeats} fresh subprocesses each, "
        "in ABBA order.",
        "",
        f"## 1. Decode tokens/s, Scheduler, prompts of {a.prompt_len} tokens, max_tokens "
        f"{a.min_new}..{a.max_new} finishing in a scrambled order, sampling {SAMPLING}",
        "",
        "| concurrent requests | tokens | before tokens/CPU-s | after tokens/CPU-s | **after / before** "
        "| before tokens/s (wall) | after tokens/s (wall) |",
        "|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for rows, r in decode.items():
        o, n = r["old"], r["new"]
        lines.append(
            f"| {rows} | {n['tokens']} | {o['tokens'] / o['cpu_s']:.0f} | {n['tokens'] / n['cpu_s']:.0f} | "
            f"**{o['cpu_s'] / n['cpu_s']:.2f}x** | {o['tokens'] / o['seconds']:.0f} | {n['tokens'] / n['seconds']:.0f} |"
        )
    lines += [
        "",
        "## 2. Inter-token latency of 8 streams (160 tokens each) with 1,000-token prompts arriving",
        "",
        "Five 1,000-token prompts arrive, one every 30 steps. The new Scheduler prefills at most "
        "`prefill_chunk_tokens` prompt tokens per step (default 512; also shown at 128). Gaps between "
        f"consecutive tokens of the 8 streams: {itl['new']['gaps']}. CPU ms = CPU time of the engine process "
        "between the two tokens.",
        "",
        "| | p50 CPU ms | p99 CPU ms | max CPU ms | p50 wall ms | p99 wall ms | max wall ms |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for name, label in (
        ("old", "before"),
        ("new", "after (chunks of 512)"),
        ("new128", "after (chunks of 128)"),
    ):
        r = itl[name]
        lines.append(
            f"| {label} | {r['cpu_p50_ms']:.1f} | {r['cpu_p99_ms']:.1f} | {r['cpu_max_ms']:.1f} | "
            f"{r['wall_p50_ms']:.1f} | {r['wall_p99_ms']:.1f} | {r['wall_max_ms']:.1f} |"
        )
    o, n, n128 = itl["old"], itl["new"], itl["new128"]
    lines += [
        "",
        f"p99 CPU ms before / after: **{o['cpu_p99_ms'] / n['cpu_p99_ms']:.2f}x** (512), "
        f"**{o['cpu_p99_ms'] / n128['cpu_p99_ms']:.2f}x** (128); max: {o['cpu_max_ms'] / n['cpu_max_ms']:.2f}x, "
        f"{o['cpu_max_ms'] / n128['cpu_max_ms']:.2f}x.",
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
