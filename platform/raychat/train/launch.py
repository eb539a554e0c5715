"""Driver side of pretraining and SFT: derive and print the plan, start Ray Train, return its result; and the
command-line plumbing both commands share.

A stage is an object with `row_source(cfg, tokenizer, rank, world)`, `evaluators(cfg, tokenizer, rank,
world, device, autocast)` and `data_cpus` (CPUs each of its Ray Data tasks reserves; 0 = none):
raychat.train.pretrain.Pretraining and raychat.train.sft.SFT.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from types import SimpleNamespace

from ray.train import Checkpoint, CheckpointConfig, FailureConfig, RunConfig, ScalingConfig
from ray.train.torch import TorchConfig, TorchTrainer

from raychat.checkpoint import latest_checkpoint, read_meta
from raychat.config import TrainConfig, add_flags, from_args, from_dict, to_dict
from raychat.tokenizer import Tokenizer
from raychat.train.layout import start_or_connect
from raychat.train.plan import make_plan, print_plan
from raychat.train.worker import train_loop_per_worker


def absolute_paths(cfg: TrainConfig) -> TrainConfig:
    """Local paths made absolute (Ray Train workers do not run in the driver's directory)."""
    storage = cfg.run.storage_path
    paths = {
        "storage_path": os.path.abspath(storage) if "://" not in storage else storage,
        "data_dir": os.path.abspath(cfg.data.data_dir),
        "tokenizer_path": os.path.abspath(cfg.data.tokenizer_path),
        "init_from": os.path.abspath(cfg.run.init_from) if cfg.run.init_from else "",
    }
    return from_dict(TrainConfig, paths, base=cfg)


def run_training(cfg: TrainConfig, stage, callbacks=()):
    """Run (or resume) training of `stage` on the current Ray cluster; returns the ray.train.Result.

    callbacks: raychat.train.trainer.Callback objects every worker runs (pickled to the workers).
    """
    cfg = absolute_paths(cfg)
    tokenizer = Tokenizer.load(cfg.data.tokenizer_path)
    plan = make_plan(cfg, tokenizer.vocab_size)
    print_plan(cfg, plan)
    c = cfg.cluster
    print(start_or_connect(c.num_workers, c.cpus_per_worker, stage.data_cpus))
    trainer = TorchTrainer(
        train_loop_per_worker,
        train_loop_config={
            "train": to_dict(cfg),
            "plan": plan.to_dict(),
            "stage": stage,
            "callbacks": list(callbacks),
            "progress_bar": sys.stdout.isatty(),
        },
        scaling_config=ScalingConfig(
            num_workers=c.num_workers, use_gpu=c.use_gpu, resources_per_worker={"CPU": c.cpus_per_worker}
        ),
        torch_config=TorchConfig(backend="nccl" if c.use_gpu else "gloo"),
        run_config=RunConfig(
            name=cfg.run.run_name,
            storage_path=cfg.run.storage_path,
            checkpoint_config=CheckpointConfig(num_to_keep=cfg.train.checkpoint.keep_checkpoints),
            failure_config=FailureConfig(max_failures=c.max_failures),
        ),
    )
    result = trainer.fit()
    if (
        result.checkpoint is None or "step" not in (result.metrics or {})
    ) and "://" not in cfg.run.storage_path:
        # the run had already finished (nothing left to train): hand back its newest checkpoint
        latest = latest_checkpoint(os.path.join(cfg.run.storage_path, cfg.run.run_name))
        if latest is not None:
            result = SimpleNamespace(
                checkpoint=Checkpoint.from_directory(str(latest)),
                metrics=read_meta(latest).get("metrics", {}),
            )
    print(f"final checkpoint: {result.checkpoint.path if result.checkpoint else None}")
    print(f"final metrics: {json.dumps({k: v for k, v in result.metrics.items() if k != 'samples'})}")
    return result


def add_command(subparsers, name: str, defaults: TrainConfig, main, **parser_kw) -> argparse.ArgumentParser:
    """A training subcommand: --preset plus one flag per TrainConfig option (help shows `defaults`)."""
    parser = subparsers.add_parser(name, **parser_kw)
    add_flags(parser, TrainConfig, defaults=defaults, preset="cpu")
    parser.set_defaults(func=main)
    return parser


def config_from(args: argparse.Namespace, defaults: TrainConfig, section: str) -> TrainConfig:
    """The command's TrainConfig: flags > the preset's `section` layers (train; train + sft for SFT) >
    `defaults`."""
    return from_args(args, TrainConfig, section, base=defaults, where=f"{section} settings")
