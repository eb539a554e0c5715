"""Training tokens/s: `raychat pretrain` on Ray Train in several CPU layouts vs a plain single-process loop.

    python bench/train_throughput.py --layouts 1x2,2x1,1x2c --steps 12 --plain-steps 8 --skip 3 \
        --out bench/results/train_throughput.md

The same model (GPT depth 4, seq_len 256, vocab 4096 from the real tokenizer) and batch (8 rows x 256 tokens
per micro-batch, 8192 tokens per optimizer step), fp32, in one run of alternating segments:

    plain A -> ray <layout 1> -> plain B -> ray <layout 2> -> plain C -> ...

- plain: this process, torch.set_num_threads(--threads); rows pre-materialized in memory with BestFitPacker
  over the tokenized training shards in file order (the rows PretrainRows gives rank 0 of 1); each step does
  what raychat.train.trainer does (to_batch, global_target_count, cross_entropy_sum / normalize, backward
  over the micro-batches, clip, optimizer step), timed with time.perf_counter the same way (data included).
  --plain-optimizer adamw (the default, issue 15's baseline): one AdamW over every parameter, so the ratio
  shows what Ray, DDP, the data pipeline and Muon cost together; muon: build_optimizers' Muon + AdamW.
- ray WxC: raychat.train.pretrain.pretrain with W workers x C CPUs each (C torch threads), DDP over gloo,
  rows streamed by PretrainRows (Ray Data read + tokenize), Muon + AdamW from build_optimizers with
  ns_dtype auto; a trailing "c" adds --compile (torch.compile of the model on every worker).
Ray gets the local layout of raychat.train.layout: the cores plus one logical CPU for Ray Data, so a
worker may reserve every core.

The machine is shared, so each Ray run is compared with the mean of the two plain segments around it (load
drift then hits both sides). tokens/s = steady state: the steps after the first --skip, total tokens /
total step time; Ray runs read the per-step tokens_per_s from <storage>/<run_name>/metrics.jsonl. "first
step" is step 1's time (with torch.compile: compilation included); "break-even steps" of a compiled layout
= its extra first-step seconds / the seconds it saves per later step against the same layout uncompiled.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
import uuid

import numpy as np
import pyarrow.parquet as pq
import ray
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
from raychat.data.corpus.shards import list_shards
from raychat.data.loader.packing import BestFitPacker
from raychat.loss import cross_entropy_sum, global_target_count, normalize
from raychat.model import GPT, ModelConfig
from raychat.tokenizer import Tokenizer
from raychat.train.layout import local_cluster_cpus
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


def pretrain_rows(data_dir: str, tokenizer: Tokenizer, n: int, row_len: int, buffer_size: int) -> np.ndarray:
    train_files, _ = list_shards(data_dir)
    texts = (t for f in train_files for t in pq.read_table(f, columns=["text"]).column("text").to_pylist())

    def next_document():
        text = next(texts, None)
        return None if text is None else tokenizer.encode_batch([text], prepend_bos=True)[0]

    packer = BestFitPacker(next_document, row_len, buffer_size)
    return np.stack([packer.next_row() for _ in range(n)])


def plain_optimizers(model: GPT, cfg: TrainConfig, kind: str) -> list[torch.optim.Optimizer]:
    """ "adamw": one AdamW over every parameter (the embedding's lr for all); "muon": build_optimizers."""
    if kind == "muon":
        return build_optimizers(model, cfg.optim)
    adamw = torch.optim.AdamW(model.parameters(), lr=cfg.optim.unembedding_lr, betas=(0.8, 0.95), eps=1e-10)
    for group in adamw.param_groups:
        group["initial_lr"] = group["lr"]
    return [adamw]


def plain_loop(cfg: TrainConfig, tokenizer: Tokenizer, threads: int, steps: int, kind: str) -> list[float]:
    """Per-step tokens/s of the single-process loop (raychat.train.trainer's step without Ray or DDP)."""
    torch.set_num_threads(threads)
    rows_per = cfg.train.batch.device_batch_size
    p = make_plan(cfg, tokenizer.vocab_size)
    accum, n_iter = p.grad_accum, p.num_iterations
    rows = pretrain_rows(
        cfg.data.data_dir, tokenizer, n_iter * accum * rows_per, cfg.model.seq_len + 1, cfg.data.buffer_size
    )
    torch.manual_seed(cfg.run.seed)
    model = GPT(ModelConfig(**p.model_config)).init_weights(cfg.run.seed)
    optimizers = plain_optimizers(model, cfg, kind)
    sched = cfg.train.lr_schedule
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


def parse_layout(spec: str) -> tuple[int, float, bool]:
    """ "2x1" -> (2 workers, 1 CPU each, no compile); "1x2c" -> (1, 2.0, compile)."""
    compiled = spec.endswith("c")
    workers, cpus = spec.removesuffix("c").split("x")
    return int(workers), float(cpus), compiled


def ray_run(cfg: TrainConfig, workers: int, cpus: float, compiled: bool) -> list[dict]:
    name = f"tput-{workers}x{cpus:g}{'c' if compiled else ''}-{uuid.uuid4().hex[:6]}"
    values = dict(run_name=name, num_workers=workers, cpus_per_worker=cpus, compile=compiled)
    cfg = from_dict(TrainConfig, values, base=cfg)
    pretrain(cfg)
    return read_metrics(cfg.run.storage_path, cfg.run.run_name)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layouts", default="1x2,2x1", help="Ray layouts WxC[c], comma-separated (c = compile)")
    ap.add_argument("--steps", type=int, default=25, help="optimizer steps of each Ray run")
    ap.add_argument("--plain-steps", type=int, default=15, help="optimizer steps of each plain segment")
    ap.add_argument("--skip", type=int, default=3, help="warmup steps left out of the steady-state rate")
    ap.add_argument("--threads", type=int, default=2, help="torch threads of the plain loop")
    ap.add_argument("--plain-optimizer", choices=("adamw", "muon"), default="adamw", help="the plain loop's")
    add_common_flags(ap)
    a = ap.parse_args()
    layouts = [parse_layout(x) for x in a.layouts.split(",")]
    workdir = a.workdir or tempfile.mkdtemp(prefix="raychat-bench-")
    data_dir, tok_dir = corpus(workdir, a.data_dir, a.tokenizer)
    tokenizer = Tokenizer.load(tok_dir)
    cfg = base_config(a, data_dir, tok_dir, f"{workdir}/runs")
    segments = []  # dicts: name, setup, rates, wait, first, wall, load0, load1

    def segment(name, setup, fn):
        load0, t0 = os.getloadavg()[0], time.perf_counter()
        rates, wait = fn()
        wall, load1 = time.perf_counter() - t0, os.getloadavg()[0]
        segments.append(
            dict(name=name, setup=setup, rates=rates, wait=wait, wall=wall, load0=load0, load1=load1)
        )
        print(f"{name}: {steady_tokens_per_s(rates, 8192, a.skip):,.0f} tokens/s", flush=True)

    plain_setup = f"1 process, {a.threads} torch threads, {a.plain_optimizer}"

    def plain():
        return plain_loop(cfg, tokenizer, a.threads, a.plain_steps, a.plain_optimizer), None

    def ray_segment(workers, cpus, compiled):
        def fn():
            m = ray_run(cfg, workers, cpus, compiled)
            return [s["tokens_per_s"] for s in m], float(np.mean([s["data_wait_frac"] for s in m[a.skip :]]))

        return fn

    load_before = uptime()
    start_ray(local_cluster_cpus(), workdir)
    plains = "ABCDEFGH"
    segment(f"plain {plains[0]}", plain_setup, plain)
    for i, (workers, cpus, compiled) in enumerate(layouts):
        spec = f"{workers}x{cpus:g}{'c' if compiled else ''}"
        setup = f"{workers} worker(s) x {cpus:g} CPU{', torch.compile' if compiled else ''}, Muon + AdamW"
        segment(f"ray {spec}", setup, ray_segment(workers, cpus, compiled))
        segment(f"plain {plains[i + 1]}", plain_setup, plain)
    load_after = uptime()

    for s in segments:
        s["tps"] = steady_tokens_per_s(s["rates"], 8192, a.skip)
        s["first"] = 8192 / s["rates"][0]
    for i in range(1, len(segments), 2):
        segments[i]["ref"] = (segments[i - 1]["tps"] + segments[i + 1]["tps"]) / 2
    lines = [
        f"## Run at {time.strftime('%Y-%m-%d %H:%M:%S')}",
        "",
        f"Command: `{command_line()}`",
        "",
        f"Machine: {machine()}; Ray cluster: {local_cluster_cpus()} logical CPUs. Load before: `{load_before}`; "
        f"after: `{load_after}`.",
        f"Ray runs: {a.steps} steps, plain segments: {a.plain_steps} steps, 8192 tokens a step; tokens/s over the "
        f"steps after the first {a.skip}.",
        "",
        "| segment | setup | steady tokens/s | vs plain around it | first step | data wait (mean) | wall "
        "| 1-min load before/after |",
        "|---|---|---:|---:|---:|---:|---:|---|",
    ]
    for s in segments:
        rel = f"{s['tps'] / s['ref']:.3f}x" if "ref" in s else "-"
        w = "n/a (in memory)" if s["wait"] is None else f"{100 * s['wait']:.2f}%"
        lines.append(
            f"| {s['name']} | {s['setup']} | {s['tps']:,.0f} | {rel} | {s['first']:.1f} s | {w} | {s['wall']:.0f} s "
            f"| {s['load0']:.2f} / {s['load1']:.2f} |"
        )
    by_name = {s["name"]: s for s in segments}
    notes = []
    for s in segments:
        if s["name"].endswith("c") and s["name"][:-1] in by_name:
            eager = by_name[s["name"][:-1]]
            saved = 8192 / eager["tps"] - 8192 / s["tps"]
            extra = s["first"] - eager["first"]
            notes.append(
                f"{s['name']} vs {eager['name']}: {s['tps'] / eager['tps']:.2f}x steady tokens/s, first step "
                f"+{extra:.0f} s, saves {saved:.2f} s a step: "
                + (f"break-even after {extra / saved:.0f} steps." if saved > 0 else "never breaks even.")
            )
    lines += ["", *notes, "Ray wall times include worker start, the final validation and the checkpoint."]
    text = "\n".join(lines)
    print(text)
    if a.out:
        append_result(a.out, text)
    ray.shutdown()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
