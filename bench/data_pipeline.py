"""Pretraining data pipeline: tokens/s produced vs consumed, the trainer's data wait, best-fit crop fraction.

    python bench/data_pipeline.py --out bench/results/data_pipeline.md

Corpus: the default `raychat data prepare` output (source debian-docs: Python 3.11 docs split at section
headings + WordNet glosses, 7 train shards + 1 validation shard) and a 4096-token tokenizer trained on it
(raychat.tokenizer_cli.train_tokenizer), built under --workdir unless given.

1. produced: raychat.data.loader.pipeline.PretrainRows alone (rank 0 of 1: all 7 train shards; Ray Data read +
   tokenize at 0.25 CPU per task as in the trainer; best-fit buffer 256; rows of T+1 = 257) on a private
   2-CPU Ray cluster, one epoch from a cold start: document tokens tokenized per second and row tokens
   (rows x 257) per second over the whole wall time, and the time to the first row.
2. consumed: a Ray Train pretraining run with the CPU speedrun's settings (jobs/presets/cpu.yaml: depth 4,
   seq 256, 2 workers x 0.5 CPU, 8 rows per micro-batch, 8192 tokens per step) for --steps steps; steady-state
   tokens/s (steps after --skip) and data_wait_frac (time in rows.next_batch + to_batch / step time) from the
   metrics.jsonl that raychat.metrics_sink writes.
3. crop fraction of raychat.data.loader.packing.BestFitPacker over the whole tokenized training corpus (file order,
   BOS-prefixed documents, one pass) at T = 256, 512, 1024, 2048 and buffers of 16, 64, 256, 1024 documents:
   cropped tokens / consumed tokens.
"""

from __future__ import annotations

import argparse
import tempfile
import time
import uuid

import numpy as np
import pyarrow.parquet as pq
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

from raychat.config import TrainConfig, from_dict, preset_values
from raychat.data.corpus.shards import list_shards
from raychat.data.loader.packing import BestFitPacker
from raychat.data.loader.pipeline import PretrainRows
from raychat.tokenizer import Tokenizer
from raychat.train.pretrain import pretrain

SEQ_LENS = (256, 512, 1024, 2048)
BUFFERS = (16, 64, 256, 1024)


def produced(data_dir: str, tok_dir: str) -> dict:
    """One epoch of PretrainRows from a cold start: construction (the Ray Data pipeline starts on the first
    row) until the packer has pulled every training document (the next refill would start epoch 2).
    Ray Data reads and tokenizes ahead in the background, so the rate after the first row only measures the
    packer; the honest producer rate is the epoch's document tokens over the whole wall time."""
    train_files, _ = list_shards(data_dir)
    total_docs = sum(pq.ParquetFile(f).metadata.num_rows for f in train_files)
    t0 = time.perf_counter()
    source = PretrainRows(train_files, tok_dir, 257, 0, 1, 256, num_cpus=0.25)
    source.next_batch(1)
    first = time.perf_counter() - t0
    n = 1
    while source.packer.stats.documents < total_docs:
        source.next_batch(1)
        n += 1
    seconds = time.perf_counter() - t0
    source.close()  # before ray.shutdown(): see PretrainRows.close
    buffered = sum(len(piece) for piece in source.packer.buffered())
    doc_tokens = source.packer.stats.consumed + buffered
    return {
        "first_row_s": first,
        "rows": n,
        "documents": total_docs,
        "doc_tokens": doc_tokens,
        "seconds": seconds,
        "tokens_per_s": n * 257 / seconds,
        "doc_tokens_per_s": doc_tokens / seconds,
    }


def consumed(data_dir: str, tok_dir: str, storage: str, steps: int, skip: int) -> dict:
    cfg = from_dict(
        TrainConfig,
        dict(
            preset_values("cpu", "pretrain"),
            run_name=f"data-consumer-{uuid.uuid4().hex[:6]}",
            storage_path=storage,
            data_dir=data_dir,
            tokenizer_path=tok_dir,
            num_iterations=steps,
            eval_every=0,
            eval_tokens=4096,
            checkpoint_every=0,
            keep_checkpoints=1,
            log_every=10,
            max_failures=0,
        ),
    )
    pretrain(cfg)
    m = read_metrics(storage, cfg.run.run_name)[skip:]
    waits = np.array([s["data_wait_frac"] for s in m])
    return {
        "workers": cfg.layout.num_workers,
        "cpus_per_worker": cfg.layout.cpus_per_worker,
        "tokens_per_step": cfg.train.batch.total_batch_size,
        "tokens_per_s": steady_tokens_per_s(
            [s["tokens_per_s"] for s in m], cfg.train.batch.total_batch_size, 0
        ),
        "wait_mean": float(waits.mean()),
        "wait_median": float(np.median(waits)),
        "wait_max": float(waits.max()),
        "steps": len(m),
    }


def crop_table(data_dir: str, tokenizer: Tokenizer) -> tuple[list[str], dict]:
    train_files, _ = list_shards(data_dir)
    texts = [t for f in train_files for t in pq.read_table(f, columns=["text"]).column("text").to_pylist()]
    docs = [
        np.asarray(d, dtype=np.int32) for d in tokenizer.encode_batch(texts, prepend_bos=True, num_threads=2)
    ]
    lengths = np.array([len(d) for d in docs])
    total = int(lengths.sum())
    lines = [
        f"Training corpus: {len(docs):,} documents, {total:,} tokens (BOS included); document length in tokens: "
        f"median {int(np.median(lengths))}, p90 {int(np.percentile(lengths, 90))}, p99 "
        f"{int(np.percentile(lengths, 99))}, max {int(lengths.max())}.",
        "",
        "| T | docs longer than T+1 | their share of tokens | "
        + " | ".join(f"crop, buffer {b}" for b in BUFFERS)
        + " |",
        "|---:|---:|---:|" + "---:|" * len(BUFFERS),
    ]
    crops = {}
    for t in SEQ_LENS:
        long = lengths > t + 1
        cells = []
        for b in BUFFERS:
            it = iter(docs)
            packer = BestFitPacker(lambda it=it: next(it, None), t + 1, b)
            for _ in packer:
                pass
            crops[(t, b)] = packer.stats.drop_fraction
            cells.append(f"{100 * packer.stats.drop_fraction:.1f}%")
        lines.append(
            f"| {t} | {100 * long.mean():.1f}% | {100 * lengths[long].sum() / total:.1f}% | "
            + " | ".join(cells)
            + " |"
        )
    return lines, crops


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=30, help="training steps of the consumer run")
    ap.add_argument("--skip", type=int, default=5, help="warmup steps left out")
    add_common_flags(ap)
    a = ap.parse_args()
    workdir = a.workdir or tempfile.mkdtemp(prefix="raychat-bench-")
    data_dir, tok_dir = corpus(workdir, a.data_dir, a.tokenizer)
    tokenizer = Tokenizer.load(tok_dir)
    load_before = uptime()

    start_ray(2, workdir)
    prod = produced(data_dir, tok_dir)
    cons = consumed(data_dir, tok_dir, f"{workdir}/runs", a.steps, a.skip)
    import ray

    ray.shutdown()
    load_mid = uptime()
    crop_lines, _ = crop_table(data_dir, tokenizer)
    load_after = uptime()

    per_rank = cons["tokens_per_s"] / cons["workers"]
    lines = [
        f"## Run at {time.strftime('%Y-%m-%d %H:%M:%S')}",
        "",
        f"Command: `{command_line()}`",
        "",
        f"Machine: {machine()}. Load before: `{load_before}`; after the Ray parts: `{load_mid}`; "
        f"at the end: `{load_after}`.",
        "",
        "| | tokens/s | notes |",
        "|---|---:|---|",
        f"| produced: PretrainRows alone, documents tokenized (1 pipeline, whole machine, cold start) | "
        f"{prod['doc_tokens_per_s']:,.0f} | one epoch: {prod['documents']:,} documents, {prod['doc_tokens']:,} tokens "
        f"in {prod['seconds']:.1f} s (first row after {prod['first_row_s']:.1f} s) |",
        f"| produced: the same, as row tokens (after best-fit cropping) | {prod['tokens_per_s']:,.0f} | "
        f"{prod['rows']:,} rows of 257 |",
        f"| consumed: trainer, all ranks (cpu preset, {cons['workers']} workers x {cons['cpus_per_worker']} CPU) "
        f"| {cons['tokens_per_s']:,.0f} | steady state over {cons['steps']} steps of {cons['tokens_per_step']} |",
        f"| consumed per rank (each rank runs its own pipeline) | {per_rank:,.0f} | |",
        "",
        f"Producer (row tokens) / per-rank consumer: **{prod['tokens_per_s'] / per_rank:.1f}x** (one pipeline alone; "
        "in training each rank's pipeline shares the 2 cores with both trainers).",
        "",
        f"Trainer data wait (fraction of step time in rows.next_batch + to_batch): mean "
        f"**{100 * cons['wait_mean']:.2f}%**, median {100 * cons['wait_median']:.2f}%, max "
        f"{100 * cons['wait_max']:.2f}% (goal < 2%).",
        "",
        "Best-fit crop fraction (cropped tokens / consumed tokens, one pass over the training shards):",
        "",
        *crop_lines,
    ]
    text = "\n".join(lines)
    print(text)
    if a.out:
        append_result(a.out, text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
