"""Pretraining rows from parquet shards: each rank's share of ONE global document stream, packed.

  DocumentOrder (epoch -> shard -> row group -> row, shuffled from the seed) -> the deal (raychat.data.loader.cursor:
  rank r of W takes stream elements r, r+W, r+2W, ...) -> Ray Data (read the rank's documents from their row
  groups + tokenize: BOS + ids, in order) -> BestFitPacker (crop or split) -> rows of T+1 tokens
  -> `masks.make_batch` (inputs x[:-1], targets x[1:])

Documents, not files, are dealt, so any number of shards >= 1 serves any number of ranks, and over an epoch
every document goes to exactly one rank once. Each rank builds its own Ray Data pipeline from its position
(a Ray Data iterator cannot be resumed mid-stream). Cost of dealing documents: the documents of one row
group are spread over all W ranks, so every rank reads (and decompresses) every row group of the epoch, W x
the bytes of one pass, while each rank tokenizes only its own documents (the expensive part on CPU). At
large W, bigger deal units (row groups) would cut the reads; not done here.

PretrainRows is a raychat.data.loader.row_source.RowSource. Data state in a checkpoint (per rank, references only,
no tokens; raychat.data.loader.row_source):
  {"corpus": DocumentOrder fingerprint, "deal": Deal.to_dict(), "rank", "taken",
   "packer": {"buffer": [[g, offset], ...] references of the buffered pieces, "stats"}}
Resume (load_state_dicts, given the states of ALL ranks of the old world): same world -> every rank restores
its own state exactly (buffer pieces re-read and re-tokenized from their references: bit for bit); another
world -> the states are re-dealt (cursor.redeal): the same global position, no document repeated or skipped,
the old buffers' pieces dealt again.
"""

from __future__ import annotations

import functools
import threading
import time
from collections.abc import Iterator, Sequence

import numpy as np
import pyarrow.parquet as pq
import ray
from ray.data import Datasource, ReadTask
from ray.data._internal.execution.execution_callback import ExecutionCallback
from ray.data.block import BlockAccessor, BlockMetadata

from raychat.data.loader.cursor import Deal, RankCursor, Ref
from raychat.data.loader.document_order import DocumentOrder
from raychat.data.loader.packing import BestFitPacker, Piece, piece_tokens
from raychat.data.loader.row_source import cursor_state, resume_cursor
from raychat.log import plural
from raychat.tokenizer import Tokenizer

CHUNK = 64  # stream references per Ray Data read+tokenize call
READERS = 2  # read+tokenize tasks per rank: far above a rank's use (bench/results/data_pipeline.md)
# Threads Ray Data 2.60 starts in this process for one iter_batches stream: its executor, the iterator's
# pipeline thread and its prefetch/format pool.
RAY_DATA_THREADS = ("StreamingExecutor-", "iter_threaded", "map_tp_")
IDLE_WAIT_S = 0.05  # at most 50 ms late to refill a buffer that holds many steps of rows


@functools.lru_cache(maxsize=4)
def _tokenizer(path: str) -> Tokenizer:
    return Tokenizer.load(path)


def read_pieces(order: DocumentOrder, refs: Sequence[Ref], tokenizer_path: str) -> list[Piece]:
    """The pieces of stream references (g, offset): documents read from their row groups, tokenized with a
    BOS first, cut at offset (raychat.data.loader.packing.piece_tokens)."""
    if not refs:
        return []
    texts = order.read_texts([g for g, _ in refs])
    ids = _tokenizer(str(tokenizer_path)).encode_batch(texts, prepend_bos=True)
    return [Piece(g, o, piece_tokens(doc, o)) for (g, o), doc in zip(refs, ids)]


def _piece_refs(buffer: Sequence) -> list[Ref]:
    """A BestFitPacker state's buffer ([[g, offset], ...]) -> its stream references."""
    return [(int(g), int(o)) for g, o in buffer]


class ShareDatasource(Datasource):
    """Ray Data source of `num_chunks` chunks of one rank's share, from stream position `start` on: chunk c
    is the CHUNK references at start + c * CHUNK, read and tokenized (read_pieces) into one block of columns
    doc (int64), offset (int64), input_ids (int32 arrays). Read task i covers a contiguous range of chunks
    and yields its blocks one chunk at a time, in order.

    A source rather than chunk numbers mapped by map_batches: a read op followed by a map of other resources
    is not fused by Ray Data, and `ray.data.range`'s read tasks ask for 1 CPU each, which a node busy with
    training may not have (the task waits, and an autoscaler adds a node for it)."""

    def __init__(self, num_chunks: int, order: DocumentOrder, deal: dict, rank: int, start: int, tokenizer_path: str):  # fmt: skip
        super().__init__()
        self.num_chunks, self.order, self.deal = num_chunks, order, deal
        self.rank, self.start, self.tokenizer_path = rank, start, tokenizer_path

    def estimate_inmemory_data_size(self) -> None:
        return None

    def get_read_tasks(self, parallelism: int, per_task_row_limit=None, data_context=None) -> list[ReadTask]:
        bounds = np.linspace(0, self.num_chunks, min(parallelism, self.num_chunks) + 1).astype(int)
        return [
            ReadTask(
                functools.partial(self._read, int(lo), int(hi)),
                BlockMetadata(num_rows=None, size_bytes=None, input_files=None, exec_stats=None),
                per_task_row_limit=per_task_row_limit,
            )
            for lo, hi in zip(bounds[:-1], bounds[1:])
        ]

    def _read(self, lo: int, hi: int) -> Iterator:
        deal = Deal.from_dict(self.deal)
        for c in range(lo, hi):
            refs = deal.share(self.rank, self.start + c * CHUNK, CHUNK)
            pieces = read_pieces(self.order, refs, self.tokenizer_path)
            yield BlockAccessor.batch_to_block(
                {
                    "doc": np.asarray([p.doc for p in pieces], dtype=np.int64),
                    "offset": np.asarray([p.offset for p in pieces], dtype=np.int64),
                    "input_ids": [p.tokens for p in pieces],
                }
            )


class IdleWait(ExecutionCallback):
    """Sleeps IDLE_WAIT_S in each step of Ray Data's scheduling loop that has no task in flight.

    Ray Data 2.60's loop blocks in ray.wait only while tasks run; when the rank's output buffer is full
    (backpressure: the trainer consumes slower than the readers produce, the normal state) it spins, and on
    a rank with one core that thread took a quarter of the core and the GIL from training.
    """

    def on_execution_step(self, executor) -> None:
        if not any(op.num_active_tasks() for op in executor._topology):
            time.sleep(IDLE_WAIT_S)


def share_stream(
    order: DocumentOrder,
    cursor: RankCursor,
    tokenizer_path: str,
    num_cpus: float,
    threads: set[threading.Thread] | None = None,
) -> Iterator[Piece]:
    """This rank's pieces from cursor.taken on, endlessly, read and tokenized by Ray Data in order.

    One Ray Dataset covers about an epoch of the share (at least 16 chunks) (then the next one starts where it ended).
    num_cpus: CPU reserved by each read+tokenize task; leave room for the train workers, or the tasks can
    never be scheduled and the run hangs.
    threads: if given, gets the Ray Data threads each Dataset's iterator started (RAY_DATA_THREADS), for the
    caller to join after closing the stream (close_stream).
    """
    ctx = ray.data.DataContext.get_current()
    ctx.execution_options.preserve_order = True
    ctx.enable_progress_bars = False
    if IdleWait not in ctx.custom_execution_callback_classes:
        ctx.custom_execution_callback_classes.append(IdleWait)
    start, deal = cursor.taken, cursor.deal.to_dict()
    share = (order.num_documents + len(cursor.deal.pending)) // cursor.deal.world
    per_epoch = max(
        16, -(-share // CHUNK)
    )  # chunks per Dataset: about an epoch's share, at least 1024 pieces
    while True:
        source = ShareDatasource(per_epoch, order, deal, cursor.rank, start, str(tokenizer_path))
        ds = ray.data.read_datasource(
            source, num_cpus=num_cpus, concurrency=READERS, override_num_blocks=min(per_epoch, 64)
        )
        before = set(threading.enumerate())
        for i, batch in enumerate(
            ds.iter_batches(batch_size=CHUNK, batch_format="numpy", prefetch_batches=4)
        ):
            if i == 0 and threads is not None:
                threads |= {
                    t for t in set(threading.enumerate()) - before if t.name.startswith(RAY_DATA_THREADS)
                }
            for g, o, ids in zip(batch["doc"], batch["offset"], batch["input_ids"]):
                yield Piece(int(g), int(o), np.asarray(ids, dtype=np.int32))
        start += per_epoch * CHUNK


def close_stream(stream: Iterator, threads: set[threading.Thread], timeout_s: float = 60.0) -> None:
    """Close a share_stream and wait (at most timeout_s in all) for the Ray Data threads it started.

    Closing the generator only signals Ray Data's iterator threads to stop; one still inside a Ray call
    returns later, and if ray.shutdown() came first it ends the whole process ("The core worker has already
    been shutdown ... The process will exit").
    """
    stream.close()
    deadline = time.monotonic() + timeout_s
    for t in threads:
        t.join(max(0.0, deadline - time.monotonic()))
    threads.clear()


class PretrainRows:
    """This rank's endless stream of packed pretraining rows, resumable exactly on any number of ranks.

    Args:
        train_files: all training shards (manifest order).
        tokenizer_path: path of tokenizer.json (or its directory).
        row_len: T+1.
        rank, world_size: this worker's place in the data-parallel group.
        buffer_size: best-fit buffer (pieces); overflow, min_fragment: raychat.data.loader.packing.
        seed: the document order's seed; num_cpus: CPU of each Ray Data read+tokenize task.
    Raises:
        ValueError: the shards hold no documents. (Any number >= 1 serves any number of ranks: the stream
            runs on into the next epoch.)
    """

    fingerprint_key = "corpus"  # the state_dict key of fingerprint()

    def __init__(
        self, train_files, tokenizer_path, row_len, rank=0, world_size=1, buffer_size=256, num_cpus=0.5,
        seed=0, overflow="crop", min_fragment=32,
    ):  # fmt: skip
        self.order = DocumentOrder.from_files(list(train_files), seed)
        self.tokenizer_path, self.num_cpus = str(tokenizer_path), num_cpus
        self.rank, self.world = rank, world_size
        self.cursor = RankCursor(Deal(world_size), rank)
        self.packer = BestFitPacker(self._next_document, row_len, buffer_size, overflow, min_fragment)
        self._pieces: Iterator[Piece] | None = None
        self._threads: set[threading.Thread] = set()

    def _next_document(self) -> Piece:
        if self._pieces is None:
            self._pieces = share_stream(
                self.order, self.cursor, self.tokenizer_path, self.num_cpus, self._threads
            )
        piece = next(self._pieces)
        self.cursor.take((piece.doc, piece.offset))
        return piece

    def next_batch(self, n: int) -> dict:
        """{"input_ids": (n, T+1) int32 rows, "replay": per row, its segments' columns (replay records)}."""
        rows, replay = [], []
        for _ in range(n):
            row, segments = self.packer.pack_row()
            rows.append(row)
            replay.append(self.segment_columns(segments))
        return {"input_ids": np.stack(rows), "replay": replay}

    def segment_columns(self, segments) -> dict[str, list]:
        """One row's segments as replay-record columns (the pretraining columns of the record layout in raychat.data.replay.records)."""
        where = [self.order.locate(s.doc) for s in segments]
        return {
            "doc": [s.doc for s in segments],
            "doc_epoch": [w.epoch for w in where],
            "doc_shard": [w.shard for w in where],
            "doc_row_group": [w.row_group for w in where],
            "doc_row": [w.row for w in where],
            "doc_offset": [s.offset for s in segments],
            "row_offset": [s.row_offset for s in segments],
            "length": [s.length for s in segments],
            "decision": [s.decision for s in segments],
            "tail": [s.tail for s in segments],
        }

    # ---- checkpoint state (raychat.data.loader.row_source) -----------------------------------------------
    def fingerprint(self) -> dict:
        """The shards and seed the stream is made of (raychat.data.loader.document_order.DocumentOrder.fingerprint)."""
        return self.order.fingerprint()

    def state_dict(self) -> dict:
        """This rank's data state (module docstring): small, JSON-serializable, references only."""
        return cursor_state(self.fingerprint_key, self.fingerprint(), self.cursor, self.packer.state_dict())

    def load_state_dicts(self, states: Sequence[dict]) -> None:
        """Continue from the states of every rank of the old world (in rank order), on this rank of this one.

        Raises:
            ValueError: the states were made on other shards or another seed, or are not one whole world.
        """
        self.cursor, packer = resume_cursor(
            states, self.fingerprint_key, self.fingerprint(), self.rank, self.world, _piece_refs
        )
        pieces = read_pieces(self.order, _piece_refs(packer["buffer"]), self.tokenizer_path)
        self.packer.load_state_dict(packer, pieces)
        self.close()

    def close(self) -> None:
        """Stop this rank's Ray Data pipeline and wait for its threads (the next row starts a new pipeline
        from the cursor); its executor cancels its autoscaling request as it stops (RowSource.close). A driver
        that is done with a PretrainRows closes it before ray.shutdown(): a Ray Data thread that outlives Ray
        ends the process."""
        if self._pieces is not None:
            close_stream(self._pieces, self._threads)
            self._pieces = None


def _encode_lazily(texts: list[str], tokenizer: Tokenizer, chunk: int = 64) -> Iterator[list[int]]:
    """BOS + ids of each text, in order, encoded `chunk` texts at a time as they are asked for."""
    for i in range(0, len(texts), chunk):
        yield from tokenizer.encode_batch(texts[i : i + chunk], prepend_bos=True)


VALIDATION_BUFFER = (
    256  # fixed, not --buffer-size: training's validator and `raychat eval` pack the same rows
)


def validation_rows(val_file: str, tokenizer: Tokenizer, row_len: int, num_tokens: int, overflow: str = "crop",
                    buffer_size: int = VALIDATION_BUFFER) -> dict[str, np.ndarray]:  # fmt: skip
    """{"input_ids": (N, row_len) int32}: the validation shard's documents best-fit packed (a buffer of
    `buffer_size` documents) into rows of row_len = T+1 tokens, the first N = max(1, num_tokens // T) rows
    (num_tokens counts targets, T per row). The rows depend on nothing else (not the training's --buffer-size or
    world size): the pretraining validator (its ranks share them) and `raychat eval` measure the same rows
    for the same shard, row length and num_tokens.
    overflow: "crop" (the trainer's: the same rows whatever the training policy; long documents are seen
    from their beginning only) or "split" (every token of the documents, bench/packing_overflow.py).
    Fewer than N rows when the shard runs out first.

    Raises ValueError naming the shard: its text fills not even one row."""
    texts = pq.read_table(val_file, columns=["text"]).column("text").to_pylist()
    docs = _encode_lazily(texts, tokenizer)  # the packer stops after N rows, long before the shard's end
    packer = BestFitPacker(lambda: next(docs, None), row_len, buffer_size, overflow)
    n = max(1, num_tokens // (row_len - 1))
    rows = [r for _, r in zip(range(n), packer)]
    if not rows:
        raise ValueError(
            f"the validation shard {val_file} holds too little text for one row of {row_len} tokens "
            f"({plural(len(texts), 'document')}): prepare more text (a larger validation shard) or use a shorter sequence "
            "length"
        )
    return {"input_ids": np.stack(rows)}
