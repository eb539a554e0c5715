"""Training tokens/s: a plain single-process PyTorch loop vs raychat on Ray Train (1 worker, then 2 workers).

    python bench/train_throughput.py --steps 12 --plain-steps 8 --skip 3 --out bench/results/train_throughput.md

The same model (GPT depth 4, seq_len 256, vocab 4096 from the real tokenizer), the same batch (8 rows x 256
tokens per micro-batch, 8192 tokens per optimizer step), the same optimizers (raychat.train.optim
.build_optimizers: Muon + AdamW) and learning-rate schedule, fp32, no compile, in five segments of one run:

    plain A -> ray x1 -> plain B -> ray x2 -> plain C

- plain: this process, torch.set_num_threads(2); rows pre-materialized in memory with BestFitPacker over the
  tokenized training shards in file order (the rows PretrainRows gives rank 0 of 1); each step does what
  raychat.train.loop does (to_batch, global_target_count, cross_entropy_sum / normalize, backward over 4
  micro-batches, clip, Muon + AdamW step), timed with time.perf_counter the same way (data included).
- ray x1: raychat.train.pretrain.run_training, 1 worker, cpus_per_worker=2 (the loop sets 2 torch threads),
  DDP over gloo, rows streamed by PretrainRows (Ray Data read + tokenize, 0.25 CPU per task).
- ray x2: 2 workers, cpus_per_worker=1 (1 torch thread each), 2 micro-batches each per step.
Ray gets 3 logical CPUs on the 2 cores: workers reserving 2 CPUs leave one for the Ray Data tasks (with 2
logical CPUs the data tasks could never be scheduled and the run would hang).

The machine is shared, so the plain loop runs before and after each Ray run and each Ray run is compared with
the mean of the two plain segments around it (load drift then hits both sides).
tokens/s = steady state: the steps after the first --skip, total tokens / total step time; Ray runs read the
per-step tokens_per_s from <storage>/<run_name>/metrics.jsonl (written by raychat.train.loop).
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
import uuid

import numpy as np
import pyarrow.parquet as pq
import torch
from _common import (
    add_common_flags,
    append_result,
    command_line,
    corpus,
    machine,
    read_metrics,
    start_ray,
    steady_tokens_per_s,
    uptime,
)

from raychat.config import TrainConfig, from_dict
from raychat.data.packing import BestFitPacker
from raychat.data.shards import list_shards
from raychat.loss import cross_entropy_sum, global_target_count, normalize
from raychat.model import GPT, ModelConfig
from raychat.tokenizer import Tokenizer
from raychat.train.optim import build_optimizers, lr_multiplier, set_lr
from raychat.train.plan import make_plan
from raychat.train.pretrain import pretrain
from raychat.train.trainer import to_batch


def base_config(args, data_dir: str, tokenizer_dir: str, storage: str) -> TrainConfig:
    return from_dict(
        TrainConfig,
        dict(
            storage_path=storage,
            data_dir=data_dir,
            tokenizer_path=tokenizer_dir,
            depth=4,
            seq_len=256,
            device_batch_size=8,
            total_batch_size=8192,
            num_iterations=args.steps,
            eval_every=0,
            eval_tokens=4096,
            checkpoint_every=0,
            keep_checkpoints=1,
            log_every=10,
            max_failures=0,
            num_workers=1,
            cpus_per_worker=2,
        ),
    )


def pretrain_rows(data_dir: str, tokenizer: Tokenizer, n: int, seq_len: int, buffer_size: int) -> np.ndarray:
    train_files, _ = list_shards(data_dir)
    texts = (t for f in train_files for t in pq.read_table(f, columns=["text"]).column("text").to_pylist())

    def next_document():
        text = next(texts, None)
        return None if text is None else tokenizer.encode_batch([text], prepend_bos=True)[0]

    packer = BestFitPacker(next_document, seq_len + 1, buffer_size)
    return np.stack([packer.next_row() for _ in range(n)])


def plain_loop(cfg: TrainConfig, tokenizer: Tokenizer, threads: int, steps: int) -> list[float]:
    """Per-step tokens/s of the single-process loop (same step as raychat.train.loop, without Ray or DDP)."""
    torch.set_num_threads(threads)
    rows_per = cfg.train.batch.device_batch_size
    p = make_plan(cfg, tokenizer.vocab_size)
    accum, n_iter = p.grad_accum, p.num_iterations
    rows = pretrain_rows(
        cfg.data.data_dir, tokenizer, n_iter * accum * rows_per, cfg.model.seq_len, cfg.data.buffer_size
    )
    torch.manual_seed(cfg.run.seed)
    model = GPT(ModelConfig(**p.model_config)).init_weights(cfg.run.seed)
    optimizers = build_optimizers(model, cfg.optim)
    sched = cfg.train.schedule
    device = torch.device("cpu")
    rates = []
    for step in range(steps):
        t0 = time.perf_counter()
        base = step * accum * rows_per
        micro = [
            to_batch(
                {"input_ids": rows[base + i * rows_per : base + (i + 1) * rows_per]},
                tokenizer.bos_id,
                False,
                device,
            )
            for i in range(accum)
        ]
        n_targets = global_target_count(mb["loss_mask"] for mb in micro)
        set_lr(
            optimizers,
            lr_multiplier(step, n_iter, sched.warmup_ratio, sched.warmdown_ratio, sched.final_lr_frac),
        )
        loss_sum = torch.zeros((), dtype=torch.float64)
        for mb in micro:
            logits = model(mb["input_ids"], position_ids=mb["position_ids"], segment_ids=None)
            ce_sum, _ = cross_entropy_sum(logits, mb["labels"], mb["loss_mask"])
            normalize(ce_sum, n_targets, 1).backward()
            loss_sum += ce_sum.detach().double()
        loss = (loss_sum / max(n_targets, 1)).item()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.optim.grad_clip).item()
        for opt in optimizers:
            opt.step()
        for opt in optimizers:
            opt.zero_grad(set_to_none=True)
        rates.append(p.total_batch_size / (time.perf_counter() - t0))
        if (step + 1) % 10 == 0:
            print(f"plain step {step + 1}/{n_iter} loss {loss:.4f} tok/s {rates[-1]:,.0f}", flush=True)
    return rates


def ray_run(cfg: TrainConfig, workers: int, cpus: float) -> list[dict]:
    name = f"tput-x{workers}-{uuid.uuid4().hex[:6]}"
    cfg = from_dict(TrainConfig, dict(run_name=name, num_workers=workers, cpus_per_worker=cpus), base=cfg)
    pretrain(cfg)
    return read_metrics(cfg.run.storage_path, cfg.run.run_name)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=25, help="optimizer steps of each Ray run")
    ap.add_argument("--plain-steps", type=int, default=15, help="optimizer steps of each plain segment")
    ap.add_argument("--skip", type=int, default=3, help="warmup steps left out of the steady-state rate")
    ap.add_argument(
        "--threads", type=int, default=2, help="torch threads of the plain loop (= ray x1 worker)"
    )
    add_common_flags(ap)
    a = ap.parse_args()
    workdir = a.workdir or tempfile.mkdtemp(prefix="raychat-bench-")
    data_dir, tok_dir = corpus(workdir, a.data_dir, a.tokenizer)
    tokenizer = Tokenizer.load(tok_dir)
    cfg = base_config(a, data_dir, tok_dir, f"{workdir}/runs")
    segments = []  # (name, setup, per-step tokens/s, data wait or None, wall s, load before, load after)

    def segment(name, setup, fn):
        load0 = os.getloadavg()[0]
        t0 = time.perf_counter()
        rates, wait = fn()
        segments.append((name, setup, rates, wait, time.perf_counter() - t0, load0, os.getloadavg()[0]))
        print(f"{name}: {steady_tokens_per_s(rates, 8192, a.skip):,.0f} tokens/s", flush=True)

    def plain():
        return plain_loop(cfg, tokenizer, a.threads, a.plain_steps), None

    def ray(workers, cpus):
        def fn():
            m = ray_run(cfg, workers, cpus)
            return [s["tokens_per_s"] for s in m], float(np.mean([s["data_wait_frac"] for s in m[a.skip :]]))

        return fn

    load_before = uptime()
    segment("plain A", "1 process, 2 torch threads", plain)
    start_ray(3, workdir)
    segment("ray x1", "1 worker x 2 CPUs", ray(1, 2))
    segment("plain B", "1 process, 2 torch threads", plain)
    segment("ray x2", "2 workers x 1 CPU", ray(2, 1))
    segment("plain C", "1 process, 2 torch threads", plain)
    load_after = uptime()

    tps = {name: steady_tokens_per_s(rates, 8192, a.skip) for name, _, rates, *_ in segments}
    ref = {
        "ray x1": (tps["plain A"] + tps["plain B"]) / 2,
        "ray x2": (tps["plain B"] + tps["plain C"]) / 2,
    }
    lines = [
        f"## Run at {time.strftime('%Y-%m-%d %H:%M:%S')}",
        "",
        f"Command: `{command_line()}`",
        "",
        f"Machine: {machine()}. Load before: `{load_before}`; after: `{load_after}`.",
        f"Ray runs: {a.steps} steps, plain segments: {a.plain_steps} steps, 8192 tokens a step; tokens/s over the "
        f"steps after the first {a.skip}.",
        "",
        "| segment | setup | steady tokens/s | vs plain around it | data wait (mean) | wall | 1-min load before/after |",
        "|---|---|---:|---:|---:|---:|---|",
    ]
    for name, setup, _, wait, wall, l0, l1 in segments:
        rel = f"{tps[name] / ref[name]:.3f}x" if name in ref else "-"
        w = "n/a (in memory)" if wait is None else f"{100 * wait:.2f}%"
        lines.append(
            f"| {name} | {setup} | {tps[name]:,.0f} | {rel} | {w} | {wall:.0f} s | {l0:.2f} / {l1:.2f} |"
        )
    lines += [
        "",
        f"Ray + DDP overhead with one worker: **{100 * (1 - tps['ray x1'] / ref['ray x1']):.1f}%** (goal <= 10%). "
        f"Two workers x 1 CPU vs one worker x 2 CPUs: {tps['ray x2'] / tps['ray x1']:.2f}x; vs plain: "
        f"{tps['ray x2'] / ref['ray x2']:.2f}x. Ray wall times include cluster/worker start, the final "
        "validation and the checkpoint.",
    ]
    text = "\n".join(lines)
    print(text)
    if a.out:
        append_result(a.out, text)
    import ray

    ray.shutdown()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
