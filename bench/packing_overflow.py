"""Pretraining packing overflow policy: crop vs split, at T=256 and T=2048 on the speedrun corpus.

    python bench/packing_overflow.py --steps 40 --workdir /tmp/h16-bench --out bench/results/packing_overflow.md

Corpus: the default `raychat data prepare` output (debian-docs, 7 train shards + validation) and a
4096-token tokenizer trained on it (bench/_common.corpus).

1. Fractions, one pass over the tokenized training shards in file order (raychat.data.loader.packing.BestFitPacker,
   buffer 256 as the cpu preset, min_fragment 32): of the document tokens that left the buffer, the share
   discarded (crop: cropped tails; split: tails shorter than min_fragment) and the inserted BOS tokens per
   row token (split's overhead), and the rows an epoch gives.
2. Training: `raychat pretrain` (raychat.train.launch.run_training with the Pretraining stage, replay
   records on) with the cpu preset's model (depth 4) and 8192 tokens per step for --steps steps, the SAME
   tokens trained for every cell, on a private 2-CPU Ray cluster (2 workers x 0.5 CPU). At the end, the
   validation BPB on two fixed row sets of the validation shard (65,536 tokens each, the same for both
   policies at a given T): "crop rows" (the trainer's val_bpb: long documents seen from their start only)
   and "split rows" (every token of the documents, tails after an inserted BOS).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
import uuid

import numpy as np
import pyarrow.parquet as pq
import ray
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
from raychat.data.loader.pipeline import validation_rows
from raychat.tokenizer import Tokenizer
from raychat.train.launch import run_training
from raychat.train.pretrain import Pretraining
from raychat.train.replay_recorder import ReplayRecorder
from raychat.train.validators import BPBValidator

POLICIES = ("crop", "split")
TOKENS_PER_STEP = 8192


def fractions(docs: list[np.ndarray], row_len: int, overflow: str) -> dict:
    it = iter(docs)
    packer = BestFitPacker(lambda: next(it, None), row_len, 256, overflow, min_fragment=32)
    rows = sum(1 for _ in packer)
    s = packer.stats
    return {"rows": rows, "drop": s.drop_fraction, "bos": s.bos_fraction, "short_tails": s.short_tails}


class SplitRowsToo(Pretraining):
    """The Pretraining stage plus a second validation BPB on split-packed rows ("val_bpb_split")."""

    def validators(self, cfg, tokenizer, rank, world, device, autocast):
        _, val_file = list_shards(cfg.data.data_dir)
        rows = validation_rows(
            val_file, tokenizer, cfg.model.seq_len + 1, cfg.train.eval.eval_tokens,
            overflow="split",
        )  # fmt: skip
        rows = {k: v[rank::world] for k, v in rows.items()}
        split = BPBValidator(
            "val_bpb_split", rows, tokenizer, cfg.train.batch.device_batch_size, cfg.model.document_masking,
            device, autocast,
        )  # fmt: skip
        return [*super().validators(cfg, tokenizer, rank, world, device, autocast), split]


ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])  # the workers cannot import bench/


def train(data_dir: str, tok_dir: str, storage: str, seq_len: int, overflow: str, steps: int) -> dict:
    rows_per_micro = TOKENS_PER_STEP // 2 // seq_len if seq_len >= 2048 else 8
    cfg = from_dict(
        TrainConfig,
        dict(
            preset_values("cpu", "pretrain"),
            run_name=f"overflow-{overflow}-{seq_len}-{uuid.uuid4().hex[:6]}",
            storage_path=storage, data_dir=data_dir, tokenizer_path=tok_dir,
            seq_len=seq_len, device_batch_size=rows_per_micro, total_batch_size=TOKENS_PER_STEP,
            num_iterations=steps, overflow=overflow, eval_every=0, checkpoint_every=0,
            keep_checkpoints=1, log_every=10, max_failures=0, sample_every=0,
        ),
    )  # fmt: skip
    t0 = time.perf_counter()
    result = run_training(cfg, SplitRowsToo(), [ReplayRecorder()])
    m = read_metrics(storage, cfg.run.run_name)
    return {
        "val_bpb": result.metrics["val_bpb"],
        "val_bpb_split": result.metrics["val_bpb_split"],
        "loss": m[-1]["loss"],
        "tokens_per_s": steady_tokens_per_s([s["tokens_per_s"] for s in m], TOKENS_PER_STEP, 2),
        "data_wait": float(np.mean([s["data_wait_frac"] for s in m[2:]])),
        "seconds": time.perf_counter() - t0,
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=40, help="optimizer steps of 8192 tokens per training run")
    ap.add_argument("--seq-lens", default="256,2048", help="comma-separated T values (default 256,2048)")
    add_common_flags(ap)
    a = ap.parse_args()
    seq_lens = [int(t) for t in a.seq_lens.split(",")]
    workdir = a.workdir or tempfile.mkdtemp(prefix="raychat-bench-")
    data_dir, tok_dir = corpus(workdir, a.data_dir, a.tokenizer)
    tokenizer = Tokenizer.load(tok_dir)
    train_files, _ = list_shards(data_dir)
    texts = [t for f in train_files for t in pq.read_table(f, columns=["text"]).column("text").to_pylist()]
    docs = [np.asarray(d, np.int32) for d in tokenizer.encode_batch(texts, prepend_bos=True, num_threads=2)]
    total = sum(map(len, docs))
    load_before = uptime()
    packed = {(t, p): fractions(docs, t + 1, p) for t in seq_lens for p in POLICIES}

    start_ray(2, f"{workdir}/{'-'.join(map(str, seq_lens))}")
    trained = {}
    for t in seq_lens:
        for p in POLICIES:
            trained[(t, p)] = train(data_dir, tok_dir, f"{workdir}/runs", t, p, a.steps)
            print((t, p), trained[(t, p)], flush=True)
    ray.shutdown()
    load_after = uptime()

    lines = [
        f"## Run at {time.strftime('%Y-%m-%d %H:%M:%S')}",
        "",
        f"Command: `{command_line()}`",
        "",
        f"Machine: {machine()}. Load before: `{load_before}`; after: `{load_after}`.",
        f"Training corpus: {len(docs):,} documents, {total:,} tokens (BOS included). Every run trained "
        f"{a.steps} steps x {TOKENS_PER_STEP:,} = {a.steps * TOKENS_PER_STEP:,} tokens (depth 4, 2 workers).",
        "",
        "| T | policy | discarded / document tokens | inserted BOS / row tokens | rows per epoch | "
        "val BPB (crop rows) | val BPB (split rows) | final train loss | tokens/s | data wait |",
        "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for (t, p), f in packed.items():
        r = trained[(t, p)]
        lines.append(
            f"| {t} | {p} | {100 * f['drop']:.1f}% | {100 * f['bos']:.2f}% | {f['rows']:,} | "
            f"{r['val_bpb']:.4f} | {r['val_bpb_split']:.4f} | {r['loss']:.4f} | {r['tokens_per_s']:,.0f} | "
            f"{100 * r['data_wait']:.2f}% |"
        )
    for t in seq_lens:
        c, s = trained[(t, "crop")], trained[(t, "split")]
        lines.append(
            f"\nT={t}: split / crop val BPB = {s['val_bpb'] / c['val_bpb']:.4f} (crop rows), "
            f"{s['val_bpb_split'] / c['val_bpb_split']:.4f} (split rows); epoch rows split / crop = "
            f"{packed[(t, 'split')]['rows'] / packed[(t, 'crop')]['rows']:.2f}x"
        )
    text = "\n".join(lines)
    print(text)
    if a.out:
        append_result(a.out, text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
