"""`raychat rl`: RL of a chat checkpoint on a task (raychat.rl.loop.RLRun) on a local or given Ray cluster."""

from __future__ import annotations

import argparse
import json
import sys

import ray

from raychat.checkpoint import read_meta
from raychat.config import RLConfig, add_flags, from_args
from raychat.rl.loop import RLRun


def config_for(args: argparse.Namespace) -> RLConfig:
    """The command's RLConfig: flags > --config/--preset (its rl section, or the whole file) > defaults."""
    return from_args(args, RLConfig, "rl", where="rl settings")


def add_cli(subparsers) -> None:
    parser = subparsers.add_parser(
        "rl",
        help="reinforcement learning of a chat checkpoint on a task (rollout actors + learner on Ray)",
        description="GRPO-style RL: rollout actors sample --samples-per-prompt completions per prompt with tool "
        "use, Task.reward scores them, advantages are reward minus the group mean, the learner takes a "
        "policy-gradient step over sampled tokens only, and the new weights are published to every rollout "
        "actor. Writes OUT/RUN_NAME/{config.yaml,metrics.jsonl,checkpoint_<step>}; running again with the "
        "same --out and --run-name resumes. Example: raychat rl --checkpoint runs/sft/checkpoint_000400 "
        "--task calculator --steps 50",
    )
    add_flags(parser, RLConfig, preset="none", preset_aliases=("--config",))
    parser.add_argument("--address", default=None, help="Ray cluster address (default: start a local one)")
    parser.set_defaults(func=_main)


def _main(args) -> int:
    try:
        cfg = config_for(args)
        if not cfg.run.init_from:
            raise ValueError("--checkpoint (a chat checkpoint directory) is required")
        read_meta(cfg.run.init_from)  # a clear error before any Ray cluster starts
    except (ValueError, FileNotFoundError) as e:
        print(f"raychat rl: {e}", file=sys.stderr)
        return 2
    started = not ray.is_initialized()
    if started:
        ray.init(address=args.address, include_dashboard=False)
    try:
        summary = RLRun(cfg).run()
    finally:
        if started:
            ray.shutdown()
    print(json.dumps(summary, default=str))
    return 0
