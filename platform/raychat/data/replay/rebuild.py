"""Rebuild a step's rows from its replay records (raychat.data.replay.records) and the data alone, and check them.

Pretraining: every segment's document is read again from the training shards at its recorded place (the
document order is recomputed from the seed and must put the stream item there), tokenized, cut at its
recorded offset (raychat.data.loader.packing.piece_tokens) and placed at its row offset. SFT: every segment's
mixture example is rendered again by the chat template with the same truncation rule and placed at its row
offset, padding after the last one. Then the rows go through raychat.masks.make_batch and are hashed as the
trainer's were: equal hashes = the same input_ids, labels, loss_mask and attention metadata.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence

import numpy as np

from raychat.chat_template import TEMPLATE_VERSION
from raychat.data.loader.document_order import DocumentOrder, changed_shards
from raychat.data.loader.pipeline import read_pieces
from raychat.data.loader.row_source import same_stream
from raychat.data.loader.sft_rows import SFTRows
from raychat.data.replay.records import row_hashes
from raychat.tasks.registry import mixture_tasks
from raychat.tokenizer import Tokenizer


class ReplayError(ValueError):
    """The data no longer gives what the record says (changed shards, tokenizer, template or mixture)."""


def rebuild_pretrain(records: Sequence[Mapping], meta: Mapping, data_dir: str, tokenizer_path: str) -> dict:
    """{"input_ids": (n, row_len) int32} of the records' rows. Raises ReplayError on any disagreement;
    ValueError naming --data-dir when a shard of the record is not in `data_dir` (nothing to compare)."""
    files = [os.path.join(data_dir, name) for name in meta["data"]["files"]]
    if missing := [os.path.basename(f) for f in files if not os.path.isfile(f)]:
        raise ValueError(
            f"--data-dir: {data_dir} has no {', '.join(missing)} (the step's shards); give --data-dir the "
            "directory that holds the run's data now"
        )
    order = DocumentOrder.from_files(files, meta["seed"])
    if changed := changed_shards(meta["data"], order.fingerprint()):
        raise ReplayError(
            f"{', '.join(changed)} in {data_dir}: other content (sha256) than the record's shards"
        )
    if not same_stream(meta["data"], order.fingerprint()):
        raise ReplayError(f"shards in {data_dir} are {order.fingerprint()}, the record has {meta['data']}")
    refs = sorted({(g, o) for r in records for g, o in zip(r["doc"], r["doc_offset"])})
    pieces = {(p.doc, p.offset): p.tokens for p in read_pieces(order, refs, tokenizer_path)}
    rows = np.zeros((len(records), meta["row_len"]), dtype=np.int32)
    for i, r in enumerate(records):
        for k, g in enumerate(r["doc"]):
            w = order.locate(g)
            recorded = (r["doc_epoch"][k], r["doc_shard"][k], r["doc_row_group"][k], r["doc_row"][k])
            if (w.epoch, w.shard, w.row_group, w.row) != recorded:
                raise ReplayError(
                    f"stream item {g} is now at {w}, the record has (epoch, shard, group, row) {recorded}"
                )
            tokens = pieces[(g, r["doc_offset"][k])][: r["length"][k]]
            if len(tokens) != r["length"][k]:
                raise ReplayError(
                    f"stream item {g} has {len(tokens)} tokens from offset, the record {r['length'][k]}"
                )
            rows[i, r["row_offset"][k] : r["row_offset"][k] + len(tokens)] = tokens
        _check_covered(r, meta["row_len"])
    return {"input_ids": rows}


def rebuild_sft(
    records: Sequence[Mapping], meta: Mapping, tokenizer: Tokenizer, task_data_dir: str | None = None
) -> dict:
    """{"input_ids", "supervised", "segment_ids": (n, row_len) int32} of the records' rows (as SamplePacker
    assembles them: padding = bos_id in a segment of its own, not supervised). The hub tasks' files are read
    from `task_data_dir`, else the record's task_data_dir (records without it: $RAYCHAT_TASK_DATA, else
    runs/task_data).

    Raises:
        ReplayError: the data no longer gives what the record says.
        FileNotFoundError: a hub task of the record has no train files in that directory (as make_task).
    """
    own = {"sft_data": meta.get("sft_data", ""), "sft_test_size": meta.get("sft_test_size", 0.0)}
    source = SFTRows(
        mixture_tasks(
            meta["sft_tasks"], "train", meta["seed"], task_data_dir or meta.get("task_data_dir"), **own
        ),
        meta["seed"],
        tokenizer,
        meta["row_len"],
    )
    if not same_stream(meta["data"], source.fingerprint()):
        raise ReplayError(f"the SFT mixture is now {source.fingerprint()}, the record has {meta['data']}")
    n, L = len(records), meta["row_len"]
    ids = np.full((n, L), meta["bos_id"], dtype=np.int32)
    sup = np.zeros((n, L), dtype=np.int32)
    seg = np.zeros((n, L), dtype=np.int32)
    for i, r in enumerate(records):
        seg[i] = len(r["doc"])
        for k, g in enumerate(r["doc"]):
            item = source.render(g)
            got = (item.sample_id, len(item)) if item else (None, 0)
            if got != (r["sample_id"][k], r["length"][k]):
                raise ReplayError(
                    f"stream item {g} renders as {got}, the record has {r['sample_id'][k]!r} of {r['length'][k]}"
                )
            if item.truncation != json.loads(r["truncation"][k]):
                raise ReplayError(
                    f"{item.sample_id}: truncation {item.truncation} != recorded {r['truncation'][k]}"
                )
            a = r["row_offset"][k]
            ids[i, a : a + len(item)], sup[i, a : a + len(item)], seg[i, a : a + len(item)] = (
                item.input_ids, item.supervised, k,
            )  # fmt: skip
    return {"input_ids": ids, "supervised": sup, "segment_ids": seg}


def _check_covered(record: Mapping, row_len: int) -> None:
    ends = [a + n for a, n in zip(record["row_offset"], record["length"])]
    if record["row_offset"][0] != 0 or record["row_offset"][1:] != ends[:-1] or ends[-1] != row_len:
        raise ReplayError(
            f"step {record['step']} rank {record['rank']} row {record['row']}: segments do not tile the row"
        )


def verify_step(
    records: Sequence[Mapping], meta: Mapping, data_dir: str | None = None, tokenizer_path: str | None = None
) -> tuple[dict, list[str]]:
    """Rebuild the rows of `records` (one step, raychat.data.replay.records.read_step) and compare their hashes.

    Args:
        data_dir, tokenizer_path: where the data is now (default: where the run read it, from meta); an SFT
            run's data_dir is its hub task files' directory (its --task-data-dir).
    Returns:
        (rows, problems): the rebuilt rows and every mismatch found (empty = the batch is identical).
    """
    tokenizer_path = tokenizer_path or meta["tokenizer_path"]
    tokenizer = Tokenizer.load(tokenizer_path)
    problems = []
    if tokenizer.version != meta["tokenizer_version"]:
        problems.append(f"tokenizer_version {tokenizer.version} != recorded {meta['tokenizer_version']}")
    if meta["stage"] == "sft" and meta["template_version"] != TEMPLATE_VERSION:
        problems.append(f"template_version {TEMPLATE_VERSION} != recorded {meta['template_version']}")
    try:
        if meta["stage"] == "sft":
            rows = rebuild_sft(records, meta, tokenizer, data_dir)
        else:
            rows = rebuild_pretrain(records, meta, data_dir or meta["data_dir"], tokenizer_path)
    except ReplayError as e:
        return {}, [*problems, str(e)]
    for r, hashes in zip(records, row_hashes(rows, meta["bos_id"], meta["document_masking"])):
        for name, value in hashes.items():
            if r.get(name) != value:
                problems.append(
                    f"rank {r['rank']} micro {r['micro']} row {r['row']}: {name.removesuffix('_sha256')} differs"
                )
    return rows, problems
