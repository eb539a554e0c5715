"""Where a decode step's time goes outside the model's forward, before (commit f873b17) vs after (this tree).

Each measurement runs in a fresh single-threaded subprocess with raychat imported from `git archive f873b17`
(before) or from this checkout (after), --repeats times each in ABBA order (best run counts), as
bench/engine_decode.py does. Workload: the continuous-batching Scheduler with --rows requests of a
--prompt-len token prompt, each generating --new tokens with sampling (temperature 0.8, top-k 50, top-p
0.95, one seed per request), a random depth-derived model (default depth 4, width 256: the shape issue 24
compares against nanochat's Engine), fp32, vocab 4096. Only the decode steps are timed (the steps after the
first token of every request): per step, CPU seconds (time.process_time, the work done with one thread)
and wall seconds, split into the time inside the model's forward (embeddings, blocks, LM head: the engine's
own forward where it has one, engine/packed_weights.PackedGPT, else `model.forward`) and everything else in
`Scheduler.step` (input tensors, cache views and masks, sampling, per-request bookkeeping, detokenizing,
stream events). GC: the CPU time Python's cyclic garbage collector spent in collections during the timed
steps (gc.callbacks), wherever they landed (forward or outside), and how many ran; the after tree freezes
its start-up heap first (raychat.gc_heap.freeze_gc_heap), as its serving replicas, engine processes and
rollout actors do once their model is loaded. "same tokens": the sampled tokens equal the before version's (they cannot since top-k rows
race over their k candidates, engine/sampling.py: the same distribution, other draws); "same greedy
tokens": 16 greedy tokens per request equal.

Writes bench/results/decode_overhead.md (atomically).

Usage: python bench/decode_overhead.py [--depth 4] [--rows 1,8] [--repeats 2]
"""

from __future__ import annotations

import argparse
import gc
import inspect
import json
import os
import sys
import time
from pathlib import Path

import torch
from _common import machine, uptime
from _engine_common import REPO, archive, random_model, random_prompts, run_worker, synthetic_tokenizer

from raychat.engine import ModelRunner, SamplingParams, Scheduler

try:  # what a serving replica does once its model is loaded (raychat.gc_heap, after f873b17)
    from raychat.gc_heap import freeze_gc_heap
except ImportError:
    freeze_gc_heap = None

BASE = "f873b17"
SAMPLING = dict(temperature=0.8, top_k=50, top_p=0.95)


class ForwardClock:
    """Adds up the CPU and wall seconds spent inside the model's forward: the engine's own forward
    (`engine._forward`, engine/packed_weights.PackedGPT on CPU) where the engine has one, else
    `model.forward` (an instance attribute shadows the class method)."""

    def __init__(self, engine, model):
        self.cpu = self.wall = 0.0
        owner, name = (engine, "_forward") if hasattr(engine, "_forward") else (model, "forward")
        inner = getattr(owner, name)

        def timed(*args, **kwargs):
            c0, w0 = time.process_time(), time.perf_counter()
            try:
                return inner(*args, **kwargs)
            finally:
                self.cpu += time.process_time() - c0
                self.wall += time.perf_counter() - w0

        setattr(owner, name, timed)


class GCClock:
    """Adds up the CPU seconds Python's cyclic GC spends in collections (gc.callbacks), and counts them."""

    def __init__(self):
        self.cpu, self.collections, self._start = 0.0, 0, 0.0
        gc.callbacks.append(self._callback)

    def _callback(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._start = time.process_time()
        else:
            self.cpu += time.process_time() - self._start
            self.collections += 1


def work(a) -> dict:
    tok = synthetic_tokenizer(a.vocab)
    model = random_model(tok, a.depth, a.prompt_len + a.new + 8)
    # the prefix cache (after f873b17) is off: this measures the decode steps, not admission
    extra = (
        {"prefix_cache_tokens": 0}
        if "prefix_cache_tokens" in inspect.signature(ModelRunner).parameters
        else {}
    )
    engine = ModelRunner(model, tok, **extra)
    prompts = random_prompts(tok, a.rows, a.prompt_len)
    clock, gc_clock = ForwardClock(engine, model), GCClock()
    if freeze_gc_heap is not None:
        freeze_gc_heap()

    def run(n_new: int, timed: bool, sampling: dict = SAMPLING) -> dict:
        sched = Scheduler(engine, max_slots=a.rows, max_len=a.prompt_len + n_new)
        streams = [
            sched.submit(p, SamplingParams(max_tokens=n_new, seed=i, **sampling))
            for i, p in enumerate(prompts)
        ]
        while any(not s._events for s in streams):  # prefill + first token of every request
            sched.step()
        clock.cpu = clock.wall = gc_clock.cpu = gc_clock.collections = 0
        steps, c0, w0 = 0, time.process_time(), time.perf_counter()
        while sched.step():
            steps += 1
        cpu, wall = time.process_time() - c0, time.perf_counter() - w0
        tokens = sum(len(ev.token_ids) for s in streams for ev in s._events) - a.rows
        out = [t for s in streams for ev in s._events for t in ev.token_ids]
        return dict(steps=steps, tokens=tokens, cpu_s=cpu, wall_s=wall, fwd_cpu_s=clock.cpu,
                    fwd_wall_s=clock.wall, gc_cpu_s=gc_clock.cpu, gc_collections=gc_clock.collections,
                    digest=hash(tuple(out)) & 0xFFFFFFFF)  # fmt: skip

    run(8, False)  # warm-up
    greedy = run(16, False, {"temperature": 0.0})["digest"]
    return run(a.new, True) | {"greedy_digest": greedy}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--depth", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=4096)
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--new", type=int, default=64)
    ap.add_argument("--rows", default="1,8")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=2, help="runs of each version, ABBA order; best counts")
    ap.add_argument("--out", default=str(REPO / "bench" / "results" / "decode_overhead.md"))
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    torch.set_num_threads(a.threads)
    if a.worker:
        a.rows = int(a.rows)
        print(json.dumps(work(a)))
        return 0

    old, new = archive(BASE), REPO / "platform"
    script = Path(__file__).resolve()
    load_before = uptime()
    common = ["--depth", str(a.depth), "--vocab", str(a.vocab), "--prompt-len", str(a.prompt_len),
              "--new", str(a.new)]  # fmt: skip
    versions = (("before", old), ("after", new))
    results = {}
    for rows in a.rows.split(","):
        runs: dict[str, list[dict]] = {name: [] for name, _ in versions}
        for k in range(a.repeats):
            for name, path in versions if k % 2 == 0 else versions[::-1]:
                runs[name].append(run_worker(script, path, [*common, "--rows", rows], a.threads))
        results[int(rows)] = {name: min(r, key=lambda x: x["cpu_s"]) for name, r in runs.items()}
        print(rows, json.dumps(results[int(rows)]), flush=True)
    load_after = uptime()

    cmd = " ".join(["python", "bench/decode_overhead.py", *(argv if argv is not None else sys.argv[1:])])
    lines = [
        f"# Decode step: time inside the model's forward vs everything else, before ({BASE}) vs after",
        "",
        f"Command: `{cmd}`",
        "",
        f"Machine: {machine()}; {a.threads} torch thread(s) per run. Load: `{load_before}` before, "
        f"`{load_after}` after. Ratios use CPU seconds of the single-threaded process (the work done; the "
        "machine is shared); wall numbers beside them.",
        f"Model: random fp32, depth {a.depth} (ModelConfig.from_depth), vocab {a.vocab}; Scheduler, prompts of "
        f"{a.prompt_len} tokens, {a.new} new tokens per request, sampling {SAMPLING}. Only decode steps are "
        f"timed (after every request's first token). Best of {a.repeats} fresh subprocesses per version, ABBA.",
        "",
        "| rows | version | steps | CPU ms/step | in forward ms | outside ms | **outside share** "
        "| GC ms/step (collections) | tokens/CPU-s | tokens/s (wall) | same tokens | same greedy tokens |",
        "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---|---|",
    ]
    for rows, r in results.items():
        for name in ("before", "after"):
            x = r[name]
            per = x["cpu_s"] / x["steps"] * 1e3
            fwd = x["fwd_cpu_s"] / x["steps"] * 1e3
            lines.append(
                f"| {rows} | {name} | {x['steps']} | {per:.2f} | {fwd:.2f} | {per - fwd:.2f} | "
                f"**{(per - fwd) / per:.1%}** | {x['gc_cpu_s'] / x['steps'] * 1e3:.2f} ({x['gc_collections']}) | "
                f"{x['tokens'] / x['cpu_s']:.0f} | {x['tokens'] / x['wall_s']:.0f} | "
                f"{'yes' if x['digest'] == r['before']['digest'] else 'NO'} | "
                f"{'yes' if x['greedy_digest'] == r['before']['greedy_digest'] else 'NO'} |"
            )
    lines += [
        "",
        "| rows | tokens/CPU-s after / before | tokens/s (wall) after / before |",
        "|---:|---:|---:|",
    ]
    for rows, r in results.items():
        o, n = r["before"], r["after"]
        lines.append(f"| {rows} | **{o['cpu_s'] / n['cpu_s']:.2f}x** | {o['wall_s'] / n['wall_s']:.2f}x |")
    lines.append("")
    out = Path(a.out)
    tmp = out.with_name(out.name + ".tmp")
    tmp.write_text("\n".join(lines))
    os.replace(tmp, out)
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
