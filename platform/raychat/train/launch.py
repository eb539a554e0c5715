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

import ray
from ray.train import Checkpoint, CheckpointConfig, FailureConfig, RunConfig, ScalingConfig
from ray.train.torch import TorchConfig, TorchTrainer

from raychat.checkpoint import latest_checkpoint, read_meta
from raychat.config import TrainConfig, add_flags, from_args, from_dict, to_dict
from raychat.tokenizer import Tokenizer
from raychat.train.plan import make_plan, print_plan
from raychat.train.step import NonFiniteError
from raychat.train.worker import train_loop_per_worker


def check_cpu_room(cfg: TrainConfig, cluster_cpus: float, data_cpus: float) -> None:
    """Raise ValueError when the workers' CPU reservations leave no room for a Ray Data task: such a run
    would wait forever for its first batch (seen on 2 cores with 2 workers at the default 1 CPU each).
    An elastic run is checked with the workers Ray Train starts on this cluster (as many as fit, at most
    --num-workers, at least --min-workers)."""
    fewest, most = cfg.cluster.worker_range
    cpus = cfg.cluster.cpus_per_worker
    workers = max(fewest, min(most, int(cluster_cpus / cpus + 1e-9)))
    needed = workers * cpus + data_cpus
    if needed > cluster_cpus + 1e-9:
        raise ValueError(
            f"{workers} workers x --cpus-per-worker {cpus} plus {data_cpus} CPU "
            f"for Ray Data needs {needed:g} CPUs; the cluster has {cluster_cpus:g}: lower --cpus-per-worker"
        )


def elastic_grad_accum(cfg: TrainConfig, total_batch_size: int) -> dict[int, int]:
    """{workers: micro-batches per step} for every world size the run may train on (one entry unless
    --min-workers makes it elastic): the total batch, and so the optimization, stays the same on each.

    Raises:
        ConfigError: the total batch does not divide by device_batch_size x seq_len x workers for one of them.
    """
    fewest, most = cfg.cluster.worker_range
    return {w: cfg.grad_accum_steps(total_batch_size, w) for w in range(fewest, most + 1)}


def scaling_config(cfg: TrainConfig) -> ScalingConfig:
    """Ray Train's ScalingConfig: num_workers=(min, max) when elastic (Train V2 restarts the group on the
    workers that remain, from the last checkpoint), else the fixed --num-workers."""
    c = cfg.cluster
    fewest, most = c.worker_range
    return ScalingConfig(
        num_workers=(fewest, most) if fewest < most else most,
        use_gpu=c.use_gpu,
        resources_per_worker={"CPU": c.cpus_per_worker},
    )


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
    if not ray.is_initialized():
        ray.init()
    check_cpu_room(cfg, ray.cluster_resources().get("CPU", 0.0), stage.data_cpus)
    accum = elastic_grad_accum(cfg, plan.total_batch_size)
    if len(accum) > 1:
        print("elastic: " + ", ".join(f"{w} workers x {k} accumulation steps" for w, k in accum.items()))
    c = cfg.cluster
    trainer = TorchTrainer(
        train_loop_per_worker,
        train_loop_config={
            "train": to_dict(cfg),
            "plan": plan.to_dict(),
            "stage": stage,
            "callbacks": list(callbacks),
            "progress_bar": sys.stdout.isatty(),
        },
        scaling_config=scaling_config(cfg),
        torch_config=TorchConfig(backend="nccl" if c.use_gpu else "gloo"),
        run_config=RunConfig(
            name=cfg.run.run_name,
            storage_path=cfg.run.storage_path,
            checkpoint_config=CheckpointConfig(num_to_keep=cfg.train.checkpoint.keep_checkpoints),
            failure_config=FailureConfig(max_failures=c.max_failures),
        ),
    )
    result = trainer.fit()
    fault = getattr(result, "return_value", None)  # rank 0's NonFiniteError, returned (not raised)
    if isinstance(fault, NonFiniteError):
        print(f"stopped: {fault}; last checkpoint: {result.checkpoint.path if result.checkpoint else None}")
        raise fault
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
