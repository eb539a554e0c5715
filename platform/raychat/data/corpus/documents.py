"""A local corpus's documents held as Arrow UTF-8 text (large_string chunks), not as Python strings: about one
byte of memory a byte of text whatever the script, where a str of Cyrillic text holds 2 bytes a character and,
once converted to Arrow, a UTF-8 copy as well. Built a document or a parquet column at a time
(DocumentsBuilder), read back in any order a shard at a time (take)."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

# Documents appended as str are converted into one Arrow chunk once they hold this many characters. Loading a
# 200 MB .jsonl measured 234 MB more resident memory with 1 MiB, 264 MB with 8 MiB (malloc keeps what it freed).
FLUSH_CHARS = 1 << 20
# Where the documents' buffers are allocated: malloc's pool. With pyarrow's default pool (mimalloc) loading the
# same .jsonl took 383 MB more (1 MiB chunks), 311 MB (8 MiB): the freed buffers of the conversions stay resident.
POOL = pa.system_memory_pool()


class DocumentsBuilder:
    """Documents appended in order (append: a str; extend: an Arrow array), finished into a ChunkedArray of
    large_string. About FLUSH_CHARS characters at most are held as Python strings at a time."""

    def __init__(self) -> None:
        self.chunks: list[pa.Array] = []
        self.pending: list[str] = []
        self.pending_chars = 0
        self.count = 0

    def __len__(self) -> int:
        return self.count

    def append(self, text: str) -> None:
        """One more document; `text` must have a UTF-8 encoding (no lone surrogate)."""
        self.pending.append(text)
        self.pending_chars += len(text)
        self.count += 1
        if self.pending_chars >= FLUSH_CHARS:
            self.flush()

    def extend(self, texts: pa.Array) -> None:
        """The values of `texts`, in order: a string or binary array (large or not) of valid UTF-8, no null.

        Raises:
            pa.ArrowInvalid: a value that is not UTF-8.
        """
        self.flush()
        if len(texts):
            self.chunks.append(texts.cast(pa.large_string(), memory_pool=POOL))
            self.count += len(texts)

    def flush(self) -> None:
        if self.pending:
            self.chunks.append(pa.array(self.pending, type=pa.large_string(), memory_pool=POOL))
            self.pending, self.pending_chars = [], 0

    def finish(self) -> pa.ChunkedArray:
        """All the documents appended, in order: a ChunkedArray of large_string (no chunk is empty)."""
        self.flush()
        return pa.chunked_array(self.chunks, type=pa.large_string())


def text_bytes(texts: pa.Array | pa.ChunkedArray) -> int:
    """The UTF-8 bytes of all the values of a string array (0 for none)."""
    return pc.sum(pc.binary_length(texts)).as_py() or 0


def take(documents: pa.ChunkedArray, indices: np.ndarray) -> pa.Array:
    """[documents[i] for i in indices] as one large_string array, gathered chunk by chunk: only the documents
    taken are copied (pyarrow 26's ChunkedArray.take of strings concatenates all the chunks first: a copy of the
    whole corpus for each shard).

    Args:
        documents: a ChunkedArray of large_string.
        indices: int64 positions in `documents`, shape (n,), each in [0, len(documents)).
    """
    starts = np.cumsum([0] + [len(c) for c in documents.chunks])
    chunk_of = np.searchsorted(starts, indices, side="right") - 1
    by_chunk = np.argsort(chunk_of, kind="stable")
    sorted_chunks = chunk_of[by_chunk]
    local = indices[by_chunk] - starts[sorted_chunks]
    edges = np.searchsorted(sorted_chunks, np.arange(documents.num_chunks + 1))
    pieces = [
        pc.take(documents.chunk(c), local[edges[c] : edges[c + 1]], memory_pool=POOL)
        for c in range(documents.num_chunks)
        if edges[c] < edges[c + 1]
    ]
    if len(pieces) == 1:  # in the order of `indices` already (the sort is stable)
        return pieces[0]
    # the documents taken from the first chunk, then from the next...
    gathered = pa.concat_arrays(pieces, memory_pool=POOL)
    del pieces
    inverse = np.empty_like(by_chunk)
    inverse[by_chunk] = np.arange(len(by_chunk))
    return pc.take(gathered, inverse, memory_pool=POOL)
