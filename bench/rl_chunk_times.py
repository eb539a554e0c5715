"""How much longer than the longest chunk before it a healthy rollout or evaluation chunk takes: what
raychat.rl.actors.ROLLOUT_FACTOR must cover (the deadline of a chunk is ROLLOUT_FACTOR x the longest chunk of its
kind so far, at least ROLLOUT_MIN_S); and the same of the learner steps (STEP_FACTOR) and checkpoint saves, and
how long a first, cold learner step takes (STEP_FIRST_S), with --compile too.

    python bench/rl_tiny_sft.py --out runs/bench/tiny_sft --steps 250 --max-operand 99
    python bench/rl_chunk_times.py --checkpoint runs/bench/tiny_sft --steps 20 --compile

Runs the tiny calculator setup of bench/rl_outcome.py in sync and in async mode (--max-staleness 1, the learner
sharing the CPUs with the rollouts) and records every chunk's wall time in its actor (the result's wall_s) and its
longest completion, in the order the driver collected them, and the driver's wall time of every learner step and
checkpoint save (a checkpoint every 5 steps); --compile adds a sync mode run with --compile (its first step
compiles). Prints, per mode and kind, the first one's time (a cold engine or learner), the median and longest of
the rest, and the largest ratio of one to the longest of its kind before it (the deadline's factor over it: below 1
for most).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import ray
from _common import markdown_table

from raychat.config import RLConfig, from_dict
from raychat.rl.loop import RLRun


def chunk_times(
    checkpoint: str, out: str, mode: str, steps: int, compile: bool = False
) -> dict[str, list[tuple[float, int]]]:
    """{kind: [(wall_s, longest completion in tokens; 0 for a step or save) of each, in order]} of one run: kinds
    "train" and "test" (chunks), "learner step", "checkpoint save"."""
    cfg = from_dict(RLConfig, dict(
        init_from=checkpoint, storage_path=out, run_name=f"{mode}{'-compile' if compile else ''}", steps=steps,
        max_operand=99, prompts_per_step=32, samples_per_prompt=8, max_tokens=32, eval_every=5, eval_examples=64,
        eval_samples=8, checkpoint_every=5, mode=mode, max_staleness=1, compile=compile,
    ))  # fmt: skip
    run = RLRun(cfg, log=lambda m: None)
    seen: dict[str, list[tuple[float, int]]] = {
        "train": [],
        "test": [],
        "learner step": [],
        "checkpoint save": [],
    }
    collect = run.dispatcher.collect

    def recording(chunks, progress=None):
        results = collect(chunks, progress)
        for chunk, r in zip(chunks, results):
            longest = max((s["completion_tokens"] for s in r.get("samples", [])), default=0)
            seen[chunk["split"]].append((r["wall_s"], longest))
        return results

    learner_results = run.actors.learner_results

    def timed(refs, call, deadline, fix):
        t0 = time.perf_counter()
        results = learner_results(refs, call, deadline, fix)
        seen["learner step" if call.startswith("Learner.step") else "checkpoint save"].append(
            (time.perf_counter() - t0, 0)
        )
        return results

    run.dispatcher.collect = recording
    run.actors.learner_results = timed
    run.run()
    return seen


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--checkpoint", required=True)
    ap.add_argument("--out", default="runs/bench/rl_chunk_times")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--compile", action="store_true", help="a third run: sync mode with --compile")
    args = ap.parse_args()
    ray.init(num_cpus=2, include_dashboard=False)
    rows = []
    for mode, compile in [("sync", False), ("async", False)] + [("sync", True)] * args.compile:
        for split, times in chunk_times(args.checkpoint, f"{args.out}", mode, args.steps, compile).items():
            if compile and split in ("train", "test"):
                continue
            walls = [t for t, _ in times]
            ratios = [t / max(walls[:i]) for i, t in enumerate(walls) if i]
            rows.append({
                "mode": f"{mode}{', --compile' if compile else ''}", "kind": split, "n": len(walls), "first s": walls[0],
                "median s (rest)": statistics.median(walls[1:]), "longest s (rest)": max(walls[1:]),
                "max ratio to the longest before": max(ratios),
                "longest completion (min-max over chunks)": (
                    f"{min(c for _, c in times)}-{max(c for _, c in times)}" if split == "train" else "n/a"
                ),  # an evaluation's result holds counts, not samples
            })  # fmt: skip
            print(json.dumps(rows[-1]), flush=True)
    ray.shutdown()
    print(markdown_table(rows, ".3g"))


if __name__ == "__main__":
    main()
