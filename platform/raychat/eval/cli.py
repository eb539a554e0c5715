"""`raychat eval`: validation BPB and held-out task accuracy of one checkpoint, as JSON.

  --checkpoint REF  -> raychat.checkpoint_manager.resolve_checkpoint (fetched when remote) -> load_model
  BPB               the validation shard of --data-dir, best-fit packed into rows of the model's
                    max_seq_len + 1 tokens (raychat.data.loader.pipeline.validation_rows, the pretraining evaluator's
                    rows), --eval-tokens of them (raychat.eval.bpb: nats / (ln 2 * UTF-8 bytes) over the
                    target tokens)
  accuracy          the test split of each --tasks entry (raychat.eval.tasks.task_accuracy: greedy, exact
                    answer for generative tasks, argmax over the letters for categorical ones)

The result goes to stdout (one JSON document) and to <storage-path>/<run-name>/eval.json (written whole:
raychat.storage.write_bytes). Every input is resolved and the root checked for writing before the model
loads: a bad flag fails in one line naming it.
"""

from __future__ import annotations

import json
import math
import sys
import time

import torch

from raychat.checkpoint import load_model
from raychat.checkpoint_manager import find_checkpoint
from raychat.config import EvalConfig, from_args
from raychat.data.corpus.shards import list_shards
from raychat.data.loader.pipeline import validation_rows
from raychat.eval.bpb import bpb_sums
from raychat.eval.tasks import task_accuracy
from raychat.storage import check_writable, open_storage, run_directory, write_bytes
from raychat.tasks.registry import held_out, make_task, parse_mixture

RESULT_FILE = "eval.json"


def evaluate(checkpoint: str, val_file: str, tasks: list[tuple[str, int | None]], cfg: EvalConfig) -> dict:
    """{"checkpoint", "stage", "step", "val_bpb", "val_tokens", "tasks": {name: {"accuracy", "examples"}},
    "seconds"} of the checkpoint at `checkpoint` (a local dir or a remote URI)."""
    t0 = time.perf_counter()
    model, tokenizer, meta = load_model(checkpoint, device=cfg.device)
    seq_len = model.config.max_seq_len
    rows = validation_rows(val_file, tokenizer, seq_len + 1, 256, cfg.eval_tokens, 1)
    token_bytes = torch.tensor(tokenizer.token_bytes(), dtype=torch.int64)
    nats, nbytes = bpb_sums(
        model, rows, token_bytes, tokenizer.bos_id, cfg.device_batch_size, device=cfg.device
    )
    accuracy = {}
    for name, n in tasks:
        task = make_task(name, "test", None, cfg.seed)
        examples = min(n or len(task), len(task))
        accuracy[name] = {
            "accuracy": task_accuracy(model, tokenizer, task, examples, max_tokens=cfg.max_tokens),
            "examples": examples,
        }
    return {
        "checkpoint": checkpoint,
        "stage": meta.get("stage"),
        "step": meta.get("step"),
        "val_bpb": nats / (math.log(2) * nbytes),
        "val_tokens": int(rows["input_ids"].shape[0] * seq_len),
        "tasks": accuracy,
        "seconds": round(time.perf_counter() - t0, 2),
    }


def main(args) -> int:
    """`raychat eval` (its parser: raychat.commands.eval_)."""
    cfg = from_args(args, EvalConfig, "eval", where="eval settings")
    if not cfg.checkpoint:
        raise ValueError("--checkpoint: required: a checkpoint, its run (dir or name), or latest")
    if cfg.device == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device: cuda, but this machine has no CUDA device")
    storage = open_storage(cfg.storage_path)
    tasks = parse_mixture(cfg.tasks, "--tasks")
    for name, _ in tasks:
        if not held_out(name):
            raise ValueError(f"--tasks: {name!r} has no held-out split to measure accuracy on")
    checkpoint = find_checkpoint(cfg.checkpoint, storage, "--checkpoint")
    data_dir = run_directory(cfg.data_dir, storage, "--data-dir")
    try:
        _, val_file = list_shards(data_dir)
    except (OSError, ValueError) as e:
        raise ValueError(f"--data-dir: {e}") from e
    check_writable(storage)
    result = evaluate(checkpoint, val_file, tasks, cfg)
    text = json.dumps(result, indent=2)
    where = write_bytes(storage, f"{storage.run_path(cfg.run_name)}/{RESULT_FILE}", (text + "\n").encode())
    print(text)
    print(f"wrote {where}", file=sys.stderr)
    return 0
