"""The training loop that every Ray Train worker runs (pretraining and SFT share it).

One optimizer step:
  1. take grad_accum micro-batches of packed rows from this rank's row source (timed: data wait)
  2. count target tokens over all micro-batches, all-reduce over ranks -> n_targets
  3. for each micro-batch: loss = sum of token CE / n_targets * world_size; backward (DDP averages over
     ranks, so the step's gradient is the gradient of  sum(CE over every target of the step) / n_targets)
  4. clip the global grad norm; stop with a clear error on a non-finite loss (no checkpoint is written)
  5. Muon + AdamW step at the scheduled lr
Every eval_every steps: validation BPB (+ samples); every checkpoint_every steps: a checkpoint with the
model, each rank's optimizer, RNG and data position, reported through ray.train.report.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import sys
import tempfile
import time

import numpy as np
import torch

from raychat.checkpoint import load_rank_state, read_meta, save_model, save_rank_state
from raychat.config import TrainConfig, from_dict, to_dict
from raychat.loss import cross_entropy_sum, global_target_count, normalize
from raychat.masks import make_batch
from raychat.model import GPT, ModelConfig
from raychat.tokenizer import Tokenizer
from raychat.train.optim import build_optimizers, lr_multiplier, set_lr

# Dense bf16 peak FLOP/s of one device (for MFU), from the vendors' data sheets.
PEAK_FLOPS = {"H100": 989e12, "H200": 989e12, "A100": 312e12, "L4": 121e12, "A10G": 70e12}


def peak_flops(cfg: TrainConfig, device: torch.device) -> float | None:
    if cfg.cluster.peak_flops > 0:
        return cfg.cluster.peak_flops
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        return next((v for k, v in PEAK_FLOPS.items() if k in name), None)
    return None


def build_model(cfg: TrainConfig, plan: dict, device: torch.device) -> GPT:
    if cfg.run.init_from:
        from raychat.checkpoint import load_model

        model, _, _ = load_model(cfg.run.init_from)
        return model.train().to(device)
    torch.manual_seed(cfg.run.seed)
    return GPT(ModelConfig(**plan["model_config"])).init_weights(cfg.run.seed).to(device)


def make_row_source(cfg: TrainConfig, tokenizer: Tokenizer, rank: int, world: int):
    """The stage's resumable stream of packed rows: `.next_batch(n) -> dict of (n, T+1) arrays`."""
    if cfg.run.stage == "pretrain":
        from raychat.data.pipeline import PretrainRows
        from raychat.data.shards import list_shards
        from raychat.train.pretrain import DATA_TASK_CPUS

        train_files, _ = list_shards(cfg.data.data_dir)
        return PretrainRows(
            train_files,
            cfg.data.tokenizer_path,
            cfg.model.seq_len + 1,
            rank,
            world,
            cfg.data.buffer_size,
            num_cpus=DATA_TASK_CPUS,
        )
    from raychat.train.sft import SFTRows

    return SFTRows(cfg, tokenizer, rank, world)


def validation_rows(cfg: TrainConfig, tokenizer: Tokenizer, rank: int, world: int) -> np.ndarray:
    """This rank's share of a fixed set of validation rows (same rows at every evaluation)."""
    if cfg.run.stage == "sft":
        from raychat.train.sft import sft_validation_rows

        rows = sft_validation_rows(cfg, tokenizer)
    else:
        import pyarrow.parquet as pq

        from raychat.data.packing import BestFitPacker
        from raychat.data.shards import list_shards

        _, val_file = list_shards(cfg.data.data_dir)
        texts = pq.read_table(val_file, columns=["text"]).column("text").to_pylist()
        docs = iter(tokenizer.encode_batch(texts, prepend_bos=True))
        packer = BestFitPacker(lambda: next(docs, None), cfg.model.seq_len + 1, cfg.data.buffer_size)
        n = max(world, cfg.train.eval.eval_tokens // cfg.model.seq_len // world * world)
        rows = [r for _, r in zip(range(n), packer)]
        rows = {"input_ids": np.stack(rows)}
    return {k: v[rank::world] for k, v in rows.items()}


def to_batch(rows: dict, cfg: TrainConfig, bos_id: int, device: torch.device) -> dict[str, torch.Tensor]:
    b = make_batch(
        torch.from_numpy(np.asarray(rows["input_ids"])),
        bos_id,
        supervised=torch.from_numpy(np.asarray(rows["supervised"])) if "supervised" in rows else None,
        segment_ids=torch.from_numpy(np.asarray(rows["segment_ids"])) if "segment_ids" in rows else None,
        document_masking=cfg.model.document_masking,
    )
    return {k: v.to(device, non_blocking=True) for k, v in b.items()}


def all_reduce_sum(x: torch.Tensor) -> torch.Tensor:
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.all_reduce(x)
    return x


def log(message: str) -> None:
    """A line to the worker's stdout (streamed to the driver). Ray Train patches `print` to tee into its
    logger too, which shows every line twice on the driver; writing to sys.__stdout__ directly does not."""
    print(message, file=sys.__stdout__, flush=True)


def fail_once_for_tests(fault: dict | None, step: int, rank: int) -> None:
    """Fault injection for tests: fault = {"at_step": k, "marker": path} (from the driver's environment
    RAYCHAT_FAIL_ONCE_AT_STEP / RAYCHAT_FAIL_MARKER). Rank 1 (or 0 alone) dies with os._exit at step k the
    first time only, like a lost node; Ray Train then restarts the group from the last checkpoint."""
    if (
        fault
        and step == fault["at_step"]
        and rank == min(1, fault["world"] - 1)
        and not os.path.exists(fault["marker"])
    ):
        open(fault["marker"], "w").close()
        os._exit(1)


def train_loop_per_worker(config: dict) -> None:
    """Ray Train entry: config = {"train": TrainConfig fields, "plan": derived sizes (see pretrain.plan)}."""
    import ray.train
    import ray.train.torch
    from ray.train import Checkpoint

    from raychat.metrics import TrainMetrics

    cfg = from_dict(TrainConfig, config["train"])
    plan = config["plan"]
    ctx = ray.train.get_context()
    rank, world = ctx.get_world_rank(), ctx.get_world_size()
    device = ray.train.torch.get_device()
    torch.set_num_threads(int(os.environ.get("RAYCHAT_THREADS", max(1, round(cfg.cluster.cpus_per_worker)))))
    logging.getLogger("ray.data").setLevel(logging.WARNING)
    tokenizer = Tokenizer.load(cfg.data.tokenizer_path)

    model = build_model(cfg, plan, device)
    rows = make_row_source(cfg, tokenizer, rank, world)
    start_step = 0
    checkpoint = ray.train.get_checkpoint()
    if checkpoint:
        with checkpoint.as_directory() as d:
            from safetensors.torch import load_file

            model.load_state_dict(load_file(os.path.join(d, "model.safetensors"), device=str(device)))
            start_step = read_meta(d)["step"]
    if cfg.model.fp8:
        from raychat.train.fp8 import convert_to_fp8

        convert_to_fp8(model, cfg.model.fp8_recipe)
    optimizers = build_optimizers(model, cfg.optim)
    if checkpoint:
        with checkpoint.as_directory() as d:
            rows.load_state_dict(load_rank_state(d, rank, optimizers)["rows"])
        if rank == 0:
            log(f"resumed from {checkpoint.path} at step {start_step}")
    train_model = torch.compile(model) if cfg.model.compile else model
    train_model = ray.train.torch.prepare_model(train_model, move_to_device=False)

    autocast = (
        (lambda: torch.autocast("cuda", dtype=torch.bfloat16))
        if device.type == "cuda"
        else (lambda: contextlib.nullcontext())
    )
    token_bytes = torch.tensor(tokenizer.token_bytes(), dtype=torch.int64)
    val_rows = validation_rows(cfg, tokenizer, rank, world)
    metrics = TrainMetrics(cfg.run.run_name, cfg.run.stage) if rank == 0 else None
    n_iter, accum = plan["num_iterations"], plan["grad_accum"]
    flops_per_step = plan["flops_per_token"] * plan["total_batch_size"]
    peak = peak_flops(cfg, device)
    progress = None
    if rank == 0 and config.get("progress_bar"):  # only when the driver writes to a terminal
        from ray.experimental import tqdm_ray

        progress = tqdm_ray.tqdm(total=n_iter, desc=f"{cfg.run.stage} {cfg.run.run_name}", position=0)
        progress.update(start_step)

    def evaluate(step: int) -> dict:
        from raychat.eval.bpb import evaluate_bpb
        from raychat.eval.samples import greedy_samples
        from raychat.train.fp8 import high_precision_linears

        with high_precision_linears(model) if cfg.model.fp8 else contextlib.nullcontext():
            bpb, _ = evaluate_bpb(
                model,
                val_rows,
                token_bytes,
                tokenizer.bos_id,
                cfg.train.batch.device_batch_size,
                cfg.model.document_masking,
                device,
                autocast,
            )
            out = {"val_bpb": bpb}
            if cfg.run.stage == "sft" and rank == 0:
                from raychat.eval.tasks import task_accuracy
                from raychat.tasks import Calculator

                out["calculator_accuracy"] = task_accuracy(
                    model,
                    tokenizer,
                    Calculator(split="test", seed=cfg.run.seed),
                    cfg.train.eval.eval_examples,
                )
            if rank == 0 and (
                step == n_iter or (cfg.train.eval.sample_every and step % cfg.train.eval.sample_every == 0)
            ):
                samples = (
                    greedy_samples(model, tokenizer, device=device) if cfg.run.stage == "pretrain" else []
                )
                for s in samples:
                    log(f"  sample: {s!r}")
                out["samples"] = samples
        return out

    def save(step: int, report: dict) -> None:
        with tempfile.TemporaryDirectory() as tmp:
            if rank == 0:
                meta = {
                    "step": step,
                    "kind": cfg.run.stage,
                    "metrics": report,
                    "plan": plan,
                    "train_config": to_dict(cfg),
                }
                save_model(tmp, model, tokenizer, meta)
            save_rank_state(tmp, rank, optimizers, {"rows": rows.state_dict(), "step": step})
            ray.train.report(report, checkpoint=Checkpoint.from_directory(tmp))

    log_path = None  # rank 0 appends one JSON line per step next to the checkpoints (local storage only)
    if rank == 0 and "://" not in cfg.run.storage_path:
        log_path = os.path.join(cfg.run.storage_path, cfg.run.run_name, "metrics.jsonl")
        os.makedirs(os.path.dirname(log_path), exist_ok=True)
    t_start, smooth_loss = time.perf_counter(), None
    stop = min(n_iter, cfg.train.horizon.stop_after) if cfg.train.horizon.stop_after > 0 else n_iter
    for step in range(start_step, stop):
        t0 = time.perf_counter()
        micro = [
            to_batch(rows.next_batch(cfg.train.batch.device_batch_size), cfg, tokenizer.bos_id, device)
            for _ in range(accum)
        ]
        t_data = time.perf_counter() - t0
        n_targets = global_target_count(mb["loss_mask"] for mb in micro)
        lr = set_lr(
            optimizers,
            lr_multiplier(
                step,
                n_iter,
                cfg.train.schedule.warmup_ratio,
                cfg.train.schedule.warmdown_ratio,
                cfg.train.schedule.final_lr_frac,
            ),
        )
        loss_sum = torch.zeros((), dtype=torch.float64, device=device)
        for i, mb in enumerate(micro):
            sync = i == accum - 1 or not hasattr(train_model, "no_sync")
            with contextlib.nullcontext() if sync else train_model.no_sync():
                with autocast():
                    logits = train_model(
                        mb["input_ids"], position_ids=mb["position_ids"], segment_ids=mb.get("segment_ids")
                    )
                ce_sum, _ = cross_entropy_sum(logits, mb["labels"], mb["loss_mask"])
                normalize(ce_sum, n_targets, world).backward()
            loss_sum += ce_sum.detach().double()
        loss = (all_reduce_sum(loss_sum) / max(n_targets, 1)).item()
        fail_once_for_tests(config.get("fault"), step, rank)
        if not math.isfinite(loss):
            raise FloatingPointError(
                f"loss is {loss} at step {step}: stopping; the last good checkpoint under "
                f"{cfg.run.storage_path}/{cfg.run.run_name} is intact (lower the lr or check the data)"
            )
        clip = cfg.optim.grad_clip if cfg.optim.grad_clip > 0 else float("inf")
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), clip).item()
        for opt in optimizers:
            opt.step()
        for opt in optimizers:
            opt.zero_grad(set_to_none=True)
        if device.type == "cuda":
            torch.cuda.synchronize()
        dt = time.perf_counter() - t0
        done = step + 1
        tokens_per_s = plan["total_batch_size"] / dt
        mfu = flops_per_step / dt / (peak * world) if peak else None
        smooth_loss = loss if smooth_loss is None else 0.9 * smooth_loss + 0.1 * loss
        is_last = done == stop
        stats = {
            "step": done,
            "loss": loss,
            "smooth_loss": smooth_loss,
            "lr": lr,
            "grad_norm": grad_norm,
            "tokens_per_s": tokens_per_s,
            "mfu": mfu,
            "data_wait_frac": t_data / dt,
        }
        if (cfg.train.eval.eval_every and done % cfg.train.eval.eval_every == 0) or is_last:
            stats.update(evaluate(done))
        if progress is not None:
            progress.update(1)
        if rank == 0:
            eta = (time.perf_counter() - t_start) / (done - start_step) * (n_iter - done)
            if done % cfg.train.logging.log_every == 0 or is_last or "val_bpb" in stats:
                log(
                    f"step {done:5d}/{n_iter} | loss {loss:.4f} | lr {lr:.3g} | grad_norm {grad_norm:.3f} | "
                    f"tok/s {tokens_per_s:,.0f} | mfu {f'{100 * mfu:.1f}%' if mfu else 'n/a'} | "
                    f"data wait {100 * t_data / dt:.1f}% | eta {eta:.0f}s"
                    + "".join(
                        f" | {k} {stats[k]:.4f}" for k in ("val_bpb", "calculator_accuracy") if k in stats
                    )
                )
            metrics.record(
                step=done,
                loss=loss,
                lr=lr,
                tokens_per_s=tokens_per_s,
                mfu=mfu,
                grad_norm=grad_norm,
                data_wait_frac=t_data / dt,
                bpb=stats.get("val_bpb"),
            )
            if log_path:
                with open(log_path, "a") as f:
                    f.write(json.dumps({k: v for k, v in stats.items() if k != "samples"}) + "\n")
        report = {k: v for k, v in stats.items() if v is not None}
        if (
            cfg.train.checkpoint.checkpoint_every and done % cfg.train.checkpoint.checkpoint_every == 0
        ) or is_last:
            save(done, report)
    if progress is not None:
        progress.close()
