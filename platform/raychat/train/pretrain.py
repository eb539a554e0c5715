"""`raychat pretrain`: derive the run's sizes, print them, and run the training loop on Ray Train.

Every derived number (width, heads, parameters, FLOPs per token, batch, grad accumulation, steps, tokens,
tokens per parameter) is printed before training starts.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys

from raychat.model import GPT, ModelConfig
from raychat.tokenizer import Tokenizer
from raychat.train.config import TrainConfig, add_config_flags, config_from_args, power_law_batch_size


def plan(cfg: TrainConfig, vocab_size: int) -> dict:
    """The derived sizes of a run (pure function of the config and the vocabulary size)."""
    if cfg.init_from:
        from raychat.checkpoint import read_meta

        model_config = ModelConfig(**read_meta(cfg.init_from)["model_config"])
    else:
        model_config = ModelConfig.from_depth(
            cfg.depth, vocab_size, cfg.seq_len, cfg.aspect_ratio, cfg.head_dim, cfg.kv_group
        )
    import torch

    with torch.device("meta"):
        model = GPT(model_config)
    n_params = model.num_params()
    scaling_params = model.num_params(exclude_embedding=True)
    flops_per_token = model.flops_per_token(cfg.seq_len)
    per_micro = cfg.device_batch_size * cfg.seq_len * cfg.num_workers
    if cfg.num_iterations > 0:
        horizon, data_tokens = "num_iterations", None
    elif cfg.target_flops > 0:
        horizon, data_tokens = "target_flops", cfg.target_flops / flops_per_token
    else:
        horizon, data_tokens = "target_param_data_ratio", cfg.target_param_data_ratio * scaling_params
    if cfg.total_batch_size > 0:
        total_batch = cfg.total_batch_size
    else:
        total_batch = power_law_batch_size(data_tokens or cfg.num_iterations * per_micro * 8, per_micro)
    grad_accum = cfg.grad_accum_steps(total_batch)
    num_iterations = (
        cfg.num_iterations if cfg.num_iterations > 0 else max(1, round(data_tokens / total_batch))
    )
    tokens = num_iterations * total_batch
    return {
        "model_config": model_config.to_dict(),
        "num_params": n_params,
        "scaling_params": scaling_params,
        "flops_per_token": flops_per_token,
        "horizon": horizon,
        "total_batch_size": total_batch,
        "grad_accum": grad_accum,
        "num_iterations": num_iterations,
        "tokens": tokens,
        "tokens_per_param": tokens / scaling_params,
        "total_flops": tokens * flops_per_token,
    }


def print_plan(cfg: TrainConfig, p: dict) -> None:
    m = p["model_config"]
    print(
        f"model: depth {m['n_layer']} width {m['n_embd']} heads {m['n_head']} (kv {m['n_kv_head']}) "
        f"head_dim {m['head_dim']} mlp {m['intermediate_size']} vocab {m['vocab_size']}"
    )
    print(f"parameters: {p['num_params']:,} ({p['scaling_params']:,} without the embedding)")
    print(f"FLOPs per token: {p['flops_per_token']:,}")
    print(
        f"batch: {p['total_batch_size']:,} tokens/step = {cfg.num_workers} workers x {cfg.device_batch_size} rows "
        f"x {cfg.seq_len} tokens x {p['grad_accum']} accumulation steps"
    )
    print(
        f"horizon ({p['horizon']}): {p['num_iterations']:,} steps, {p['tokens']:,} tokens, "
        f"{p['tokens_per_param']:.2f} tokens/param, {p['total_flops']:.3g} FLOPs"
    )


def fault_injection(cfg: TrainConfig) -> dict | None:
    """Test hook: RAYCHAT_FAIL_ONCE_AT_STEP=k and RAYCHAT_FAIL_MARKER=path make one worker die at step k once."""
    at, marker = os.environ.get("RAYCHAT_FAIL_ONCE_AT_STEP"), os.environ.get("RAYCHAT_FAIL_MARKER")
    return {"at_step": int(at), "marker": marker, "world": cfg.num_workers} if at and marker else None


DATA_TASK_CPUS = 0.25  # what each Ray Data read+tokenize task reserves (raychat.train.loop.make_row_source)


def check_cpu_room(cfg: TrainConfig, cluster_cpus: float) -> None:
    """Raise ValueError when the workers' CPU reservations leave no room for a Ray Data task: such a run
    would wait forever for its first batch (seen on 2 cores with 2 workers at the default 1 CPU each)."""
    needed = cfg.num_workers * cfg.cpus_per_worker + (DATA_TASK_CPUS if cfg.stage == "pretrain" else 0.0)
    if needed > cluster_cpus + 1e-9:
        raise ValueError(
            f"--num-workers {cfg.num_workers} x --cpus-per-worker {cfg.cpus_per_worker} plus {DATA_TASK_CPUS} CPU "
            f"for Ray Data needs {needed:g} CPUs; the cluster has {cluster_cpus:g}: lower --cpus-per-worker"
        )


def run_training(cfg: TrainConfig):
    """Run (or resume) training on the current Ray cluster; returns the ray.train.Result."""
    import ray
    from ray.train import CheckpointConfig, FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchConfig, TorchTrainer

    from raychat.train.loop import train_loop_per_worker

    cfg = dataclasses.replace(
        cfg,
        storage_path=os.path.abspath(cfg.storage_path) if "://" not in cfg.storage_path else cfg.storage_path,
        data_dir=os.path.abspath(cfg.data_dir),
        tokenizer_path=os.path.abspath(cfg.tokenizer_path),
        init_from=os.path.abspath(cfg.init_from) if cfg.init_from else "",
    )
    tokenizer = Tokenizer.load(cfg.tokenizer_path)
    p = plan(cfg, tokenizer.vocab_size)
    print_plan(cfg, p)
    if not ray.is_initialized():
        ray.init()
    check_cpu_room(cfg, ray.cluster_resources().get("CPU", 0.0))
    trainer = TorchTrainer(
        train_loop_per_worker,
        train_loop_config={
            "train": dataclasses.asdict(cfg),
            "plan": p,
            "fault": fault_injection(cfg),
            "progress_bar": sys.stdout.isatty(),
        },
        scaling_config=ScalingConfig(
            num_workers=cfg.num_workers,
            use_gpu=cfg.use_gpu,
            resources_per_worker={"CPU": cfg.cpus_per_worker},
        ),
        torch_config=TorchConfig(backend="nccl" if cfg.use_gpu else "gloo"),
        run_config=RunConfig(
            name=cfg.run_name,
            storage_path=cfg.storage_path,
            checkpoint_config=CheckpointConfig(num_to_keep=cfg.keep_checkpoints),
            failure_config=FailureConfig(max_failures=cfg.max_failures),
        ),
    )
    result = trainer.fit()
    if (result.checkpoint is None or "step" not in (result.metrics or {})) and "://" not in cfg.storage_path:
        # the run had already finished (nothing left to train): hand back its newest checkpoint
        from types import SimpleNamespace

        from ray.train import Checkpoint

        from raychat.checkpoint import latest_checkpoint, read_meta

        latest = latest_checkpoint(os.path.join(cfg.storage_path, cfg.run_name))
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
    add_config_flags(parser)
    parser.add_argument("--dry-run", action="store_true", help="print the derived sizes and exit")
    parser.set_defaults(func=_main)


def _main(args) -> int:
    cfg = config_from_args(args, "pretrain")
    if args.dry_run:
        print_plan(cfg, plan(cfg, Tokenizer.load(cfg.tokenizer_path).vocab_size))
        return 0
    run_training(cfg)
    return 0
