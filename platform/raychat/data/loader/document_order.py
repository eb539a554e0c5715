"""The order of the pretraining documents: stream item g -> (shard, row group, row) of the training shards.

Every epoch visits each document of the training shards once. The order of epoch e (seeded, the same on
every machine; raychat.data.loader.cursor.epoch_permutation):

    shards permuted by (seed, e)  ->  row groups of each shard permuted by (seed, e, shard)
    ->  rows of each row group permuted by (seed, e, shard, row group)

so a shard's row groups stay together (each file is opened once per epoch) and no two epochs agree. Item g
of the stream is position p = g % N of epoch g // N, N = documents in all training shards. The layout (files,
rows per row group) comes from the parquet footers and each shard's sha256 from the data manifest; the
fingerprint of both goes into every checkpoint's data state, so a run cannot resume on changed shards, even
shards of the same names and layout that hold other documents.
"""

from __future__ import annotations

import functools
import hashlib
import os
from dataclasses import dataclass

import numpy as np
import pyarrow.parquet as pq

from raychat.data.corpus.shards import open_text_shard, shard_digests
from raychat.data.loader.cursor import epoch_permutation


@dataclass(frozen=True)
class DocumentLocation:
    epoch: int
    shard: int  # index into the training files (sorted, as the manifest lists them)
    row_group: int
    row: int  # row within the row group


class DocumentOrder:
    """Where each stream item lives, and its text.

    Args:
        files: the training shards (parquet, a `text` column), in manifest order.
        row_groups: rows of each row group of each file (from the footers: `from_files`).
        seed: the run's seed.
        content: the hex sha256 of each file (`from_files`: raychat.data.corpus.shards.shard_digests), or
            None (the fingerprint then has no "content").
    Raises:
        ValueError: no documents at all.
    """

    def __init__(
        self, files: list[str], row_groups: list[list[int]], seed: int, content: list[str] | None = None
    ):
        self.files, self.row_groups, self.seed = [str(f) for f in files], row_groups, seed
        self.content = content
        self.num_documents = sum(sum(g) for g in row_groups)
        self._epochs: dict[int, tuple] = {}  # the last epochs' layouts (locate is called per document)
        self._rows: dict[tuple[int, int, int], np.ndarray] = {}
        if self.num_documents == 0:
            raise ValueError(f"the training shards hold no documents: {self.files}")

    @classmethod
    def from_files(cls, files: list[str], seed: int) -> DocumentOrder:
        """Read the row-group sizes from each file's parquet footer (no data pages) and each file's sha256 from
        the manifest of its directory (computed where none lists it: shard_digests).

        Raises:
            raychat.data.corpus.shards.DataError (a ValueError): a file that is not a readable parquet file or
                has no `text` column (open_text_shard: "<file>: not a readable parquet file (<why>)").
        """
        sizes = []
        for f in files:
            meta = open_text_shard(f).metadata
            sizes.append([meta.row_group(i).num_rows for i in range(meta.num_row_groups)])
        return cls(files, sizes, seed, shard_digests(files))

    def fingerprint(self) -> dict:
        """What a checkpoint checks before resuming: {"files": shard names, "documents", "layout": a hash of the
        row groups' sizes, "seed", "content": the first 16 hex digits of each shard's sha256} (no "content"
        without `content`; checkpoints written before it existed have none either: compare fingerprints with
        raychat.data.loader.row_source.same_stream, which compares "content" only when both have it)."""
        layout = hashlib.sha256(repr(self.row_groups).encode()).hexdigest()[:16]
        names = [os.path.basename(f) for f in self.files]
        out = {"files": names, "documents": self.num_documents, "layout": layout, "seed": self.seed}
        if self.content is not None:
            out["content"] = [digest[:16] for digest in self.content]
        return out

    def __getstate__(self):  # pickled into Ray Data tasks: no caches
        return {
            "files": self.files,
            "row_groups": self.row_groups,
            "seed": self.seed,
            "content": self.content,
        }

    def __setstate__(self, state):
        self.__init__(state["files"], state["row_groups"], state["seed"], state["content"])

    def _epoch(self, epoch: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(shard, row group, first position) of every row group of the epoch, in visiting order."""
        if epoch in self._epochs:
            return self._epochs[epoch]
        shards, groups = [], []
        for s in epoch_permutation(len(self.files), self.seed, epoch):
            for rg in epoch_permutation(len(self.row_groups[s]), self.seed, epoch, int(s)):
                shards.append(int(s))
                groups.append(int(rg))
        sizes = [self.row_groups[s][rg] for s, rg in zip(shards, groups)]
        starts = np.concatenate([[0], np.cumsum(sizes)[:-1]]).astype(np.int64)
        if len(self._epochs) >= 2:
            self._epochs.pop(min(self._epochs))
        self._epochs[epoch] = (np.asarray(shards), np.asarray(groups), starts)
        return self._epochs[epoch]

    def _row_order(self, epoch: int, shard: int, row_group: int) -> np.ndarray:
        key = (epoch, shard, row_group)
        if key not in self._rows:
            if len(self._rows) >= 64:
                self._rows.pop(next(iter(self._rows)))
            self._rows[key] = epoch_permutation(self.row_groups[shard][row_group], self.seed, *key)
        return self._rows[key]

    def locate(self, g: int) -> DocumentLocation:
        """Where stream item g (>= 0) is."""
        epoch, p = divmod(int(g), self.num_documents)
        shards, groups, starts = self._epoch(epoch)
        i = int(np.searchsorted(starts, p, side="right")) - 1  # the last row group starting at or before p
        s, rg = int(shards[i]), int(groups[i])
        return DocumentLocation(epoch, s, rg, int(self._row_order(epoch, s, rg)[p - starts[i]]))

    def read_texts(self, items: list[int]) -> list[str]:
        """The texts of stream items, in the given order (row groups read once each, through a small cache)."""
        where = [self.locate(g) for g in items]
        return [_row_group_text(self.files[w.shard], w.row_group)[w.row] for w in where]


@functools.lru_cache(maxsize=8)
def _row_group_text(path: str, row_group: int) -> list[str]:
    return pq.ParquetFile(path).read_row_group(row_group, columns=["text"]).column("text").to_pylist()


def changed_shards(was: dict, now: dict) -> list[str]:
    """The names of the shards whose content differs between two fingerprints of the same shard names (none
    when either has no "content" or the names differ)."""
    if was.get("files") != now.get("files") or "content" not in was or "content" not in now:
        return []
    return [name for name, a, b in zip(now["files"], was["content"], now["content"]) if a != b]
