"""Replay records: what every row of every optimizer step held, written by the training loop next to the
checkpoints, so any step's batch can be rebuilt from the shards (or the SFT mixture) and proven identical.

  <run dir>/replay/steps_<first:06d>-<last:06d>.rank<r>.parquet

One file per rank per checkpoint interval, written (atomically: temporary name, then renamed; one object put
on S3/GCS) just before the checkpoint of its last step. A run that restarts from checkpoint N deletes the files
of steps after N first (rank 0), so each step's records come from the attempt that went on.

One parquet row per packed row:
  step (as the checkpoints count, from 1), rank, world, micro (micro-batch of the step), row (in it)
  list columns, one entry per segment of the row, in row order:
    doc, doc_epoch        the stream item g and its epoch (raychat.data.loader.cursor)
    row_offset, length    where the segment sits in the row
    pretraining           doc_shard, doc_row_group, doc_row (where the document is in the training shards),
                          doc_offset (0: the document from its BOS; k > 0: a split tail [BOS] + doc[k:]),
                          decision (whole | crop | split | drop) and tail (tokens cropped, requeued or dropped)
    SFT                   sample (mixture index), sample_id, truncation (the chat template's decision, JSON)
  input_ids_sha256, labels_sha256, loss_mask_sha256, position_ids_sha256 (+ segment_ids_sha256 with
  document masking): hashes of the row's raychat.masks.make_batch tensors.
File metadata (key "raychat", JSON, `replay_meta`): stage, seed, template_version, tokenizer_version, bos_id,
row_len, document_masking, data_dir, tokenizer_path, data (the row source's fingerprint: shards or mixture)
and, for pretraining, overflow and min_fragment; for SFT, sft_tasks, task_data_dir (the hub tasks' files,
absolute as `raychat sft` resolved it; records written before it was recorded lack it), sft_data and
sft_test_size.

Hash of a tensor = sha256 over "<name>|<shape>|" followed by its values as little-endian int64 bytes
(bool -> 0/1), so it does not depend on the device or the in-memory dtype.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from collections.abc import Mapping, Sequence

import numpy as np
import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.parquet as pq
import torch

from raychat.atomic import atomic_write
from raychat.chat_template import TEMPLATE_VERSION
from raychat.checkpoint_manager import committed_checkpoints
from raychat.config import TrainConfig
from raychat.masks import make_batch
from raychat.storage import open_storage

HASHED = ("input_ids", "labels", "loss_mask", "position_ids", "segment_ids")
REPLAY_DIR = "replay"
_NAME = re.compile(r"steps_(\d+)-(\d+)\.rank(\d+)\.parquet$")


def tensor_sha256(name: str, t: torch.Tensor | np.ndarray) -> str:
    a = np.ascontiguousarray(np.asarray(t.cpu() if isinstance(t, torch.Tensor) else t).astype("<i8"))
    h = hashlib.sha256(f"{name}|{list(a.shape)}|".encode())
    h.update(a.tobytes())
    return h.hexdigest()


def rows_batch(rows: Mapping, bos_id: int, document_masking: bool) -> dict[str, torch.Tensor]:
    """The make_batch tensors the trainer builds from a row-source batch ({"input_ids": (n, T+1)} and, for SFT,
    "supervised", "segment_ids"): input_ids, labels, loss_mask, position_ids (n, T) and, with document masking,
    segment_ids."""
    as_tensor = {k: torch.from_numpy(np.asarray(rows[k])) for k in ("supervised", "segment_ids") if k in rows}
    return make_batch(
        torch.from_numpy(np.asarray(rows["input_ids"])),
        bos_id,
        document_masking=document_masking,
        **as_tensor,
    )


def row_hashes(rows: Mapping, bos_id: int, document_masking: bool) -> list[dict[str, str]]:
    """Per row of a row-source batch (rows_batch's `rows`): {"<name>_sha256": hash} of that row's make_batch
    tensors (the ones the trainer builds)."""
    batch = rows_batch(rows, bos_id, document_masking)
    names = [k for k in HASHED if k in batch and (k != "segment_ids" or document_masking)]
    return [
        {f"{k}_sha256": tensor_sha256(k, batch[k][i]) for k in names} for i in range(len(rows["input_ids"]))
    ]


def step_records(
    step: int, rank: int, world: int, batches: Sequence[Mapping], bos_id: int, document_masking: bool
) -> list[dict]:
    """The replay rows of one optimizer step on one rank: its micro-batches (row-source outputs, each with a
    "replay" list of per-row segment columns) with position and hashes."""
    out = []
    for m, rows in enumerate(batches):
        for r, (segments, hashes) in enumerate(
            zip(rows["replay"], row_hashes(rows, bos_id, document_masking))
        ):
            out.append(
                {"step": step, "rank": rank, "world": world, "micro": m, "row": r, **segments, **hashes}
            )
    return out


def replay_meta(cfg: TrainConfig, tokenizer_version: str, bos_id: int, data: dict) -> dict:
    """The file metadata of a run's records (module docstring); data: the row source's fingerprint()."""
    d = cfg.data
    meta = {
        "stage": cfg.run.stage, "seed": cfg.run.seed, "template_version": TEMPLATE_VERSION,
        "tokenizer_version": tokenizer_version, "bos_id": bos_id, "row_len": cfg.model.seq_len + 1,
        "document_masking": cfg.model.document_masking, "data_dir": d.data_dir, "tokenizer_path": d.tokenizer_path,
        "data": data,
    }  # fmt: skip
    if cfg.run.stage == "sft":
        return {
            **meta, "sft_tasks": d.sft_tasks, "task_data_dir": d.task_data_dir, "sft_data": d.sft_data,
            "sft_test_size": d.sft_test_size,
        }  # fmt: skip
    return {**meta, "overflow": d.overflow, "min_fragment": d.min_fragment}


def _filesystem(run_dir: str) -> tuple[pafs.FileSystem, str]:
    if "://" in str(run_dir):
        return pafs.FileSystem.from_uri(str(run_dir))
    return pafs.LocalFileSystem(), os.path.abspath(run_dir)


def write_records(run_dir: str, rank: int, records: Sequence[dict], meta: Mapping) -> str:
    """Write one rank's records of consecutive steps to <run_dir>/replay/; returns the file's path."""
    fs, root = _filesystem(run_dir)
    directory = f"{root}/{REPLAY_DIR}"
    fs.create_dir(directory, recursive=True)
    first, last = records[0]["step"], records[-1]["step"]
    path = f"{directory}/steps_{first:06d}-{last:06d}.rank{rank}.parquet"
    table = pa.Table.from_pylist(list(records))
    table = table.replace_schema_metadata({"raychat": json.dumps(dict(meta), sort_keys=True)})
    if isinstance(fs, pafs.LocalFileSystem):
        atomic_write(path, lambda tmp: pq.write_table(table, str(tmp), compression="zstd"))
    else:
        pq.write_table(table, path, filesystem=fs, compression="zstd")
    return path


def _files(run_dir: str) -> list[tuple[int, int, int, str]]:
    """(first step, last step, rank, path) of every replay file of a run."""
    fs, root = _filesystem(run_dir)
    infos = fs.get_file_info(pafs.FileSelector(f"{root}/{REPLAY_DIR}", allow_not_found=True))
    found = [(_NAME.search(i.path), i.path) for i in infos]
    return sorted((int(m[1]), int(m[2]), int(m[3]), p) for m, p in found if m)


def prune_records(run_dir: str, after_step: int) -> int:
    """Delete the replay files holding steps after `after_step` (a restart from that checkpoint redoes them);
    returns how many."""
    fs, _ = _filesystem(run_dir)
    stale = [p for _, last, _, p in _files(run_dir) if last > after_step]
    for p in stale:
        fs.delete_file(p)
    return len(stale)


def _no_records(run_dir: str) -> str:
    """Why a directory without replay records has none, from the stages of its committed checkpoints."""
    storage = open_storage(run_dir, "--run")
    committed = committed_checkpoints(storage, storage.path)
    stages = sorted({str(c.commit.get("stage") or "unknown") for c in committed})
    runs = {"pretrain": "a pretraining run", "sft": "an SFT run", "rl": "an RL run"}
    if not committed:
        what = "it holds no committed checkpoint, so it is no training run's directory"
    elif stages == ["rl"]:
        what = f"it is an RL run (checkpoints of steps {[c.step for c in committed]}), and RL runs write none"
    else:
        kinds = ", ".join(runs.get(s, f"a {s} run") for s in stages)
        what = f"it is {kinds} (checkpoints of steps {[c.step for c in committed]}) whose records are gone"
    return f"{what}; only pretraining and SFT runs write replay records, beside their checkpoints"


def read_step(run_dir: str, step: int) -> tuple[list[dict], dict]:
    """The records of `step` on every rank, ordered by (rank, micro, row), and the files' metadata.

    Raises:
        FileNotFoundError: no such run directory, or no replay file of the run holds that step (the run has
            none at all: the message says what the directory is, e.g. an RL run, which writes none).
        ValueError: the step's records do not come from one whole world (a rank's file is missing), or a file
            named like a replay record is not one (another schema, no raychat metadata), named with its path.
    """
    fs, root = _filesystem(run_dir)
    files = [p for first, last, _, p in _files(run_dir) if first <= step <= last]
    if not files:
        if fs.get_file_info(root).type == pafs.FileType.NotFound:
            raise FileNotFoundError(f"no run directory {run_dir}")
        steps = sorted({(first, last) for first, last, _, _ in _files(run_dir)})  # one file per rank
        if not steps:
            raise FileNotFoundError(f"no replay record under {run_dir}/{REPLAY_DIR}: {_no_records(run_dir)}")
        raise FileNotFoundError(
            f"no replay record of step {step} under {run_dir}/{REPLAY_DIR} (steps: {steps})"
        )
    rows, meta = [], {}
    for p in files:
        try:
            table = pq.read_table(p, filesystem=fs, filters=[("step", "=", step)])
            meta = json.loads((table.schema.metadata or {})[b"raychat"])
        except (pa.ArrowInvalid, KeyError, ValueError) as e:
            raise ValueError(f"{p} is not a raychat replay record ({type(e).__name__}: {e})") from e
        rows += table.to_pylist()
    rows.sort(key=lambda r: (r["rank"], r["micro"], r["row"]))
    worlds = {r["world"] for r in rows}
    if len(worlds) != 1 or {r["rank"] for r in rows} != set(range(next(iter(worlds)))):
        raise ValueError(
            f"step {step}: records of ranks {sorted({r['rank'] for r in rows})}, worlds {worlds}"
        )
    return rows, meta
