"""RL outcome on the tiny calculator setup: held-out pass@1 before and after RL over several seeds.

    python bench/rl_tiny_sft.py --out runs/bench/tiny_sft --steps 250 --max-operand 99
    python bench/rl_outcome.py --checkpoint runs/bench/tiny_sft --seeds 0 1 2 --steps 30

Each seed is one `raychat rl` run (RLRun) with a different prompt order and sampling seed; the held-out set
(64 test-split problems x 8 samples at T=1) is the same for every seed.
"""

from __future__ import annotations

import argparse
import json
import statistics

import ray
from _common import markdown_table

from raychat.config import RLConfig, from_dict
from raychat.rl.loop import RLRun


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--checkpoint", required=True)
    ap.add_argument("--out", default="runs/bench/rl_outcome")
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--steps", type=int, default=30)
    args = ap.parse_args()
    ray.init(num_cpus=2, include_dashboard=False)
    rows = []
    for seed in args.seeds:
        cfg = from_dict(RLConfig, dict(
            init_from=args.checkpoint, storage_path=args.out, run_name=f"seed{seed}", seed=seed, steps=args.steps,
            max_operand=99, prompts_per_step=32, samples_per_prompt=8, max_tokens=32, eval_every=args.steps,
            eval_examples=64, eval_samples=8, checkpoint_every=args.steps,
        ))  # fmt: skip
        summary = RLRun(cfg, log=lambda m: None).run()
        lines = [json.loads(x) for x in open(f"{args.out}/seed{seed}/metrics.jsonl")]
        rows.append(
            {
                "seed": seed,
                "pass@1 before": summary["evals"][0]["pass@1"],
                "pass@1 after": summary["evals"][-1]["pass@1"],
                "pass@8 before": summary["evals"][0]["pass@8"],
                "pass@8 after": summary["evals"][-1]["pass@8"],
                "rollout tokens/s": statistics.median(x["rollout_tokens_per_s"] for x in lines),
                "sync s": statistics.median(x["sync_time_s"] for x in lines),
                "learner step s": statistics.median(x["learner_step_s"] for x in lines),
                "learner wait frac": summary["learner_wait_frac"],
                "wall s": summary["wall_s"],
            }
        )
        print(json.dumps(rows[-1]), flush=True)
    ray.shutdown()
    print(markdown_table(rows, ".4g"))
    gains = [r["pass@1 after"] - r["pass@1 before"] for r in rows]
    after = [r["pass@1 after"] for r in rows]
    print(f"pass@1 gain mean {statistics.mean(gains):.4f}; after-RL pass@1 across seeds: mean "
          f"{statistics.mean(after):.4f}, std {statistics.stdev(after) if len(after) > 1 else 0:.4f}")  # fmt: skip


if __name__ == "__main__":
    main()
