"""Checkpoint layout before vs after issue 16 (one optimizer copy, binary data state): bytes on disk, bytes each
rank reads on resume, and save / restore seconds, at depth 12 on 2 data-parallel ranks, in one run.

Both layouts are run by this script side by side, alternating (before, after, before, after, ...): "before" is
raychat of a base commit (a `git archive` of it, imported through PYTHONPATH), "after" is this worktree. Each
measurement is 2 rank processes (torch.distributed, gloo) that build the depth-12 model and its optimizers
(raychat.train.optim: Muon + AdamW) exactly as a Ray Train worker does, give them the state of one step on
seeded gradients (AdamW steps; Muon's momentum buffers are set to the gradients, its first step's state, without
the Newton-Schulz iterations that take minutes at depth 12 on this CPU and change no size), then time, between
barriers:
  save:    the stage's Checkpointer.write of every rank into one directory (rank 0: model, meta, tokenizer,
           and the optimizer state: once after, on every rank before), as the trainer calls it;
  restore: what raychat.train.worker does on resume: load model.safetensors, then Checkpointer.restore.
The data state every rank writes is a pretraining row source's: position fields plus a best-fit buffer of
--buffer-size documents (lengths uniform in [64, 1024) tokens, ids < vocab), the same on both sides.
"Bytes read" counts the files each rank opens during restore (a PEP 578 audit hook; safetensors maps
model.safetensors outside Python's open, so it is added), at their full size. On remote storage Ray
downloads the whole checkpoint directory once per node (`Checkpoint.as_directory`): there the download is
the checkpoint's bytes.

  python bench/checkpoint_layout.py --base 3841215 --out bench/results/checkpoint_layout.md
"""

from __future__ import annotations

import argparse
import gc
import inspect
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _common import append_result, command_line, machine, uptime

from raychat.ports import free_ports

ROOT = Path(__file__).resolve().parents[1]


# ---- one rank (a subprocess; imports whichever raychat PYTHONPATH points at) ----------------------------
def data_state(buffer_size: int, vocab: int, rank: int) -> dict:
    import numpy as np

    rng = np.random.default_rng(rank)
    buffer = [rng.integers(0, vocab, int(n)).tolist() for n in rng.integers(64, 1024, buffer_size)]
    stats = {"placed": 123456, "cropped": 4567, "consumed": 130000}
    return {
        "rows": {"epoch": 0, "file_index": 1, "doc_index": 777, "packer": {"buffer": buffer, "stats": stats}}
    }


def run_rank(args) -> None:
    import torch
    import torch.distributed as dist
    from safetensors.torch import load_file

    import raychat
    from raychat.config import TrainConfig, from_dict
    from raychat.model import GPT, ModelConfig
    from raychat.tokenizer import Tokenizer
    from raychat.train.checkpointer import Checkpointer
    from raychat.train.optim import build_optimizers
    from raychat.train.plan import make_plan

    assert Path(raychat.__file__).resolve().is_relative_to(Path(args.expect_root).resolve()), raychat.__file__
    torch.set_num_threads(1)
    rank, world = args.rank, args.world
    dist.init_process_group("gloo", rank=rank, world_size=world)
    cfg = from_dict(TrainConfig, {"depth": args.depth, "seq_len": 2048})
    plan = make_plan(cfg, args.vocab)
    tokenizer = Tokenizer.load(args.tokenizer)

    def fresh():
        model = GPT(ModelConfig(**plan.model_config)).init_weights(0)
        return model, build_optimizers(model, cfg.optim)

    model, optimizers = fresh()
    gen = torch.Generator().manual_seed(1)
    for p in model.parameters():
        p.grad = torch.randn(p.shape, generator=gen) * 1e-3
    muon, *others = optimizers
    for group in muon.param_groups:  # its state after a first step, without the Newton-Schulz iterations
        for p in group["params"]:
            muon.state[p]["momentum_buffer"] = p.grad.clone()
    for opt in others:
        opt.step()
    for opt in optimizers:
        opt.zero_grad(set_to_none=True)
    ck = Checkpointer("pretrain", {"note": "bench"}, tokenizer, {"plan": plan.to_dict()})
    state = data_state(args.buffer_size, args.vocab, rank)
    new_api = "world_size" in inspect.signature(ck.write).parameters
    where = (rank, world) if new_api else (rank,)

    dist.barrier()
    t0 = time.perf_counter()
    ck.write(args.dir, *where, 100, model, optimizers, state)
    dist.barrier()
    save_s = time.perf_counter() - t0

    del model, optimizers  # the machine is shared: one model and optimizer state per rank at a time
    gc.collect()
    model, optimizers = fresh()
    opened: set[str] = set()

    def hook(event, hook_args):
        if event == "open" and isinstance(hook_args[0], str) and hook_args[0].startswith(args.dir):
            opened.add(hook_args[0])

    sys.addaudithook(hook)
    dist.barrier()
    t0 = time.perf_counter()
    weights = os.path.join(args.dir, "model.safetensors")
    model.load_state_dict(load_file(weights))
    opened.add(weights)
    ck.restore(args.dir, rank, optimizers)
    dist.barrier()
    restore_s = time.perf_counter() - t0
    result = {
        "rank": rank, "save_s": save_s, "restore_s": restore_s,
        "read_bytes": sum(os.path.getsize(p) for p in opened), "read_files": sorted(map(os.path.basename, opened)),
        "params": sum(p.numel() for p in model.parameters()),
    }  # fmt: skip
    Path(args.result).write_text(json.dumps(result))
    dist.destroy_process_group()


# ---- the driver ------------------------------------------------------------------------------------------
def measure(layout: str, platform_dir: Path, args, work: Path, tokenizer: Path) -> dict:
    """One save + restore of `layout` on args.workers rank processes; the directory's files and sizes."""
    d = work / f"ckpt_{layout}"
    shutil.rmtree(d, ignore_errors=True)
    (port,) = free_ports(1)
    env = {
        **os.environ,
        "PYTHONPATH": str(platform_dir),
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
    }
    procs = []
    for rank in range(args.workers):
        cmd = [
            sys.executable, __file__, "--rank", str(rank), "--world", str(args.workers), "--dir", str(d),
            "--depth", str(args.depth), "--vocab", str(args.vocab), "--buffer-size", str(args.buffer_size),
            "--tokenizer", str(tokenizer), "--expect-root", str(platform_dir),
            "--result", str(work / f"{layout}_{rank}.json"),
        ]  # fmt: skip
        procs.append(subprocess.Popen(cmd, env=env))
    if any(p.wait() for p in procs):
        raise RuntimeError(f"{layout}: a rank process failed")
    ranks = [json.loads((work / f"{layout}_{r}.json").read_text()) for r in range(args.workers)]
    files = {p.name: p.stat().st_size for p in sorted(d.iterdir())}
    shutil.rmtree(d)
    return {"ranks": ranks, "files": files, "bytes": sum(files.values())}


def report(args, runs: dict[str, list[dict]]) -> str:
    def med(layout, key):
        return statistics.median(max(r[key] for r in m["ranks"]) for m in runs[layout])

    gb = 1e9
    before, after = runs["before"][0], runs["after"][0]
    lines = [
        f"# Checkpoint layout: before ({args.base}) vs after, depth {args.depth}, {args.workers} ranks",
        "",
        f"`{command_line()}`",
        "",
        f"{machine()}; model {after['ranks'][0]['params'] / 1e6:.1f}M parameters (vocab {args.vocab}, fp32), "
        f"Muon + AdamW state after one step, data state: a best-fit buffer of {args.buffer_size} documents per "
        f"rank; {args.repeats} alternating measurements of each, medians (save/restore: the slowest rank, "
        f"between barriers). Load before: `{args.load_before}`; after: `{uptime()}`.",
        "",
        "| | before | after | after / before |",
        "|---|---|---|---|",
        f"| checkpoint bytes | {before['bytes'] / gb:.3f} GB | {after['bytes'] / gb:.3f} GB | "
        f"{after['bytes'] / before['bytes']:.3f} |",
    ]
    for r in range(args.workers):
        b, a = before["ranks"][r]["read_bytes"], after["ranks"][r]["read_bytes"]
        lines.append(f"| bytes rank {r} reads on resume | {b / gb:.3f} GB | {a / gb:.3f} GB | {a / b:.3f} |")
    for key, name in (("save_s", "save seconds"), ("restore_s", "restore seconds")):
        b, a = med("before", key), med("after", key)
        lines.append(f"| {name} | {b:.2f} | {a:.2f} | {a / b:.3f} |")
    lines += ["", "Files (bytes):", ""]
    for layout in ("before", "after"):
        files = runs[layout][0]["files"]
        lines.append(f"- {layout}: " + ", ".join(f"{k} {v:,}" for k, v in files.items()))
    lines += ["", "Files rank 1 opens on resume:", ""]
    for layout in ("before", "after"):
        lines.append(f"- {layout}: " + ", ".join(runs[layout][0]["ranks"][1]["read_files"]))
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--base", default="3841215", help="commit of the 'before' layout")
    ap.add_argument("--depth", type=int, default=12)
    ap.add_argument("--vocab", type=int, default=65536, help="model vocabulary (the cluster preset's)")
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--buffer-size", type=int, default=256, help="documents in each rank's packer buffer")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--workdir", default=None)
    ap.add_argument("--out", default=None, help="append the markdown result here")
    for flag in ("--rank", "--world"):
        ap.add_argument(flag, type=int, default=None, help=argparse.SUPPRESS)
    for flag in ("--dir", "--tokenizer", "--expect-root", "--result"):
        ap.add_argument(flag, default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.rank is not None:
        return run_rank(args)

    from raychat.tokenizer import Tokenizer

    work = Path(args.workdir or tempfile.mkdtemp(prefix="ckpt-bench-"))
    work.mkdir(parents=True, exist_ok=True)
    before_dir = work / "before"
    shutil.rmtree(before_dir, ignore_errors=True)
    before_dir.mkdir()
    archive = subprocess.run(
        ["git", "archive", args.base, "platform"], cwd=ROOT, capture_output=True, check=True
    )
    subprocess.run(["tar", "-x", "-C", str(before_dir)], input=archive.stdout, check=True)
    tokenizer = work / "tokenizer"
    Tokenizer.train(["the checkpoint layout bench " * 50] * 4, vocab_size=300).save(tokenizer)
    args.load_before = uptime()
    platforms = {"before": before_dir / "platform", "after": ROOT / "platform"}
    runs: dict[str, list[dict]] = {"before": [], "after": []}
    for i in range(args.repeats):
        for layout in ("before", "after"):
            runs[layout].append(measure(layout, platforms[layout], args, work, tokenizer))
            ranks = runs[layout][-1]["ranks"]
            print(f"{layout} #{i + 1}: {runs[layout][-1]['bytes'] / 1e9:.3f} GB, save "
                  f"{max(r['save_s'] for r in ranks):.2f} s, restore {max(r['restore_s'] for r in ranks):.2f} s")  # fmt: skip
    text = report(args, runs)
    print(text)
    if args.out:
        append_result(args.out, text)
    shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
