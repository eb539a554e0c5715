"""GPU check for issue 15 (prepared on a CPU machine; run it where a GPU is lent, under 8 minutes):

    RAY_TMPDIR=/tmp/ray-muon-gpu python bench/muon_gpu.py --out bench/results/muon_gpu.md

1. Muon step time at depth 12 on one GPU (width 768, 12 heads of 64, SwiGLU 2048: 84 hidden matrices):
   torch.optim.Muon (bf16 Newton-Schulz) vs raychat.train.muon.Muon in bf16 and in fp32, each unsharded
   and sharded on a 1-process group (nccl: the packing + all_gather overhead that sharding adds at world
   size 1), beside one forward+backward of a micro-batch (--rows x --seq-len tokens, bf16 autocast) so the
   optimizer's share is visible. Gradients are fixed random matrices (Muon's cost does not depend on
   their values); median of --steps timed steps after 3 warm-up steps, torch.cuda.synchronize around each.
   Also printed: what choose_ns_dtype("auto") picks on this GPU.
2. MFU of 50 pretraining steps with torch.compile through the CLI, by its current flags (`raychat pretrain
   --depth 12 --compile --use-gpu --num-workers 1 ...`) on a small corpus made here from the Python
   standard library's sources (one document per .py file; MFU does not depend on the text) unless
   --data-dir and --tokenizer are given. MFU = the loop's per-step `mfu` in metrics.jsonl (model FLOPs
   6N + attention per token over the peak bf16 FLOP/s of the GPU, raychat.train.plan.PEAK_FLOPS), median
   over the steps after --mfu-skip (compile happens in the first steps).

Smoke check without a GPU (what was run when this was written): `python bench/muon_gpu.py --device cpu
--depth 1 --steps 2 --rows 1 --seq-len 64 --vocab-size 512 --max-docs 200 --cpus-per-worker 1
--mfu-dry-run` runs part 1 on the CPU and part 2's commands with --dry-run (the corpus and tokenizer are
made, the pretrain flags parse and its sizes are derived; nothing trains).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import sysconfig
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
from _common import append_result, command_line, machine, uptime

from raychat.loss import cross_entropy_sum, normalize
from raychat.masks import make_batch
from raychat.model import GPT, ModelConfig
from raychat.ports import free_ports
from raychat.train.muon import Muon
from raychat.train.optim import muon_ns_choice, split_parameters

VARIANTS = {  # name -> (optimizer class, ns_dtype, shard)
    "torch.optim.Muon (bf16)": (torch.optim.Muon, None, False),
    "ours bf16": (Muon, torch.bfloat16, False),
    "ours bf16 sharded (1 process)": (Muon, torch.bfloat16, True),
    "ours fp32": (Muon, torch.float32, False),
    "ours fp32 sharded (1 process)": (Muon, torch.float32, True),
}


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn, device: torch.device, steps: int, warmup: int = 3) -> float:
    """Median seconds of fn() over `steps` calls after `warmup` calls."""
    ts = []
    for i in range(warmup + steps):
        sync(device)
        t0 = time.perf_counter()
        fn()
        sync(device)
        if i >= warmup:
            ts.append(time.perf_counter() - t0)
    return statistics.median(ts)


def muon_times(args, device: torch.device) -> str:
    model = GPT(ModelConfig.from_depth(args.depth, args.vocab_size, args.seq_len)).init_weights(0).to(device)
    matrices = split_parameters(model)[0]
    g = torch.Generator(device=device).manual_seed(0)
    grads = [torch.randn(p.shape, generator=g, device=device) for p in matrices]

    ids = torch.randint(1, args.vocab_size, (args.rows, args.seq_len + 1), device=device)
    batch = make_batch(ids, bos_id=0)
    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda")

    def fwd_bwd():
        with autocast:
            logits = model(batch["input_ids"], position_ids=batch["position_ids"])
        loss, n = cross_entropy_sum(logits, batch["labels"], batch["loss_mask"])
        normalize(loss, int(n)).backward()
        model.zero_grad(set_to_none=True)

    rows = [
        f"| forward+backward, {args.rows} x {args.seq_len} tokens | {1e3 * timed(fwd_bwd, device, args.steps):.2f} |"
    ]
    backend = "nccl" if device.type == "cuda" else "gloo"
    (port,) = free_ports(1)
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    try:
        for name, (cls, dtype, shard) in VARIANTS.items():
            params = [torch.nn.Parameter(p.detach().clone()) for p in matrices]
            kw = {} if cls is torch.optim.Muon else {"ns_dtype": dtype, "shard": shard}
            opt = cls(params, lr=0.02, momentum=0.95, weight_decay=0.0, **kw)

            def step(params=params, opt=opt):
                for p, gr in zip(params, grads):
                    p.grad = gr
                opt.step()

            rows.append(f"| Muon step: {name} | {1e3 * timed(step, device, args.steps):.2f} |")
    finally:
        dist.destroy_process_group()
    n_params = sum(p.numel() for p in matrices)
    return "\n".join(
        [
            f"**Muon step, depth {args.depth}, {len(matrices)} hidden matrices ({n_params / 1e6:.1f}M params), "
            f"{device}** (median ms over {args.steps} steps after 3 warm-up)",
            f"choose_ns_dtype('auto'): {muon_ns_choice(model).describe()}",
            "",
            "| what | ms |",
            "|---|---|",
            *rows,
        ]
    )


def stdlib_corpus(folder: Path, max_docs: int) -> Path:
    """A jsonl of documents: the Python standard library's .py sources (not site-packages), one per file."""
    folder.mkdir(parents=True, exist_ok=True)
    out = folder / "stdlib.jsonl"
    root = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(p for p in root.rglob("*.py") if "site-packages" not in p.parts)[:max_docs]
    with out.open("w") as f:
        for path in files:
            text = path.read_text(errors="ignore").strip()
            if text:
                f.write(json.dumps({"text": text}) + "\n")
    return folder


def run(cmd: list[str], timeout: int) -> None:
    print("$", " ".join(cmd), flush=True)
    subprocess.run(cmd, check=True, timeout=timeout)


def mfu(args, work: Path) -> str:
    raychat = [sys.executable, "-m", "raychat.cli"]
    data_dir, tok = args.data_dir, args.tokenizer
    if not data_dir:
        data_dir = str(work / "data")
        run([*raychat, "data", "prepare", "--source", str(stdlib_corpus(work / "docs", args.max_docs)), "--out", data_dir,
             "--num-shards", "4"], 180)  # fmt: skip
    if not tok:
        tok = str(work / "tokenizer")
        run([*raychat, "tokenizer", "train", "--data-dir", data_dir, "--out", tok, "--vocab-size",
             str(args.vocab_size)], 180)  # fmt: skip
    storage = work / "runs"
    cmd = [*raychat, "pretrain", "--preset", "none", "--run-name", "mfu", "--storage-path", str(storage),
           "--data-dir", data_dir, "--tokenizer-path", tok, "--depth", str(args.depth), "--seq-len",
           str(args.seq_len), "--device-batch-size", str(args.rows),
           "--total-batch-size", str(args.rows * args.seq_len), "--num-iterations", str(args.mfu_steps),
           "--warmup-ratio", "0", "--eval-every", "0", "--eval-tokens", str(args.rows * args.seq_len),
           "--checkpoint-every", "0", "--log-every", "10", "--compile", "--num-workers", "1",
           "--cpus-per-worker", str(args.cpus_per_worker), "--max-failures", "0"]  # fmt: skip
    if args.device != "cpu":
        cmd.append("--use-gpu")
    if args.mfu_dry_run:
        run([*cmd, "--dry-run"], 120)
        return "MFU: dry run only (the pretrain command's flags parse; nothing trained)."
    run(cmd, 420)
    lines = [json.loads(x) for x in (storage / "mfu" / "metrics.jsonl").read_text().splitlines() if x.strip()]
    steady = [x for x in lines if x["step"] > args.mfu_skip]
    med = statistics.median(x["mfu"] or 0.0 for x in steady)
    tps = statistics.median(x["tokens_per_s"] for x in steady)
    return (
        f"**MFU, depth {args.depth}, torch.compile, 1 GPU, {args.mfu_steps} steps of {args.rows} x "
        f"{args.seq_len} tokens**: median MFU {100 * med:.1f}% and {tps:,.0f} tokens/s over steps "
        f"{args.mfu_skip + 1}-{args.mfu_steps}\n\n`{' '.join(cmd[2:])}`"
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cuda", help="cuda (default) or cpu for the smoke check")
    ap.add_argument("--depth", type=int, default=12)
    ap.add_argument("--vocab-size", type=int, default=16384)
    ap.add_argument("--seq-len", type=int, default=2048)
    ap.add_argument("--rows", type=int, default=32, help="rows per micro-batch (default 32)")
    ap.add_argument("--steps", type=int, default=20, help="timed Muon steps per variant (default 20)")
    ap.add_argument("--mfu-steps", type=int, default=50)
    ap.add_argument("--mfu-skip", type=int, default=10, help="steps left out of the MFU median (compile)")
    ap.add_argument("--mfu-dry-run", action="store_true", help="pass --dry-run to raychat pretrain")
    ap.add_argument("--max-docs", type=int, default=4000, help="stdlib files in the made-up corpus")
    ap.add_argument("--cpus-per-worker", type=float, default=8)
    ap.add_argument("--data-dir", default=None, help="reuse prepared shards")
    ap.add_argument("--tokenizer", default=None, help="reuse a tokenizer directory")
    ap.add_argument("--workdir", default=None, help="corpus, tokenizer and the run go here (default: tmp)")
    ap.add_argument("--out", default=None, help="append the markdown result here")
    args = ap.parse_args()
    device = torch.device(args.device)
    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else "no GPU"
    load = uptime()
    work = Path(args.workdir or tempfile.mkdtemp(prefix="muon-gpu-"))
    os.environ.setdefault("RAY_TMPDIR", str(work / "ray"))
    parts = [muon_times(args, device), mfu(args, work)]
    text = "\n\n".join(
        [
            f"## Issue 15 GPU check ({time.strftime('%Y-%m-%d %H:%M')})",
            f"`{command_line()}`\n\n{machine()}; {gpu}; uptime: `{load}`",
            *parts,
        ]
    )
    print(text)
    if args.out:
        append_result(args.out, text)


if __name__ == "__main__":
    main()
