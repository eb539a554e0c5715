"""What every Ray Train worker runs: assemble the Trainer from the train spec's components and train.

  model (init or init_from) -> the spec's row source -> resume (weights, step) -> FP8 -> optimizers
  -> resume (the one optimizer file, this rank's RNG, every old rank's data state re-dealt to this world)
  -> torch.compile / DDP -> the spec's validators -> metrics sink -> Trainer(...).train()

Resuming reads the run's newest committed checkpoint (raychat.checkpoint_manager, fetched to this node when
remote), the same rule whether Ray Train restarted the group after a fault or the run was started again.
The world size may differ from the checkpoint's (an elastic run after a lost node): gradient accumulation is
recomputed so the total batch stays the same, and the row source re-deals the data states.

The train spec (raychat.train.pretrain.Pretraining or raychat.train.sft.SFT) builds the row source and the
validators; everything else is the same for every stage.
"""

from __future__ import annotations

import dataclasses
import logging
import os

import ray
import ray.train
import ray.train.torch
import torch
from ray.experimental import tqdm_ray
from ray.train.v2._internal.execution import context as ray_train_context
from safetensors.torch import load_file

from raychat.checkpoint import check_model, load_model
from raychat.checkpoint_manager import CheckpointManager, resolve_checkpoint
from raychat.config import TrainConfig, from_dict, to_dict
from raychat.log import log, plural
from raychat.metrics import TrainMetrics
from raychat.metrics_sink import MetricsSink
from raychat.model import GPT, ModelConfig
from raychat.tokenizer import Tokenizer
from raychat.train.checkpointer import Checkpointer, restore_rows
from raychat.train.fp8 import convert_to_fp8, fp8_line
from raychat.train.optim import build_optimizers, muon_ns_choice
from raychat.train.plan import Plan
from raychat.train.startup_trace import mark
from raychat.train.step import NonFiniteError, autocast_for
from raychat.train.trainer import Callback, Trainer, resumed_line


class ProgressBar(Callback):
    """A tqdm bar on the driver (ray.experimental.tqdm_ray), when the driver writes to a terminal."""

    def __init__(self, total: int, start: int, desc: str):
        self.bar = tqdm_ray.tqdm(total=total, desc=desc, position=0)
        self.bar.update(start)

    def on_step_end(self, trainer, stats) -> None:
        self.bar.update(1)

    def on_train_end(self, trainer) -> None:
        self.bar.close()


def quiet_ray_train_reports() -> None:
    """Raise Ray Train's per-report logger to WARNING: its warnings and errors still show. At INFO it writes each
    rank's "Reporting training result N: TrainingReport(... every metric and sample ...)" at every checkpoint,
    which repeats the step line. Ray names that logger by its module's file path (logging.getLogger(__file__))."""
    logging.getLogger(ray_train_context.__file__).setLevel(logging.WARNING)


def log_placement(rank: int, world: int) -> None:
    """Rank 0 prints every rank's node in one line, "placement: rank 0/2 on node <id>, rank 1/2 on node <id>"
    (one line per rank would not do: Ray's log deduplication merges lines that differ only in words with
    digits, so a job's log showed rank 0's line "[repeated 2x across cluster]" and never rank 1's)."""
    nodes = [ray.get_runtime_context().get_node_id()] * world
    if world > 1:
        torch.distributed.all_gather_object(nodes, nodes[0])
    if rank == 0:
        log("placement: " + ", ".join(f"rank {r}/{world} on node {n}" for r, n in enumerate(nodes)))


def build_model(cfg: TrainConfig, plan: Plan, device: torch.device) -> GPT:
    if cfg.run.init_from:
        model, _, _ = load_model(cfg.run.init_from)
        return model.train().to(device)
    torch.manual_seed(cfg.run.seed)
    return GPT(ModelConfig(**plan.model_config)).init_weights(cfg.run.seed).to(device)


def train_gauges(run_name: str, stage: str):
    """stats -> the raychat_train_* Ray gauges (raychat.metrics.TrainMetrics)."""
    gauges = TrainMetrics(run_name, stage)

    def record(s: dict) -> None:
        gauges.record(
            step=s["step"], loss=s["loss"], lr=s["lr"], tokens_per_s=s["tokens_per_s"], mfu=s["mfu"],
            grad_norm=s["grad_norm"], data_wait_frac=s["data_wait_frac"], bpb=s.get("val_bpb"),
        )  # fmt: skip

    return record


def train_loop_per_worker(config: dict) -> NonFiniteError | None:
    """Ray Train entry: config = {"train": TrainConfig as a dict, "plan": Plan as a dict, "checkpoints": the
    run's CheckpointManager (raychat.train.launch.RunPaths), "spec": the spec (the stage's components), "callbacks":
    [Callback], "progress_bar": bool}.

    Returns the NonFiniteError that stopped the run (Ray Train hands rank 0's return value to the driver as
    Result.return_value; a raised error would be retried from the last checkpoint into the same fault), or
    None when training finished.
    """
    mark("worker_fn_start")
    cfg, plan, spec = from_dict(TrainConfig, config["train"]), Plan(**config["plan"]), config["spec"]
    ctx = ray.train.get_context()
    rank, world = ctx.get_world_rank(), ctx.get_world_size()
    log_placement(rank, world)
    plan = dataclasses.replace(plan, grad_accum=cfg.grad_accum_steps(plan.total_batch_size, world))
    device = ray.train.torch.get_device()
    torch.set_num_threads(int(os.environ.get("RAYCHAT_THREADS", max(1, round(cfg.layout.cpus_per_worker)))))
    logging.getLogger("ray.data").setLevel(logging.WARNING)
    quiet_ray_train_reports()
    tokenizer = Tokenizer.load(cfg.data.tokenizer_path)

    model = build_model(cfg, plan, device)
    mark("model_built")
    rows = spec.row_source(cfg, tokenizer, rank, world)
    checkpointer = Checkpointer(cfg.run.stage, to_dict(cfg), tokenizer, {"plan": plan.to_dict()})
    checkpoints: CheckpointManager = config["checkpoints"]  # the driver's RunPaths.checkpoints
    newest = checkpoints.newest()
    # a remote checkpoint is fetched once per node (the cache is shared by the node's workers)
    d = resolve_checkpoint(checkpoints.storage.uri_of(newest.path)) if newest else None
    start_step = 0
    if d:
        meta = check_model(d)
        start_step = meta["step"]
        model.load_state_dict(load_file(os.path.join(d, "model.safetensors"), device=str(device)))
    if cfg.model.fp8:
        convert_to_fp8(model, cfg.model.fp8_recipe)
        if rank == 0:
            log(fp8_line(model, cfg.model.fp8_recipe))
    optimizers = build_optimizers(model, cfg.optim)
    if rank == 0:
        log(f"Muon on rank 0: {muon_ns_choice(model, cfg.optim.ns_dtype).describe()}")
    if d:
        restore_rows(rows, checkpointer.restore(d, rank, optimizers))
        if rank == 0:
            old = meta.get("world_size", world)
            uri, written = checkpoints.uri(newest.step), f"written by {plural(old, 'worker')}"
            log(resumed_line(uri, start_step, written, f" on {plural(world, 'worker')}"))
    train_model = torch.compile(model) if cfg.model.compile else model
    train_model = ray.train.torch.prepare_model(train_model, move_to_device=False)

    validators = spec.validators(cfg, tokenizer, rank, world, device, autocast_for(device))
    mark("validators_built")
    metrics, callbacks = None, list(config.get("callbacks", []))
    if rank == 0:
        run_dir = checkpoints.storage.uri_of(checkpoints.run_path)
        gauges = train_gauges(cfg.run.run_name, cfg.run.stage)
        metrics = MetricsSink(run_dir, gauges, cfg.run.tracker, cfg.run.run_name, to_dict(cfg))
        metrics.resume_at(start_step)
        if config.get("progress_bar"):  # only when the driver writes to a terminal
            callbacks.append(
                ProgressBar(plan.num_iterations, start_step, f"{cfg.run.stage} {cfg.run.run_name}")
            )
    trainer = Trainer(
        cfg, plan, model, train_model, optimizers, rows, validators, checkpointer, checkpoints, metrics, callbacks,
        bos_id=tokenizer.bos_id, rank=rank, world=world, device=device, start_step=start_step,
        smooth_loss=meta.get("metrics", {}).get("smooth_loss") if d else None,
    )  # fmt: skip
    try:
        mark("train_start")
        trainer.train()
    except NonFiniteError as fault:  # every rank meets it at the same step (raychat.train.step)
        if rank == 0:
            log(f"stopped: {fault}")
        return fault
    finally:
        rows.close()  # its Ray Data pipeline's autoscaling request would hold the nodes for 180 s more
        if metrics is not None:
            metrics.close()
        mark("worker_fn_end")
    return None
