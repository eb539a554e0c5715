"""Python's cyclic GC in a decoding engine: collections, their total and longest pause, with and without
the start-up heap frozen (raychat.gc_heap.freeze_gc_heap, what serving replicas do once loaded).

Each mode runs in a fresh single-threaded subprocess: a random depth-derived model (default depth 4, vocab
4096), the Scheduler with --streams slots kept full (a finished request is replaced at once; prompts of 128
tokens, 64 new tokens each, temperature 0.8, top-k 50, top-p 0.95), a consumer draining every stream after
each step, for --steps steps. gc.callbacks time every collection (wall seconds) by generation.

Usage: python bench/gc_pauses.py [--steps 2500] [--streams 8]
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import time
from pathlib import Path

import torch
from _engine_common import random_model, random_prompts, run_worker, synthetic_tokenizer

from raychat.engine import ModelRunner, SamplingParams, Scheduler
from raychat.gc_heap import freeze_gc_heap

SAMPLING = dict(temperature=0.8, top_k=50, top_p=0.95)


def work(a) -> dict:
    tok = synthetic_tokenizer(4096)
    engine = ModelRunner(random_model(tok, a.depth, 512), tok, prefix_cache_tokens=0)
    prompts = random_prompts(tok, 64, 128)
    sched = Scheduler(engine, max_slots=a.streams, max_len=128 + 64)
    if a.freeze:
        freeze_gc_heap()
    pauses: list[tuple[int, float]] = []
    start = [0.0]

    def timed(phase: str, info: dict) -> None:
        if phase == "start":
            start[0] = time.perf_counter()
        else:
            pauses.append((info["generation"], time.perf_counter() - start[0]))

    gc.callbacks.append(timed)
    streams, submitted = [], 0
    c0 = time.process_time()
    for _ in range(a.steps):
        while sched.num_active + sched.num_pending < a.streams:
            params = SamplingParams(max_tokens=64, seed=submitted, **SAMPLING)
            streams.append(sched.submit(prompts[submitted % len(prompts)], params))
            submitted += 1
        sched.step()
        for s in streams:  # the consumer
            while (event := s._pop()) is not None:
                s.done = event.finished
        streams = [s for s in streams if not s.done]
    cpu = time.process_time() - c0
    by_gen = {}
    for generation, seconds in pauses:
        by_gen.setdefault(generation, []).append(seconds)
    return {
        "freeze": a.freeze, "steps": a.steps, "streams": a.streams, "requests": submitted,
        "cpu_ms_per_step": cpu / a.steps * 1e3, "tracked_objects": len(gc.get_objects()),
        "frozen_objects": gc.get_freeze_count(),
        "gc": {g: {"collections": len(v), "total_ms": sum(v) * 1e3, "longest_ms": max(v) * 1e3}
               for g, v in sorted(by_gen.items())},
    }  # fmt: skip


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=2500)
    ap.add_argument("--streams", type=int, default=8)
    ap.add_argument("--depth", type=int, default=4)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--freeze", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    torch.set_num_threads(a.threads)
    if a.worker:
        print(json.dumps(work(a)))
        return 0
    script, platform = Path(__file__).resolve(), Path(__file__).resolve().parents[1] / "platform"
    common = ["--steps", str(a.steps), "--streams", str(a.streams), "--depth", str(a.depth)]
    print(
        "| heap | steps | CPU ms/step | objects the GC tracks | collections (gen 0/1/2) | in GC ms | longest ms |"
    )
    print("|---|---:|---:|---:|---|---:|---:|")
    for freeze in (False, True):
        r = run_worker(script, platform, [*common, *(["--freeze"] if freeze else [])], a.threads)
        gens = r["gc"]
        counts = "/".join(str(gens.get(str(g), {}).get("collections", 0)) for g in range(3))
        total = sum(g["total_ms"] for g in gens.values())
        longest = max((g["longest_ms"] for g in gens.values()), default=0.0)
        print(f"| {'frozen' if freeze else 'as started'} | {r['steps']} | {r['cpu_ms_per_step']:.2f} | "
              f"{r['tracked_objects']:,} | {counts} | {total:.1f} | {longest:.1f} |", flush=True)  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
