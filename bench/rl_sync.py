"""RL benchmarks: weight-sync time against model size, and learner idle fraction, synchronous vs asynchronous.

    python bench/rl_sync.py sizes                       # object-store sync, 1 learner -> 2 rollout actors
    python bench/rl_sync.py idle --checkpoint runs/bench/tiny_sft --steps 12

sizes: random GPTs (vocab 512) of growing depth/width saved as checkpoints; each sync = one ray.put of the
learner's state dict + every rollout actor fetching and loading it (median of 5).
idle: the same RL run in --mode sync and --mode async --max-staleness 1; learner wait fraction = time the
driver waits for rollouts / (wait + learner step + sync).
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from pathlib import Path

import ray

from raychat.checkpoint import save_model
from raychat.config import RLConfig, from_dict
from raychat.model import GPT, ModelConfig
from raychat.rl.learner import LearnerActor
from raychat.rl.loop import RLRun, rl_tasks
from raychat.rl.rollout import RolloutActor
from raychat.rl.weights import sync_object_store
from raychat.tokenizer import Tokenizer

SIZES = [(1, 64), (2, 128), (4, 256), (6, 384), (8, 512), (12, 768)]


def sizes(args) -> None:
    tok = Tokenizer.train(["What is 12 * 34? #### 408"] * 50, vocab_size=300)
    tmp = Path(tempfile.mkdtemp())
    print(
        "| depth | width | params (M) | state dict (MB) | put s | slowest fetch+load s | sync s (put + load) | wall s |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for depth, width in SIZES:
        cfg = ModelConfig.from_depth(depth, tok.vocab_size, 256, aspect_ratio=width // depth, head_dim=64)
        model = GPT(cfg).init_weights(0)
        ck = tmp / f"d{depth}"
        save_model(ck, model, tok, {"stage": "bench"}, commit=True)
        rl = from_dict(RLConfig, dict(init_from=str(ck), task_examples=8, eval_examples=2))
        learner = LearnerActor.options(num_cpus=0.5).remote(str(ck), rl)
        rollouts = [RolloutActor.options(num_cpus=0.5).remote(str(ck), rl_tasks(rl), i) for i in range(2)]
        results = [sync_object_store(learner, rollouts, v) for v in range(1, 6)]
        med = {
            k: statistics.median(r[k] for r in results) for k in ("put_s", "apply_s", "sync_time_s", "wall_s")
        }
        mb = sum(p.numel() * p.element_size() for p in model.state_dict().values()) / 2**20
        print(
            f"| {depth} | {cfg.n_embd} | {model.num_params() / 1e6:.2f} | {mb:.1f} | {med['put_s']:.4f} | "
            f"{med['apply_s']:.4f} | {med['sync_time_s']:.4f} | {med['wall_s']:.4f} |",
            flush=True,
        )
        for a in [learner, *rollouts]:
            ray.kill(a)


def idle(args) -> None:
    print(
        "| mode | max staleness | learner wait frac | wall s | median learner step s | median rollout tokens/s | mean staleness |"
    )
    print("|---|---|---|---|---|---|---|")
    for mode in ("sync", "async"):
        cfg = from_dict(RLConfig, dict(
            init_from=args.checkpoint, storage_path=tempfile.mkdtemp(), run_name=mode, mode=mode, max_staleness=1,
            steps=args.steps, max_operand=99, prompts_per_step=32, samples_per_prompt=8, max_tokens=32,
            eval_every=10_000, eval_examples=8, checkpoint_every=10_000,
        ))  # fmt: skip
        s = RLRun(cfg, log=lambda m: None).run()
        lines = [json.loads(x) for x in open(Path(cfg.run.storage_path) / mode / "metrics.jsonl")]
        print(
            f"| {mode} | {1 if mode == 'async' else 0} | {s['learner_wait_frac']:.3f} | {s['wall_s']:.1f} | "
            f"{statistics.median(x['learner_step_s'] for x in lines):.3f} | "
            f"{statistics.median(x['rollout_tokens_per_s'] for x in lines):.0f} | "
            f"{statistics.mean(x['staleness_mean'] for x in lines):.2f} |",
            flush=True,
        )


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("what", choices=["sizes", "idle"])
    ap.add_argument("--checkpoint", default="runs/bench/tiny_sft")
    ap.add_argument("--steps", type=int, default=12)
    args = ap.parse_args()
    ray.init(num_cpus=2, include_dashboard=False)
    try:
        {"sizes": sizes, "idle": idle}[args.what](args)
    finally:
        ray.shutdown()


if __name__ == "__main__":
    main()
