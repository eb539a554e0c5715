"""Parquet text shards in the FineWeb-Edu layout, and the manifest that lists them.

Layout of a data directory (what `raychat data prepare` writes and the pretraining stage reads):
  shard_00000.parquet ... shard_0000K.parquet   one column `text` (string), zstd, row groups of
                                                ROW_GROUP_SIZE rows; the LAST shard is the validation shard
  manifest.json                                 source, license, documents, bytes, seed, skipped counts by
                                                reason, and per shard: file, split, documents, bytes, sha256
(The same file naming and schema as karpathy/fineweb-edu-100b-shuffle, whose last shard is its validation
shard.) Every file is written to a temporary name and renamed into place (os.replace), and the manifest is
written last, so a directory whose manifest exists is complete.
"""

from __future__ import annotations

import hashlib
import json
import re
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from raychat.atomic import atomic_write, atomic_write_bytes
from raychat.config.data import PrepareConfig
from raychat.data.corpus.documents import take, text_bytes
from raychat.log import TenthsProgress, duration, log, plural, size

MANIFEST = "manifest.json"
FORMAT = "raychat-text-shards/1"  # the manifest's "format": what tells a prepared data directory
ROW_GROUP_SIZE = PrepareConfig().row_group_size
COMPRESSION = "zstd"
SCHEMA = pa.schema([pa.field("text", pa.string())])
DOCUMENT_SUFFIXES = (
    ".txt",
    ".md",
    ".rst",
    ".jsonl",
    ".parquet",
)  # the files a --source DIR gives documents from
# A cut into at most this many shards logs a line a shard (the shipped presets cut into 6 and 8: each shard's
# split and size beside the cut line and its warnings); a larger one logs its progress in tenths instead (196
# lines of a 278 MB corpus scrolled the cut line away).
SHARD_LINES_MAX = 10
WRITE_QUIET_S = 5.0  # writing that ends sooner logs no progress line (TenthsProgress), only its end line
MAX_SHARD_TEXT_BYTES = 2**31 - 1  # the most text one shard's `text` column (pa.string: int32 offsets) holds


class DataError(ValueError):
    """Input that cannot become documents; the message names the file (and, for parquet, the row group)."""


class TextColumnError(DataError):
    """A shard that reads but whose `text` column is not one string a document (another type, a null): the same
    bytes fetched again would be refused again."""


def shard_name(index: int) -> str:
    """File name of shard `index` (FineWeb-Edu layout): shard_00042.parquet."""
    return f"shard_{index:05d}.parquet"


def is_shard_name(name: str) -> bool:
    """Whether `name` is a file name shard_name gives (no directory part)."""
    return re.fullmatch(r"shard_\d{5,}\.parquet", name) is not None


def sha256_file(path: str | Path, chunk_bytes: int = 1 << 20) -> str:
    """Hex SHA-256 of a file's bytes."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(chunk_bytes):
            h.update(chunk)
    return h.hexdigest()


def shard_digests(files: list[str]) -> list[str]:
    """The hex sha256 of each shard's bytes, in order: the manifest.json of the shard's directory gives it (no
    shard is read: cheap at every resume of a large corpus) when it lists the file with the file's present size;
    otherwise (no manifest, a file it does not list, or one whose size changed since) it is computed
    (sha256_file: ~30 ms for the default 8 MB debian-docs shards).

    Raises:
        FileNotFoundError: a shard is missing. json.JSONDecodeError: a manifest.json that is not JSON.
    """
    listed: dict[Path, dict] = {}
    digests = []
    for f in map(Path, files):
        if f.parent not in listed:
            path = f.parent / MANIFEST
            shards = json.loads(path.read_text()).get("shards", []) if path.is_file() else []
            listed[f.parent] = {e.get("file"): e for e in shards}
        entry = listed[f.parent].get(f.name, {})
        if entry.get("sha256") and entry.get("file_bytes") == f.stat().st_size:
            digests.append(entry["sha256"])
        else:
            digests.append(sha256_file(f))
    return digests


def write_shard(texts: list[str] | pa.Array, path: str | Path, row_group_size: int = ROW_GROUP_SIZE) -> None:
    """Write one shard: a parquet file with a single `text` string column, zstd, `row_group_size` rows a group.
    `texts`: the documents, str each, or an Arrow string array (large or not) of them."""
    column = texts.cast(pa.string()) if isinstance(texts, pa.Array) else pa.array(texts, type=pa.string())
    table = pa.table({"text": column}, schema=SCHEMA)
    atomic_write(
        Path(path),
        lambda tmp: pq.write_table(table, tmp, compression=COMPRESSION, row_group_size=row_group_size),
    )


def check_shard_bytes(lengths: np.ndarray, order: np.ndarray, ranges: list[tuple[int, int]]) -> None:
    """Check that no shard holds more than MAX_SHARD_TEXT_BYTES of text: a shard's `text` is one Arrow string
    column, whose int32 offsets address at most 2**31 - 1 bytes. `lengths`: int64 UTF-8 bytes a document;
    `order` and `ranges`: write_shards' (shard i holds documents order[start:end] of ranges[i]).

    Raises:
        ValueError: the first shard over the limit, its size, and how many shards the corpus needs at least
            (--num-shards, or fewer documents a shard with --rows-per-shard).
    """
    for i, (start, end) in enumerate(ranges):
        held = int(lengths[order[start:end]].sum())
        if held > MAX_SHARD_TEXT_BYTES:
            needed = -(-int(lengths.sum()) // MAX_SHARD_TEXT_BYTES) + 1  # + the validation shard
            raise ValueError(
                f"shard {i} would hold {held:,} bytes of text, over the {MAX_SHARD_TEXT_BYTES:,} a shard can "
                f"hold (an Arrow string column): cut the corpus into more shards, at least {needed:,} for its "
                f"{size(int(lengths.sum()))} (--num-shards), or fewer documents a shard (--rows-per-shard)"
            )


def split_evenly(n: int, parts: int) -> list[tuple[int, int]]:
    """[start, end) ranges that cut n items into `parts` runs whose sizes differ by at most one."""
    base, extra = divmod(n, parts)
    bounds, start = [], 0
    for i in range(parts):
        end = start + base + (1 if i < extra else 0)
        bounds.append((start, end))
        start = end
    return bounds


def shard_entry(path: Path, split: str, documents: int, text_bytes: int) -> dict:
    return {
        "file": path.name,
        "split": split,
        "documents": documents,
        "bytes": text_bytes,
        "file_bytes": path.stat().st_size,
        "sha256": sha256_file(path),
    }


def write_shards(
    documents: list[str] | pa.ChunkedArray,
    out_dir: str | Path,
    num_shards: int,
    row_group_size: int = ROW_GROUP_SIZE,
    log=log,
    clock: Callable[[], float] = time.perf_counter,
    order: np.ndarray | None = None,
) -> list[dict]:
    """Cut `documents` (str each, or a ChunkedArray of large_string: corpora.Corpus.documents) in the order
    `order` gives (int64 positions in `documents`, shape (len(documents),); None: their own order, already
    shuffled) into `num_shards` shards of near-equal document counts, in order; a shard's documents are
    gathered from `documents` as it is written (documents.take).

    The last shard is the validation split; the others are "train". Logs a line a shard where num_shards is at
    most SHARD_LINES_MAX ("  wrote shard_00000.parquet: train, 240 documents, 222.6 kB of text, 64.3 kB on
    disk"); beyond, once writing has run WRITE_QUIET_S and the documents written reach another tenth
    (raychat.log.TenthsProgress), "wrote 40/196 shards (20% of 250,000 documents) in 12s, eta 48s" (the ETA the
    mean rate so far x the documents left); then always one end line (written_line). `clock`: seconds.
    Returns:
        one manifest entry per shard: file, split, documents, bytes (UTF-8 text), file_bytes, sha256.
    Raises:
        ValueError: num_shards < 2 (a train and a validation shard are needed), more shards than documents, or
            a shard over MAX_SHARD_TEXT_BYTES (check_shard_bytes), each before a shard is written.
    """
    if num_shards < 2:
        raise ValueError(
            f"num_shards must be >= 2 (at least one train shard and the validation shard), got {num_shards}"
        )
    if len(documents) < num_shards:
        raise ValueError(
            f"{plural(len(documents), 'document')} cannot fill {num_shards} shards (one document at least each)"
        )
    if isinstance(documents, list):
        documents = pa.chunked_array([pa.array(documents, pa.large_string())], type=pa.large_string())
    order = np.arange(len(documents)) if order is None else order
    ranges = split_evenly(len(documents), num_shards)
    check_shard_bytes(pc.binary_length(documents).to_numpy(), order, ranges)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    pace = TenthsProgress(len(documents), WRITE_QUIET_S, clock)
    entries = []
    for i, (start, end) in enumerate(ranges):
        path = out / shard_name(i)
        texts = take(documents, order[start:end])
        write_shard(texts, path, row_group_size)
        split = "val" if i == num_shards - 1 else "train"
        entries.append(shard_entry(path, split, len(texts), text_bytes(texts)))
        if num_shards <= SHARD_LINES_MAX:
            log(
                f"  wrote {path.name}: {split}, {plural(len(texts), 'document')}, "
                f"{size(entries[-1]['bytes'])} of text, {size(entries[-1]['file_bytes'])} on disk"
            )
        elif i < num_shards - 1 and (due := pace.due(end)) is not None:  # the last: the end line follows
            log(
                f"wrote {i + 1:,}/{plural(num_shards, 'shard')} ({end / len(documents):.0%} of "
                f"{plural(len(documents), 'document')}) in {duration(due[0])}, eta {duration(due[1])}"
            )
    log(written_line(entries, pace.elapsed()))
    return entries


def written_line(entries: list[dict], seconds: float) -> str:
    """The end line of writing the shards of `entries` (write_shards') in `seconds`: "wrote 196 shards (250,000
    documents, 278.00 MB of text, 81.20 MB on disk) in 1m02s"."""
    documents = sum(e["documents"] for e in entries)
    text = sum(e["bytes"] for e in entries)
    on_disk = sum(e["file_bytes"] for e in entries)
    return (
        f"wrote {plural(len(entries), 'shard')} ({plural(documents, 'document')}, {size(text)} of text, "
        f"{size(on_disk)} on disk) in {duration(seconds)}"
    )


def open_text_shard(
    path: str | Path, name: str | Path | None = None, column: str = "text", fix: str = ""
) -> pq.ParquetFile:
    """The parquet file at `path`; DataError naming it (as `name`, default the path) when it cannot be read or has
    no `column` (its columns listed, then `fix`)."""
    name = path if name is None else name
    try:
        pf = pq.ParquetFile(path)
    except Exception as e:
        raise DataError(f"{name}: not a readable parquet file ({e})") from e
    if column not in pf.schema_arrow.names:
        raise DataError(f"{name}: no `{column}` column (columns: {pf.schema_arrow.names}){fix}")
    return pf


def read_text_column(
    pf: pq.ParquetFile, group: int, name: str | Path, column: str = "text"
) -> pa.ChunkedArray:
    """The `column` (default `text`) of row group `group`; DataError naming the file (`name`) and the group when
    it cannot be read."""
    try:
        return pf.read_row_group(group, columns=[column]).column(column)
    except Exception as e:
        raise DataError(
            f"{name}: row group {group} of {pf.num_row_groups} cannot be read ({str(e).strip()})"
        ) from e


def text_batches(
    pf: pq.ParquetFile, group: int, name: str | Path, column: str, batch_rows: int
) -> Iterator[pa.Array]:
    """The `column` of row group `group`, `batch_rows` rows at a time (the last batch may hold fewer), each
    batch read as it is asked for; DataError naming the file (`name`) and the group when it cannot be read."""
    try:
        for batch in pf.iter_batches(batch_size=batch_rows, row_groups=[group], columns=[column]):
            yield batch.column(0)
    except Exception as e:
        raise DataError(
            f"{name}: row group {group} of {pf.num_row_groups} cannot be read ({str(e).strip()})"
        ) from e


def inspect_shard(path: str | Path) -> tuple[int, int]:
    """(documents, UTF-8 text bytes) of a parquet shard, reading every row group of its `text` column: the check
    a downloaded hub shard passes before it is kept, so what reads shards as text never meets another type or a
    null.

    Raises:
        DataError: not a readable parquet file, no `text` column, a column of another type than strings, a null
            `text` (null_text_message), or a row group that cannot be read (the message names the file and the
            row group).
    """
    pf = open_text_shard(path)
    check_text_type(pf, path)
    documents = text_bytes = 0
    for g in range(pf.num_row_groups):
        column = read_text_column(pf, g, path)
        if column.null_count:
            raise TextColumnError(
                null_text_message(path, documents + pc.index(pc.is_null(column), True).as_py())
            )
        documents += len(column)
        text_bytes += pc.sum(pc.binary_length(column.cast(pa.binary()))).as_py() or 0
    return documents, text_bytes


def check_text_type(pf: pq.ParquetFile, path: str | Path) -> None:
    """DataError naming `path` and the type when the `text` column of `pf` does not hold strings."""
    kind = pf.schema_arrow.field("text").type
    if not (pa.types.is_string(kind) or pa.types.is_large_string(kind)):
        raise TextColumnError(f"{path}: the `text` column holds {kind}, not strings")


def null_text_message(path: str | Path, row: int) -> str:
    """The error for a null `text` at `row` (counted from 0 over the whole file) of shard `path`."""
    return (
        f"{path}: row {row}: `text` is null: a shard holds one text per document and no null (raychat data "
        "prepare skips a document without text and refuses a downloaded shard with one); prepare this corpus "
        "again with raychat data prepare"
    )


def check_text_column(path: str | Path) -> None:
    """Check that a shard's `text` column holds strings and no null, as prepare writes it: what reads the
    shards as text (the tokenizer, the loaders) could not use a null. A row group's null count comes from the
    file's footer where it is recorded (every shard prepare writes); only a row group without one is read.

    Raises:
        DataError: not a readable parquet file, no `text` column, a column of another type, a row group that
            cannot be read, or a null (null_text_message: the file and the row).
    """
    pf = open_text_shard(path)
    check_text_type(pf, path)
    parquet_schema = pf.metadata.schema
    index = next(i for i in range(len(parquet_schema)) if parquet_schema.column(i).path == "text")
    first_row = 0
    for g in range(pf.num_row_groups):
        group = pf.metadata.row_group(g)
        stats = group.column(index).statistics
        if stats is None or not stats.has_null_count or stats.null_count > 0:
            column = read_text_column(pf, g, path)
            if column.null_count:
                row = pc.index(pc.is_null(column), True).as_py()
                raise TextColumnError(null_text_message(path, first_row + row))
        first_row += group.num_rows


def prepared_manifest(directory: str | Path) -> dict | None:
    """directory/manifest.json when `raychat data prepare` wrote it (a JSON object of format FORMAT), else None
    (none there, unreadable, not JSON, or another program's manifest.json)."""
    try:
        manifest = json.loads((Path(directory) / MANIFEST).read_text())
    except (OSError, ValueError):
        return None
    return manifest if isinstance(manifest, dict) and manifest.get("format") == FORMAT else None


def write_manifest(out_dir: str | Path, manifest: dict) -> Path:
    """Write out_dir/manifest.json atomically; returns its path."""
    path = Path(out_dir) / MANIFEST
    data = (json.dumps(manifest, indent=2, sort_keys=False) + "\n").encode()
    atomic_write_bytes(path, data)
    return path


def read_manifest(data_dir: str | Path) -> dict:
    """The manifest of a prepared data directory.

    Raises:
        FileNotFoundError: no manifest.json (the directory was never prepared, or preparing did not finish; a
            folder of documents is told to be given to `raychat data prepare --source`).
        ValueError: "<path>: not a manifest `raychat data prepare` wrote: <why>": not JSON, not a JSON object,
            or "shards" not a list of objects each naming its "file"; or the manifest lists fewer than 2
            shards, or its last shard is not the validation split.
    """
    path = Path(data_dir) / MANIFEST
    if not path.is_file() and holds_documents(data_dir):
        raise FileNotFoundError(
            f"{path} not found: {data_dir} holds documents, not the shards `raychat data prepare` writes: run "
            f"`raychat data prepare --source {data_dir} --out DIR` and give --data-dir DIR"
        )
    if not path.is_file():
        raise FileNotFoundError(
            f"{path} not found: give --data-dir a directory `raychat data prepare` wrote, or run `raychat data "
            f"prepare --out {data_dir}` first"
        )
    not_ours = f"{path}: not a manifest `raychat data prepare` wrote"
    try:
        manifest = json.loads(path.read_text())
    except ValueError as e:  # not JSON, or not UTF-8
        raise ValueError(f"{not_ours}: not JSON ({e})") from None
    if not isinstance(manifest, dict):
        raise ValueError(f"{not_ours}: a JSON {type(manifest).__name__}, not an object")
    shards = manifest.get("shards") or []
    if not isinstance(shards, list):
        raise ValueError(f'{not_ours}: "shards" is a {type(shards).__name__}, not a list')
    for i, entry in enumerate(shards):
        if not isinstance(entry, dict) or not isinstance(entry.get("file"), str):
            raise ValueError(f'{not_ours}: shard {i} is {json.dumps(entry)}, not an object naming its "file"')
    if len(shards) < 2 or shards[-1].get("split") != "val":
        raise ValueError(
            f"{path}: needs >= 2 shards with the last one split='val', got {[s.get('split') for s in shards]}"
        )
    return manifest


def holds_documents(directory: str | Path) -> bool:
    """Whether `directory` holds a file a --source DIR reads (DOCUMENT_SUFFIXES) that is not a shard of a prepare
    that did not finish (is_shard_name). Its folders are not looked into: a storage root's runs hold .md and
    .json files that are no corpus."""
    root = Path(directory)
    return root.is_dir() and any(
        p.suffix.lower() in DOCUMENT_SUFFIXES and not is_shard_name(p.name) and p.is_file()
        for p in root.iterdir()
    )


def list_shards(data_dir: str | Path, verify: bool = False) -> tuple[list[str], str]:
    """(train_files, val_file): absolute paths of a prepared directory's shards, in manifest order.

    Args:
        data_dir: the --out directory of `raychat data prepare`.
        verify: also recompute every shard's sha256 and compare it with the manifest.
    Raises:
        FileNotFoundError: no manifest, or a listed shard is missing.
        ValueError: a malformed manifest, or (verify=True) a shard whose sha256 differs from the manifest.
    """
    root = Path(data_dir).resolve()
    manifest = read_manifest(root)
    paths = []
    for entry in manifest["shards"]:
        path = root / entry["file"]
        if not path.is_file():
            raise FileNotFoundError(f"{path} is listed in {root / MANIFEST} but missing")
        if verify and sha256_file(path) != entry["sha256"]:
            raise ValueError(f"{path}: sha256 differs from {MANIFEST} (file changed after prepare)")
        paths.append(str(path))
    return paths[:-1], paths[-1]
