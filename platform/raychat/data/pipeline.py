"""Pretraining rows from parquet shards: Ray Data streams and tokenizes, the packer fills rows.

  read_parquet (streaming, order preserved) -> map_batches(tokenize: BOS + ids) -> this rank's iterator
  -> BestFitPacker -> rows of T+1 tokens -> `masks.make_batch` (inputs x[:-1], targets x[1:])

Each rank reads its own files (train_files[rank::world_size]), so every rank gets different data. The
position (epoch, file, document within file) and the packer's buffer are saved in each checkpoint: a
resumed run re-opens the stream at that file, skips the documents already consumed, and restores the
buffer, so no document is repeated or skipped. This is why the ranks build their streams themselves from
the checkpointed position rather than taking a split of one driver-side dataset: Ray Data iterators
cannot be resumed mid-stream.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import ray

from raychat.data.packing import BestFitPacker
from raychat.tokenizer import Tokenizer


@functools.lru_cache(maxsize=4)
def _tokenizer(path: str) -> Tokenizer:
    return Tokenizer.load(path)


def tokenize_batch(batch: dict, tokenizer_path: str) -> dict:
    """Ray Data map_batches function: text -> BOS-prefixed token ids (list<int32>); the tokenizer is loaded
    once per worker process."""
    ids = _tokenizer(tokenizer_path).encode_batch(list(batch["text"]), prepend_bos=True)
    return {"input_ids": [np.asarray(x, dtype=np.int32) for x in ids], "path": batch["path"]}


def tokenized_documents(
    files: list[str], tokenizer_path: str, skip_documents: int = 0, num_cpus: float = 0.5
) -> Iterator[tuple[str, np.ndarray]]:
    """Yield (file path, BOS-prefixed token ids) for every document of `files`, in file order.

    Args:
        files: parquet shards with a `text` column.
        tokenizer_path: tokenizer.json (or its directory), loaded once per Ray Data actor.
        skip_documents: documents of files[0] already consumed (resume); they are not yielded.
        num_cpus: CPU reserved by each read+tokenize task (Ray fuses the two); leave room for the train
            workers, or the tasks can never be scheduled and the run hangs.
    """
    ctx = ray.data.DataContext.get_current()
    ctx.execution_options.preserve_order = True
    ctx.enable_progress_bars = False
    ds = ray.data.read_parquet(
        files, include_paths=True, shuffle=None, ray_remote_args={"num_cpus": num_cpus}
    )
    ds = ds.select_columns(["text", "path"]).map_batches(
        tokenize_batch, fn_kwargs={"tokenizer_path": str(tokenizer_path)}, batch_size=256, num_cpus=num_cpus
    )
    first = os.path.basename(files[0])
    for batch in ds.iter_batches(batch_size=256, batch_format="numpy", prefetch_batches=4):
        for path, ids in zip(batch["path"], batch["input_ids"]):
            if skip_documents and os.path.basename(path) == first:
                skip_documents -= 1
                continue
            yield str(path), ids


class PretrainRows:
    """This rank's endless stream of packed pretraining rows, resumable exactly.

    Args:
        train_files: all training shards (sorted); this rank takes train_files[rank::world_size].
        tokenizer_path: path of tokenizer.json.
        row_len: T+1.
        rank, world_size: this worker's place in the data-parallel group.
        buffer_size: best-fit buffer (documents).
    Raises:
        ValueError: fewer train files than ranks.
    """

    def __init__(
        self, train_files, tokenizer_path, row_len, rank=0, world_size=1, buffer_size=256, num_cpus=0.5
    ):
        if len(train_files) < world_size:
            raise ValueError(
                f"need at least one train shard per rank: {len(train_files)} shards, {world_size} ranks"
            )
        self.files = [str(f) for f in train_files[rank::world_size]]
        self.names = [os.path.basename(f) for f in self.files]
        self.tokenizer_path = str(tokenizer_path)
        self.num_cpus = num_cpus
        self.epoch, self.file_index, self.doc_index = 0, 0, 0
        self.packer = BestFitPacker(self._next_document, row_len, buffer_size)
        self._docs: Iterator | None = None

    def _open(self) -> None:
        self._docs = tokenized_documents(
            self.files[self.file_index :], self.tokenizer_path, self.doc_index, self.num_cpus
        )

    def _next_document(self) -> np.ndarray:
        if self._docs is None:
            self._open()
        for _ in range(2):
            try:
                path, ids = next(self._docs)
            except StopIteration:  # epoch boundary: start over from the first file
                self.epoch, self.file_index, self.doc_index = self.epoch + 1, 0, 0
                self._open()
                continue
            i = self.names.index(Path(path).name)
            if i != self.file_index:
                self.file_index, self.doc_index = i, 0
            self.doc_index += 1
            return ids
        raise RuntimeError(f"training files yield no documents: {self.files}")

    def next_batch(self, n: int) -> dict[str, np.ndarray]:
        """{"input_ids": (n, T+1) int32 rows}."""
        return {"input_ids": np.stack([self.packer.next_row() for _ in range(n)])}

    def state_dict(self) -> dict:
        return {
            "epoch": self.epoch,
            "file_index": self.file_index,
            "doc_index": self.doc_index,
            "files": self.names,
            "packer": self.packer.state_dict(),
        }

    def load_state_dict(self, state: dict) -> None:
        if state["files"] != self.names:
            raise ValueError(f"checkpoint was made with files {state['files']}, this rank has {self.names}")
        self.epoch, self.file_index, self.doc_index = state["epoch"], state["file_index"], state["doc_index"]
        self.packer.load_state_dict(state["packer"])
        self._docs = None


def validation_rows(val_file: str, tokenizer: Tokenizer, seq_len: int, buffer_size: int, num_tokens: int,
                    world_size: int) -> dict[str, np.ndarray]:  # fmt: skip
    """{"input_ids": (N, seq_len + 1)}: the validation shard's documents best-fit packed, the first
    N = max(world_size, num_tokens // seq_len // world_size * world_size) rows (the same at every evaluation)."""
    texts = pq.read_table(val_file, columns=["text"]).column("text").to_pylist()
    docs = iter(tokenizer.encode_batch(texts, prepend_bos=True))
    packer = BestFitPacker(lambda: next(docs, None), seq_len + 1, buffer_size)
    n = max(world_size, num_tokens // seq_len // world_size * world_size)
    return {"input_ids": np.stack([r for _, r in zip(range(n), packer)])}
