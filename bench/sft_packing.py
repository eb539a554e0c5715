"""SFT: token efficiency of best-fit sample packing vs right padding, and SFT tokens/s vs pretraining tokens/s.

    python bench/sft_packing.py --out bench/results/sft_packing.md

Corpus and tokenizer: the default `raychat data prepare` output (debian-docs) and the 4096-token tokenizer
trained on it, built under --workdir unless given.

1. Efficiency: the SFT mixture of the CPU preset, raychat.tasks.registry.mixture_tasks(
   "calculator:4000,chatterbot,spelling:2000") in TaskMixture order (seed 0, as SFTRows), rendered with
   raychat.data.loader.sample_packing.render_samples at row length 257 (T = 256, the preset's seq_len), then
   compare_packing (best fit vs one sample per right-padded row) at buffers 16, 64 (SFTRows' value) and 256.
   token efficiency = real tokens / (rows x 257).
2. Throughput: on a private 2-CPU Ray cluster, a 5-step pretraining run makes the checkpoint; then, both from
   that checkpoint (the same model) with the CPU preset's batch (2 workers x 0.5 CPU, 8 rows x 256 tokens per
   micro-batch, 8192 tokens per step): a pretraining run and an SFT run (stage sft, document masking on, as
   `raychat sft` forces) of --steps steps each. Steady-state tokens/s (steps after --skip) from each run's
   metrics.jsonl; the loop counts tensor tokens (rows x T), so SFT's real and supervised tokens/s are that
   times the measured efficiency / target fraction.
"""

from __future__ import annotations

import argparse
import tempfile
import time
import uuid

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
from raychat.data.loader.sample_packing import SampleStats, compare_packing, render_samples
from raychat.tasks import TaskMixture
from raychat.tasks.registry import mixture_tasks
from raychat.tokenizer import Tokenizer
from raychat.train.pretrain import pretrain
from raychat.train.sft import sft

SPEC = "calculator:4000,chatterbot,spelling:2000"
ROW_LEN = 257
BUFFERS = (16, 64, 256)


def efficiency(tokenizer: Tokenizer) -> tuple[list[str], float, float]:
    mixture = TaskMixture(mixture_tasks(SPEC, "train", 0), seed=0)
    stats = SampleStats()
    items = list(
        render_samples(
            tokenizer, ((mixture[i]["id"], mixture[i]) for i in range(len(mixture))), ROW_LEN, stats
        )
    )
    lengths = sorted(len(x) for x in items)
    real = sum(lengths)
    targets = sum(x.num_targets for x in items)
    lines = [
        f"Mixture `{SPEC}`: {stats.samples:,} samples, {stats.truncated} truncated, {stats.dropped} dropped "
        f"{dict(stats.drop_reasons) or ''}; {real:,} tokens, {targets:,} supervised ({100 * targets / real:.1f}%); "
        f"sample length median {lengths[len(lengths) // 2]}, max {lengths[-1]} tokens.",
        "",
        "| packing | buffer | rows | tensor tokens | token efficiency |",
        "|---|---:|---:|---:|---:|",
    ]
    eff64 = None
    for b in BUFFERS:
        r = compare_packing(items, ROW_LEN, tokenizer.bos_id, buffer_size=b)
        if b == BUFFERS[0]:
            p = r["pad"]
            lines.append(
                f"| right padding (1 sample/row) | - | {p['rows']:,} | {p['tensor_tokens']:,} | "
                f"{100 * p['token_efficiency']:.1f}% |"
            )
        f = r["bestfit"]
        lines.append(
            f"| best fit | {b} | {f['rows']:,} | {f['tensor_tokens']:,} | {100 * f['token_efficiency']:.2f}% |"
        )
        if b == 64:
            eff64, pad = f["token_efficiency"], r["pad"]["token_efficiency"]
            rows64 = f["rows"]
    lines += [
        "",
        f"Best fit (buffer 64, as SFTRows) vs padding: **{100 * eff64:.2f}%** vs {100 * pad:.1f}% token efficiency "
        f"(goal >= 95%); {r['pad']['rows'] / rows64:.1f}x fewer rows.",
    ]
    return lines, eff64, targets / (rows64 * ROW_LEN)


def config(data_dir: str, tok_dir: str, storage: str, steps: int, **kw) -> TrainConfig:
    return from_dict(
        TrainConfig,
        dict(
            preset_values("cpu", "pretrain"),
            storage_path=storage,
            data_dir=data_dir,
            tokenizer_path=tok_dir,
            num_iterations=steps,
            eval_every=0,
            eval_tokens=4096,
            eval_examples=2,
            checkpoint_every=0,
            keep_checkpoints=1,
            log_every=10,
            max_failures=0,
            **kw,
        ),
    )


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=25, help="steps of each timed run")
    ap.add_argument("--skip", type=int, default=5, help="warmup steps left out")
    add_common_flags(ap)
    a = ap.parse_args()
    workdir = a.workdir or tempfile.mkdtemp(prefix="raychat-bench-")
    data_dir, tok_dir = corpus(workdir, a.data_dir, a.tokenizer)
    tokenizer = Tokenizer.load(tok_dir)
    load_before = uptime()
    eff_lines, eff, target_frac = efficiency(tokenizer)

    storage = f"{workdir}/runs"
    tag = uuid.uuid4().hex[:6]
    start_ray(2, workdir)
    init = pretrain(config(data_dir, tok_dir, storage, 5, run_name=f"sft-init-{tag}")).checkpoint.path
    runs = {
        "pretrain": config(data_dir, tok_dir, storage, a.steps, run_name=f"pt-{tag}", init_from=init),
        "sft": config(
            data_dir,
            tok_dir,
            storage,
            a.steps,
            run_name=f"sft-{tag}",
            init_from=init,
            stage="sft",
            document_masking=True,
        ),
    }
    tps, wait = {}, {}
    for name, cfg in runs.items():
        (sft if name == "sft" else pretrain)(cfg)
        m = read_metrics(storage, cfg.run.run_name)
        tps[name] = steady_tokens_per_s(
            [s["tokens_per_s"] for s in m], cfg.train.batch.total_batch_size, a.skip
        )
        wait[name] = sum(s["data_wait_frac"] for s in m[a.skip :]) / len(m[a.skip :])
    import ray

    ray.shutdown()
    load_after = uptime()
    lines = [
        f"## Run at {time.strftime('%Y-%m-%d %H:%M:%S')}",
        "",
        f"Command: `{command_line()}`",
        "",
        f"Machine: {machine()}. Load before: `{load_before}`; after: `{load_after}`.",
        "",
        *eff_lines,
        "",
        f"Throughput at T = 256 (row 257), 2 workers x 0.5 CPU, 8192 tensor tokens/step, steps {a.skip + 1}.."
        f"{a.steps}:",
        "",
        "| run | tensor tokens/s | vs pretraining | real tokens/s | supervised tokens/s | data wait |",
        "|---|---:|---:|---:|---:|---:|",
        f"| pretraining (continuous stream, causal) | {tps['pretrain']:,.0f} | 1.000x | {tps['pretrain']:,.0f} | "
        f"{tps['pretrain']:,.0f} | {100 * wait['pretrain']:.2f}% |",
        f"| SFT (packed samples, document mask) | {tps['sft']:,.0f} | {tps['sft'] / tps['pretrain']:.3f}x | "
        f"{tps['sft'] * eff:,.0f} | {tps['sft'] * target_frac:,.0f} | {100 * wait['sft']:.2f}% |",
        "",
        "real = tensor x best-fit efficiency (buffer 64); supervised = tensor x supervised tokens / tensor tokens "
        f"({100 * target_frac:.1f}%). In pretraining every tensor token is a real token.",
    ]
    text = "\n".join(lines)
    print(text)
    if a.out:
        append_result(a.out, text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
