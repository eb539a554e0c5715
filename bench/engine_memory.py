"""Engine memory soak without Serve: the ModelRunner and Scheduler the serving engine process builds, in one
process and one torch thread, driven by a stream of varied requests; prints resident memory over time and
what holds it.

  python bench/engine_memory.py --seconds 120                 # this branch: oneDNN rows bucketed
  python bench/engine_memory.py --seconds 120 --exact-rows    # each oneDNN call at its own row count (before)
  python bench/engine_memory.py --seconds 60 --trim           # malloc_trim(0) before each reading

Model: random depth 4 (as bench/serve_hostile.py), 64 slots of 512 tokens, the prefix cache on ("auto").
Requests (64 live + 8 waiting at all times): 40% short distinct prompts (the soak's), 25% a shared 12-sentence
system prompt with a varied question, 15% a previous conversation continued (prefix-cache hits), 20%
prompts of 20-120 random numbers with max_tokens up to the row's end; 10% are cancelled after 0-20 tokens.
Every --every seconds one JSON line: RSS (VmRSS), the resident MiB of [heap] (glibc's main arena), of the KV
cache and prefix-cache pool mappings, of other anonymous and of file-backed mappings (/proc/self/smaps);
the Scheduler's and prefix cache's structure sizes; `onednn_shapes`, the distinct (rows, weight) shapes of
the oneDNN matmuls so far (engine/packed_weights.py); with --trace, the Python heap traced by tracemalloc
(started after the first reading) and its top growth by line at the end.
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import inspect
import json
import random
import re
import sys
import textwrap
import time
import tracemalloc

import torch

from raychat.chat_template import render_for_completion
from raychat.engine import packed_weights
from raychat.engine.runner import ModelRunner
from raychat.engine.sampling import SamplingParams
from raychat.engine.scheduler import Scheduler
from raychat.gc_heap import freeze_gc_heap
from raychat.model import GPT, ModelConfig
from raychat.tokenizer import Tokenizer

MAX_LEN = 512


def rss_mib() -> float:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) / 1024 for line in f if line.startswith("VmRSS:"))


def smaps_mib(named: dict[str, int]) -> dict[str, float]:
    """Resident MiB per mapping kind: [heap], the mappings holding the `named` data pointers, other anonymous
    mappings, file-backed ones."""
    out = dict.fromkeys(["heap", *named, "anon", "file"], 0)
    kind = None
    with open("/proc/self/smaps") as f:
        for line in f:
            parts = line.split()
            if re.match(r"^[0-9a-f]+-[0-9a-f]+ ", line):
                lo, hi = (int(x, 16) for x in parts[0].split("-"))
                path = parts[5] if len(parts) > 5 else ""
                kind = next((k for k, ptr in named.items() if lo <= ptr < hi), None)
                kind = kind or ("heap" if path == "[heap]" else "anon" if not path else "file")
            elif parts[0] == "Rss:":
                out[kind] += int(parts[1])
    return {k: round(v / 1024, 1) for k, v in out.items()}


def count_onednn_shapes() -> set:
    """Record the (rows, weight shape) of every oneDNN call PackedMatmul makes from now on."""
    shapes, call = set(), packed_weights.PackedMatmul.__call__

    def counted(self, x):
        rows = x.numel() // x.shape[-1]
        if rows > self.small_rows:
            shapes.add((packed_weights.onednn_rows(rows), tuple(self.packed.shape)))
        return call(self, x)

    packed_weights.PackedMatmul.__call__ = counted
    return shapes


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seconds", type=float, default=120.0)
    p.add_argument("--every", type=float, default=10.0, help="seconds between readings")
    p.add_argument("--slots", type=int, default=64)
    p.add_argument("--exact-rows", action="store_true", help="oneDNN at each call's own row count")
    p.add_argument("--trim", action="store_true", help="malloc_trim(0) before each reading")
    p.add_argument("--trace", action="store_true", help="tracemalloc: the Python heap's growth")
    p.add_argument("--out", help="write the readings here (JSON list)")
    a = p.parse_args()
    torch.manual_seed(0)
    torch.set_num_threads(1)
    if a.exact_rows:
        packed_weights.onednn_rows = lambda rows: rows
    shapes = count_onednn_shapes()
    tok = Tokenizer.train([inspect.getsource(json), inspect.getsource(textwrap)], vocab_size=1024)
    model = GPT(ModelConfig.from_depth(4, vocab_size=tok.vocab_size, max_seq_len=MAX_LEN)).init_weights(
        seed=0
    )
    scheduler = Scheduler(
        ModelRunner(model.eval(), tok, dtype="auto"), max_slots=a.slots, prefill_chunk_tokens=512
    )
    pc, cache = scheduler.engine.prefix_cache, scheduler.cache
    freeze_gc_heap()  # as the engine process does once its model is loaded
    libc = ctypes.CDLL("libc.so.6")
    rng = random.Random(0)
    system = "You are a careful assistant. " * 12
    history: list[list[dict]] = []
    live: dict[
        str, tuple
    ] = {}  # request id -> (stream, messages, tokens to cancel after or None, tokens so far)
    submitted = 0
    reasons: dict[str, int] = {}
    readings, first_snapshot = [], None

    def request() -> tuple[list[dict], list[int], int]:
        k = rng.random()
        if k < 0.4:
            messages = [
                {
                    "role": "user",
                    "content": f"Stream {rng.randrange(64)}, request {submitted}: tell me a story.",
                }
            ]
            max_tokens = rng.randint(32, 96)
        elif k < 0.65:
            messages = [{"role": "system", "content": system},
                        {"role": "user", "content": f"question {rng.randrange(10_000)}"}]  # fmt: skip
            max_tokens = rng.randint(16, 64)
        elif k < 0.8 and history:
            messages = [*rng.choice(history), {"role": "user", "content": f"and then {submitted}?"}]
            max_tokens = rng.randint(16, 64)
        else:
            numbers = " ".join(str(rng.randrange(10**6)) for _ in range(rng.randint(20, 120)))
            messages, max_tokens = [{"role": "user", "content": numbers}], MAX_LEN
        ids = render_for_completion(tok, messages)[-(MAX_LEN - 12) :]
        return messages, ids, min(max_tokens, MAX_LEN - len(ids))

    start, next_reading = time.monotonic(), 0.0
    while True:
        elapsed = time.monotonic() - start
        if elapsed >= next_reading:
            gc.collect()
            if a.trim:
                libc.malloc_trim(0)
            named = {"kv_cache": cache.k.data_ptr()}  # k and v share one mapping
            if pc.k is not None:
                named["prefix_pool"] = pc.k.data_ptr()
            row = {"t": round(elapsed), "rss_mib": round(rss_mib(), 1), "smaps_mib": smaps_mib(named),
                   "submitted": submitted, "live": len(scheduler._live), "pending": len(scheduler._pending),
                   "prefix_blocks": pc.num_blocks, "prefix_max_blocks": pc.max_blocks,
                   "prefix_index": len(pc._index), "prefix_held": len(pc._refs), "prefix_lru": len(pc._lru),
                   "onednn_shapes": len(shapes)}  # fmt: skip
            if a.trace and first_snapshot is not None:
                row["traced_mib"] = round(tracemalloc.get_traced_memory()[0] / 2**20, 2)
            readings.append(row)
            print(json.dumps(row), flush=True)
            if a.trace and first_snapshot is None:
                tracemalloc.start(8)
                first_snapshot = tracemalloc.take_snapshot()
            next_reading += a.every
            if elapsed >= a.seconds:
                break
        while len(live) < a.slots + 8:
            messages, ids, max_tokens = request()
            stream = scheduler.submit(ids, SamplingParams(max_tokens=max_tokens, seed=submitted))
            cancel_after = rng.randint(0, 20) if rng.random() < 0.1 else None
            live[stream.request_id] = (stream, messages, cancel_after, 0)
            submitted += 1
        scheduler.step()
        for rid, (stream, messages, cancel_after, n) in list(live.items()):
            finished = None
            while (event := stream._pop()) is not None:
                n += len(event.token_ids)
                finished = event.finish_reason if event.finished else None
            if finished is None and cancel_after is not None and n >= cancel_after:
                stream.cancel()
                cancel_after = None
            live[rid] = (stream, messages, cancel_after, n)
            if finished is None:
                continue
            del live[rid]
            reasons[finished] = reasons.get(finished, 0) + 1
            if finished in ("stop", "length") and rng.random() < 0.3:  # a conversation to continue later
                turn = [*messages, {"role": "assistant", "content": f"reply {submitted}"}]
                if len(history) < 200:
                    history.append(turn)
                else:
                    history[rng.randrange(200)] = turn
    print(json.dumps({"finish_reasons": reasons, "last_error": repr(scheduler.last_error)}))
    if a.trace:
        for stat in tracemalloc.take_snapshot().compare_to(first_snapshot, "lineno")[:10]:
            print(stat)
    if a.out:
        with open(a.out, "w") as f:
            json.dump(readings, f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
