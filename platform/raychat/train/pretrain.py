"""`raychat pretrain`: derive the run's sizes, print them, and run the training loop on Ray Train.

Every derived number (width, heads, parameters, FLOPs per token, batch, grad accumulation, steps, tokens,
tokens per parameter) is printed before training starts.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from raychat.config import TrainConfig, add_flags, from_args, from_dict, preset_section, to_dict
from raychat.config.train import SFT_DEFAULTS
from raychat.tokenizer import Tokenizer
from raychat.train.plan import make_plan, print_plan


def fault_injection(cfg: TrainConfig) -> dict | None:
    """Test hook: RAYCHAT_FAIL_ONCE_AT_STEP=k and RAYCHAT_FAIL_MARKER=path make one worker die at step k once."""
    at, marker = os.environ.get("RAYCHAT_FAIL_ONCE_AT_STEP"), os.environ.get("RAYCHAT_FAIL_MARKER")
    return {"at_step": int(at), "marker": marker, "world": cfg.cluster.num_workers} if at and marker else None


DATA_TASK_CPUS = 0.25  # what each Ray Data read+tokenize task reserves (raychat.train.loop.make_row_source)


def check_cpu_room(cfg: TrainConfig, cluster_cpus: float) -> None:
    """Raise ValueError when the workers' CPU reservations leave no room for a Ray Data task: such a run
    would wait forever for its first batch (seen on 2 cores with 2 workers at the default 1 CPU each)."""
    needed = cfg.cluster.num_workers * cfg.cluster.cpus_per_worker + (
        DATA_TASK_CPUS if cfg.run.stage == "pretrain" else 0.0
    )
    if needed > cluster_cpus + 1e-9:
        raise ValueError(
            f"--num-workers {cfg.cluster.num_workers} x --cpus-per-worker {cfg.cluster.cpus_per_worker} plus {DATA_TASK_CPUS} CPU "
            f"for Ray Data needs {needed:g} CPUs; the cluster has {cluster_cpus:g}: lower --cpus-per-worker"
        )


def run_training(cfg: TrainConfig):
    """Run (or resume) training on the current Ray cluster; returns the ray.train.Result."""
    import ray
    from ray.train import CheckpointConfig, FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchConfig, TorchTrainer

    from raychat.train.loop import train_loop_per_worker

    storage = cfg.run.storage_path
    cfg = from_dict(
        TrainConfig,
        {
            "storage_path": os.path.abspath(storage) if "://" not in storage else storage,
            "data_dir": os.path.abspath(cfg.data.data_dir),
            "tokenizer_path": os.path.abspath(cfg.data.tokenizer_path),
            "init_from": os.path.abspath(cfg.run.init_from) if cfg.run.init_from else "",
        },
        base=cfg,
    )
    tokenizer = Tokenizer.load(cfg.data.tokenizer_path)
    p = make_plan(cfg, tokenizer.vocab_size)
    print_plan(cfg, p)
    if not ray.is_initialized():
        ray.init()
    check_cpu_room(cfg, ray.cluster_resources().get("CPU", 0.0))
    trainer = TorchTrainer(
        train_loop_per_worker,
        train_loop_config={
            "train": to_dict(cfg),
            "plan": p.to_dict(),
            "fault": fault_injection(cfg),
            "progress_bar": sys.stdout.isatty(),
        },
        scaling_config=ScalingConfig(
            num_workers=cfg.cluster.num_workers,
            use_gpu=cfg.cluster.use_gpu,
            resources_per_worker={"CPU": cfg.cluster.cpus_per_worker},
        ),
        torch_config=TorchConfig(backend="nccl" if cfg.cluster.use_gpu else "gloo"),
        run_config=RunConfig(
            name=cfg.run.run_name,
            storage_path=cfg.run.storage_path,
            checkpoint_config=CheckpointConfig(num_to_keep=cfg.train.checkpoint.keep_checkpoints),
            failure_config=FailureConfig(max_failures=cfg.cluster.max_failures),
        ),
    )
    result = trainer.fit()
    if (
        result.checkpoint is None or "step" not in (result.metrics or {})
    ) and "://" not in cfg.run.storage_path:
        # the run had already finished (nothing left to train): hand back its newest checkpoint
        from types import SimpleNamespace

        from ray.train import Checkpoint

        from raychat.checkpoint import latest_checkpoint, read_meta

        latest = latest_checkpoint(os.path.join(cfg.run.storage_path, cfg.run.run_name))
        if latest is not None:
            result = SimpleNamespace(
                checkpoint=Checkpoint.from_directory(str(latest)),
                metrics=read_meta(latest).get("metrics", {}),
            )
    print(f"final checkpoint: {result.checkpoint.path if result.checkpoint else None}")
    print(f"final metrics: {json.dumps({k: v for k, v in result.metrics.items() if k != 'samples'})}")
    return result


def add_cli(subparsers) -> None:
    parser = subparsers.add_parser(
        "pretrain",
        help="pretrain the base model on Ray Train (DDP)",
        description="Pretrain on packed parquet shards with Ray Train. Sizes derive from --depth; every derived "
        "number is printed first. Running again with the same --run-name and --storage-path resumes.",
    )
    add_flags(parser, TrainConfig, preset="cpu")
    parser.add_argument("--dry-run", action="store_true", help="print the derived sizes and exit")
    parser.set_defaults(func=_main)


def config_for(args, stage: str = "pretrain") -> TrainConfig:
    """The command's TrainConfig: flags > the preset (its train section, plus its sft section for SFT) >
    the stage's defaults (SFT_DEFAULTS for SFT)."""
    base = from_dict(TrainConfig, SFT_DEFAULTS) if stage == "sft" else TrainConfig()
    return from_args(args, TrainConfig, stage, base=base, where=f"{stage} settings")


def dry_run_vocab_size(cfg: TrainConfig, preset: str | None) -> int:
    """The vocabulary of the run's tokenizer, or (before one is trained) the preset's tokenizer.vocab_size.

    Raises:
        FileNotFoundError: no tokenizer at --tokenizer-path and no vocab_size in the preset.
    """
    if (Path(cfg.data.tokenizer_path) / "tokenizer.json").exists():
        return Tokenizer.load(cfg.data.tokenizer_path).vocab_size
    size = preset_section(preset, "tokenizer").get("vocab_size") if preset and preset != "none" else None
    if not size:
        raise FileNotFoundError(f"no tokenizer.json in {cfg.data.tokenizer_path} (--tokenizer-path)")
    print(f"(no tokenizer in {cfg.data.tokenizer_path} yet: sizes for the preset's vocab_size {size})")
    return int(size)


def _main(args) -> int:
    cfg = config_for(args, "pretrain")
    if args.dry_run:
        print_plan(cfg, make_plan(cfg, dry_run_vocab_size(cfg, args.preset)))
        return 0
    run_training(cfg)
    return 0
