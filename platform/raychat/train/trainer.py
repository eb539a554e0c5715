"""The Trainer: the training algorithm over components; pretraining and SFT build different components.

  train():             for each step: train_step -> evaluate (every eval_every and at the end) -> log
                       -> checkpoint (every checkpoint_every and at the end)
  train_step(step):    grad_accum micro-batches from the row source -> lr -> forward_backward of the loss
                       (raychat.train.step: the step's token CE sum / its target tokens over every
                       micro-batch and rank) -> clip + optimizer step; a non-finite loss or grad norm
                       skips the update and raises NonFiniteError (the run stops)

Components: loss (raychat.loss.TokenCrossEntropy), row_source (raychat.data.loader.row_source.RowSource:
`next_batch(n)` -> rows, `state_dict`), validators (raychat.train.validators), checkpointer
(raychat.train.checkpointer) and the run's checkpoints (raychat.checkpoint_manager: every rank uploads its
part, rank 0 commits), metrics (raychat.metrics_sink, rank 0 only), callbacks (hooks at step begin/end, on
each step's rows, before each checkpoint, at the end of training).
"""

from __future__ import annotations

import math
import tempfile
import time
from collections.abc import Sequence

import numpy as np
import ray.train
import torch

from raychat.checkpoint_manager import CheckpointManager
from raychat.config import TrainConfig
from raychat.data.loader.row_source import RowSource
from raychat.gc_heap import freeze_gc_heap
from raychat.log import StepClock, duration, log
from raychat.loss import TokenCrossEntropy
from raychat.masks import make_batch
from raychat.metrics_sink import MetricsSink
from raychat.train.checkpointer import Checkpointer, commit_ranks
from raychat.train.optim import lr_multiplier, set_lr
from raychat.train.plan import Plan, peak_flops_of
from raychat.train.startup_trace import mark
from raychat.train.step import NonFiniteError, autocast_for, clear_grads, forward_backward, optimizer_step
from raychat.train.validators import Validator, validate_all


def to_batch(
    rows: dict, bos_id: int, document_masking: bool, device: torch.device
) -> dict[str, torch.Tensor]:
    """Packed rows (numpy (n, T+1)) -> the model's batch on `device` (raychat.masks.make_batch)."""
    b = make_batch(
        torch.from_numpy(np.asarray(rows["input_ids"])),
        bos_id,
        supervised=torch.from_numpy(np.asarray(rows["supervised"])) if "supervised" in rows else None,
        segment_ids=torch.from_numpy(np.asarray(rows["segment_ids"])) if "segment_ids" in rows else None,
        document_masking=document_masking,
    )
    return {k: v.to(device, non_blocking=True) for k, v in b.items()}


class Callback:
    """Hooks into Trainer.train(); override what you need."""

    def on_step_begin(self, trainer: Trainer, step: int) -> None: ...

    def on_step_end(self, trainer: Trainer, stats: dict) -> None: ...

    def on_batch(self, trainer: Trainer, step: int, batches: list[dict]) -> None:
        """The row source's micro-batches of step `step` (0-based), before they become tensors."""

    def on_save(self, trainer: Trainer, step: int) -> None:
        """Just before checkpoint `step` is written."""

    def on_train_end(self, trainer: Trainer) -> None: ...


def due(every: int, done: int, last: int) -> bool:
    """Whether step `done` (counted from 1) evaluates or checkpoints: every `every` steps (0 = only at the end)
    and at step `last`, the run's last."""
    return bool(every and done % every == 0) or done == last


def resumed_line(checkpoint: str, step: int, detail: str, where: str = "") -> str:
    """The line of a run resumed from `checkpoint`, at step `step` (its meta's: the steps trained): it names the
    step trained next, counting from 1 as the step lines do, e.g. "resumed from .../checkpoint_000005 (step 5,
    written by 2 workers): goes on at step 6 on 1 worker" (detail: "written by 2 workers", where: " on 1
    worker")."""
    return f"resumed from {checkpoint} (step {step}, {detail}): goes on at step {step + 1}{where}"


class Trainer:
    """Trains `model` on the rows of `row_source` (see the module doc). One instance per Ray Train worker.

    Args:
        config: the run's TrainConfig; plan: its derived sizes.
        model: the parameters (FP8-converted if asked); train_model: what the step calls (compiled and/or
            DDP-wrapped `model`).
        optimizers: from raychat.train.optim.build_optimizers.
        checkpointer: writes this rank's files; checkpoints: the run's CheckpointManager they go to.
        metrics: rank 0's MetricsSink (its opener, the worker, closes it), None on other ranks.
        bos_id: the tokenizer's BOS id (masks), rank / world: this worker and the group size.
        start_step: steps already done (resume).
    """

    def __init__(
        self,
        config: TrainConfig,
        plan: Plan,
        model: torch.nn.Module,
        train_model: torch.nn.Module,
        optimizers: list,
        row_source: RowSource,
        validators: Sequence[Validator],
        checkpointer: Checkpointer,
        checkpoints: CheckpointManager,
        metrics: MetricsSink | None,
        callbacks: Sequence[Callback] = (),
        *,
        bos_id: int,
        rank: int,
        world: int,
        device: torch.device,
        start_step: int = 0,
        smooth_loss: float | None = None,
    ):
        self.config, self.plan = config, plan
        self.model, self.train_model, self.optimizers = model, train_model, optimizers
        self.row_source, self.validators, self.checkpointer = row_source, list(validators), checkpointer
        self.checkpoints = checkpoints
        self.metrics, self.callbacks = metrics, list(callbacks)
        self.bos_id, self.rank, self.world, self.device = bos_id, rank, world, device
        self.start_step = start_step
        self.loss, self.autocast = TokenCrossEntropy(), autocast_for(device)
        horizon = config.train.horizon
        self.stop = (
            min(plan.num_iterations, horizon.stop_after) if horizon.stop_after > 0 else plan.num_iterations
        )
        # the loss's moving average (0.9) goes on from the resumed checkpoint's: it restarted at the first
        # resumed step's loss, a step in the curve at every resume
        self.smooth_loss: float | None = smooth_loss

    # ---- the algorithm ---------------------------------------------------------------------------
    def train(self) -> None:
        clock = StepClock()
        for step in range(self.start_step, self.stop):
            for cb in self.callbacks:
                cb.on_step_begin(self, step)
            stats = self.train_step(step)
            if step == self.start_step:
                mark("first_step_done")
                freeze_gc_heap()  # what the run keeps (model, optimizers, data): never scanned by the GC again
            done = stats["step"]
            if self.due(self.config.train.eval.eval_every, done):
                stats.update(validate_all(self.validators, self.model, done, self.stop))
            if self.rank == 0:
                self.log_step(stats, clock.tick())
            report = {k: v for k, v in stats.items() if v is not None}
            if self.due(self.config.train.checkpoint.checkpoint_every, done):
                self.save(done, report)
            for cb in self.callbacks:
                cb.on_step_end(self, stats)
        for cb in self.callbacks:
            cb.on_train_end(self)

    def due(self, every: int, done: int) -> bool:
        """Every `every` steps (0 = never) and at the last step of this run."""
        return due(every, done, self.stop)

    def train_step(self, step: int) -> dict:
        """One optimizer step (0-based `step`); returns its stats (step counts from 1)."""
        cfg, plan = self.config, self.plan
        t0 = time.perf_counter()
        batches = [
            self.row_source.next_batch(cfg.train.batch.device_batch_size) for _ in range(plan.grad_accum)
        ]
        for cb in self.callbacks:
            cb.on_batch(self, step, batches)
        micro = [to_batch(b, self.bos_id, cfg.model.document_masking, self.device) for b in batches]
        t_data = time.perf_counter() - t0
        if step == self.start_step:
            mark("first_batch")
        s = cfg.train.lr_schedule
        lr = set_lr(
            self.optimizers,
            lr_multiplier(step, plan.num_iterations, s.warmup_ratio, s.warmdown_ratio, s.final_lr_frac),
        )
        sums = forward_backward(self.train_model, micro, self.loss, self.autocast, self.world)
        loss = sums.stats[0] / max(sums.totals[0], 1)  # the step's CE sum / its target tokens
        if not math.isfinite(loss):  # no update; the run stops (a non-finite grad norm: optimizer_step)
            clear_grads(self.optimizers)
            raise NonFiniteError("loss", loss, step + 1)
        grad_norm = optimizer_step(self.model.parameters(), self.optimizers, cfg.optim.grad_clip, step + 1)
        if self.device.type == "cuda":
            torch.cuda.synchronize()
        dt = time.perf_counter() - t0
        return self.step_stats(step + 1, loss, lr, grad_norm, dt, t_data)

    def step_stats(
        self, done: int, loss: float, lr: float, grad_norm: float, dt: float, t_data: float
    ) -> dict:
        tokens_per_s = self.plan.total_batch_size / dt
        peak = self.peak_flops()
        mfu = (
            self.plan.flops_per_token * self.plan.total_batch_size / dt / (peak * self.world)
            if peak
            else None
        )
        self.smooth_loss = loss if self.smooth_loss is None else 0.9 * self.smooth_loss + 0.1 * loss
        return {
            "step": done,
            "loss": loss,
            "smooth_loss": self.smooth_loss,
            "lr": lr,
            "grad_norm": grad_norm,
            "tokens_per_s": tokens_per_s,
            "mfu": mfu,
            "data_wait_frac": t_data / dt,
        }

    def peak_flops(self) -> float | None:
        """Peak FLOP/s of one device: --peak-flops, or the data sheet's dense bf16 figure for known GPUs."""
        if self.config.layout.peak_flops > 0:
            return self.config.layout.peak_flops
        if self.device.type == "cuda":
            return peak_flops_of(torch.cuda.get_device_name(self.device))
        return None

    # ---- logging and checkpoints -------------------------------------------------------------------
    def log_step(self, stats: dict, seconds_per_step: float) -> None:
        """The step's line (every --log-every steps, the last, and any with an evaluation) with its ETA:
        seconds_per_step (StepClock) x the steps left to this run's end
        (--stop-after's step, else the plan's last); its stats to the metrics sink."""
        done, n_iter = stats["step"], self.plan.num_iterations
        evaluated = {k: v for k, v in stats.items() if k.endswith(("val_bpb", "accuracy")) and v is not None}
        if done % self.config.train.logging.log_every == 0 or done == self.stop or evaluated:
            mfu = stats["mfu"]
            log(
                f"step {done:5d}/{n_iter} | loss {stats['loss']:.4f} | lr {stats['lr']:.3g} | "
                f"grad_norm {stats['grad_norm']:.3f} | tok/s {stats['tokens_per_s']:,.0f} | "
                f"mfu {f'{100 * mfu:.1f}%' if mfu else 'n/a'} | data wait {100 * stats['data_wait_frac']:.1f}% | "
                f"eta {duration(seconds_per_step * (self.stop - done))}"
                + "".join(f" | {k} {v:.4f}" for k, v in evaluated.items())
            )
            for s in stats.get("samples", []):
                log(f"  sample: {s!r}")
        if self.metrics is not None:
            self.metrics.log({k: v for k, v in stats.items() if k != "samples"})

    def save(self, step: int, report: dict) -> None:
        """Write this rank's part of checkpoint `step`, commit it with every rank's (raychat.checkpoint_manager),
        then report the step's metrics to Ray Train. Rank 0 first stores metrics.jsonl (object storage: it is
        PUT at intervals), so every committed step's line is stored and a resumed run's file has no gap (a failed
        write is a warning and the commit goes on: raychat.metrics_sink)."""
        for cb in self.callbacks:
            cb.on_save(self, step)
        if self.metrics is not None:
            self.metrics.flush()
        with tempfile.TemporaryDirectory() as tmp:
            state = {"rows": self.row_source.state_dict()}
            self.checkpointer.write(
                tmp, self.rank, self.world, step, self.model, self.optimizers, state, metrics=report
            )
            commit_ranks(self.checkpoints, tmp, step, self.rank, self.world, self.config.run.stage)
        ray.train.report(report)
