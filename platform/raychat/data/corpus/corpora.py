"""Where the documents come from: the default Debian corpus, or a local folder of text files.

A corpus is its documents (Arrow UTF-8 text: documents.DocumentsBuilder) in a deterministic order, plus what
was skipped and why. Nothing is dropped silently: every document that is not kept is counted under a reason in
`Skips`.

Default corpus ("debian-docs"), real human-written English installable on Debian/Ubuntu:
  - python3.11-doc: the reST sources of the Python 3.11 documentation (PSF-2.0), cleaned of markup by
    `rst_clean` and split at section titles (sections shorter than MIN_SECTION_CHARS are joined to the next).
  - wordnet-base: the WordNet 3.0 glosses (WordNet 3.0 license, Princeton), one line per synset
    ("lemma, lemma (pos): gloss"), GLOSSES_PER_DOCUMENT consecutive synsets per document.
  Install: `sudo apt-get install -y python3.11-doc wordnet-base` (or `make corpus-deps`).

Local folder: every *.txt, *.md, *.rst file is one document (kept verbatim but for a leading UTF-8 byte order
mark); every line of a *.jsonl file is one document (its "text" field); every row of a *.parquet file is one
document (its `text` column). `--text-field NAME` reads another JSON field and parquet column instead.
"""

from __future__ import annotations

import itertools
import json
import subprocess
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import psutil
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from raychat.data.corpus.documents import POOL, DocumentsBuilder, text_bytes
from raychat.data.corpus.rst_clean import clean_rst, split_sections
from raychat.data.corpus.shards import (
    DOCUMENT_SUFFIXES,
    MANIFEST,
    DataError,
    open_text_shard,
    prepared_manifest,
    text_batches,
)
from raychat.log import TenthsProgress, duration, plural, size

PYTHON_DOCS_DIR = Path("/usr/share/doc/python3.11/html/_sources")
WORDNET_DIR = Path("/usr/share/wordnet")
APT_INSTALL = "sudo apt-get install -y python3.11-doc wordnet-base"
MIN_SECTION_CHARS = 500
GLOSSES_PER_DOCUMENT = 50
TEXT_SUFFIXES = (".txt", ".md", ".rst")
WORDNET_FILES = ("noun", "verb", "adj", "adv")  # /usr/share/wordnet/data.<name>
EXAMPLES_PER_REASON = 5
READ_QUIET_S = 5.0  # a folder read faster than this logs only the last line of its reading (ReadProgress)
# a .jsonl file's reading tells ReadProgress its place each time it reads this much more
READ_STEP_BYTES = 1 << 20
# A parquet row group's values are checked (null, UTF-8, empty) this many rows at a time as Python bytes; the
# documents kept stay in Arrow.
PARQUET_SLICE_ROWS = 256
# A .parquet file's text column is read about this many bytes (uncompressed, the footer's figure) at a time.
PARQUET_BATCH_BYTES = 8 << 20
# The `text` column types a local .parquet file may have (a file written from an Arrow string_view column reads
# back as one); binary values are decoded as UTF-8.
TEXT_TYPES = (
    pa.types.is_string, pa.types.is_large_string, pa.types.is_string_view,
    pa.types.is_binary, pa.types.is_large_binary, pa.types.is_binary_view,
)  # fmt: skip
TEXT_FIELD = "text"  # the .jsonl field and .parquet column read unless --text-field names another
# `raychat data prepare` holds a folder's documents whole, as Arrow UTF-8 text (documents.py), to shuffle them.
# Its peak memory (RSS), measured (README: Data): 152 MB for 2 small files; a .jsonl of English (ASCII) text,
# 1.2-1.35 x its size on disk more, of Cyrillic text 1.3 x; a zstd .parquet file up to 5.2 x (its text is ~2.2 x
# its size; a row group is read in batches of PARQUET_BATCH_BYTES: 100 MB of text in one row group of a
# 35 MB file peaked at 399 MB, 555 MB read whole).
MEMORY_BASE_BYTES = 150_000_000
MEMORY_PER_BYTE = 1.4  # of a .txt, .md, .rst or .jsonl file
MEMORY_PER_PARQUET_BYTE = 5.2


class CorpusNotInstalled(DataError):
    """A Debian package of the default corpus is missing (the message gives the apt-get command)."""


class Skips:
    """Counts of skipped documents by reason, with the first few places (file, line/row) of each reason."""

    def __init__(self) -> None:
        self.counts: Counter[str] = Counter()
        self.examples: dict[str, list[str]] = {}

    def add(self, reason: str, where: str, n: int = 1) -> None:
        self.counts[reason] += n
        examples = self.examples.setdefault(reason, [])
        if len(examples) < EXAMPLES_PER_REASON:
            examples.append(where)

    @property
    def total(self) -> int:
        return sum(self.counts.values())


@dataclass
class Corpus:
    """Documents in a deterministic order (not yet shuffled) and where they came from.

    documents: one large_string value a document (documents.DocumentsBuilder.finish).
    components: one dict per sub-source (name, license, path, package version, documents, bytes).
    whole_files: of the documents, those that are a whole .txt, .md or .rst file of a local folder.
    """

    source: str
    license: str
    documents: pa.ChunkedArray
    skips: Skips = field(default_factory=Skips)
    components: list[dict] = field(default_factory=list)
    whole_files: int = 0


def keep(text: str, where: str, documents: DocumentsBuilder, skips: Skips) -> None:
    """Append `text` to documents unless it is empty or whitespace only (then count a skip)."""
    if text.strip():
        documents.append(text)
    else:
        skips.add("empty", where)


def debian_version(package: str) -> str | None:
    """The installed version of a Debian package (dpkg-query), or None where dpkg is not available."""
    try:
        out = subprocess.run(
            ["dpkg-query", "-W", "-f", "${Version}", package], capture_output=True, text=True
        )
    except OSError:
        return None
    return out.stdout.strip() or None if out.returncode == 0 else None


def require(path: Path, package: str) -> None:
    if not path.is_dir():
        raise CorpusNotInstalled(
            f"the default corpus needs the Debian package {package} ({path} is missing); "
            f"install it with: {APT_INSTALL}   (or: make corpus-deps)"
        )


def python_docs(root: Path = PYTHON_DOCS_DIR, skips: Skips | None = None) -> list[str]:
    """Cleaned sections of the Python documentation reST sources under `root` (files sorted by path).

    Raises:
        CorpusNotInstalled: `root` does not exist.
    """
    require(root, "python3.11-doc")
    skips = skips if skips is not None else Skips()
    documents: list[str] = []
    for path in sorted(root.rglob("*.txt")):
        name = str(path.relative_to(root))
        try:
            source = path.read_text(encoding="utf-8")
        except UnicodeDecodeError:
            skips.add("invalid_utf8", name)
            continue
        file_docs, pending = [], ""
        for section in split_sections(source):
            pending = (pending + "\n\n" + clean_rst(section)).strip()
            if len(pending) >= MIN_SECTION_CHARS:
                file_docs.append(pending)
                pending = ""
        if pending and file_docs:  # a short last section joins the one before it
            file_docs[-1] += "\n\n" + pending
        elif pending:
            file_docs.append(pending)
        if not file_docs:  # e.g. a page that is only a table of contents
            skips.add("empty", name)
        documents += file_docs
    return documents


def wordnet_entry(line: str) -> str | None:
    """One data.<pos> line -> "lemma, lemma (pos): gloss", or None for the license header lines.

    Line format (wndb(5WN)): offset lex_filenum ss_type w_cnt(hex) [word lex_id]... p_cnt ... | gloss
    """
    if line.startswith("  ") or " | " not in line:
        return None
    fields, gloss = line.split(" | ", 1)
    parts = fields.split()
    count = int(parts[3], 16)
    words = [w.split("(")[0].replace("_", " ") for w in parts[4 : 4 + 2 * count : 2]]  # "(a)", "(p)" markers
    pos = {"n": "noun", "v": "verb", "a": "adjective", "s": "adjective", "r": "adverb"}[parts[2]]
    return f"{', '.join(words)} ({pos}): {gloss.strip()}"


def wordnet_glosses(root: Path = WORDNET_DIR, per_document: int = GLOSSES_PER_DOCUMENT) -> list[str]:
    """WordNet glosses from root/data.{noun,verb,adj,adv}, `per_document` synsets (in file order) a document.

    Raises:
        CorpusNotInstalled: `root` does not exist.
    """
    require(root, "wordnet-base")
    documents: list[str] = []
    for pos in WORDNET_FILES:
        path = root / f"data.{pos}"
        if not path.is_file():
            raise CorpusNotInstalled(
                f"{path} is missing: the wordnet-base package looks broken; reinstall: {APT_INSTALL}"
            )
        with open(path, encoding="utf-8") as f:
            entries = [e for e in map(wordnet_entry, f) if e]
        documents += ["\n".join(entries[i : i + per_document]) for i in range(0, len(entries), per_document)]
    return documents


def debian_docs(python_root: Path = PYTHON_DOCS_DIR, wordnet_root: Path = WORDNET_DIR) -> Corpus:
    """The default corpus: cleaned Python 3.11 docs, then WordNet glosses (both orders deterministic)."""
    skips = Skips()
    docs = python_docs(python_root, skips)
    glosses = wordnet_glosses(wordnet_root)
    components = [
        component("python3.11-doc", "PSF-2.0", python_root, docs),
        component("wordnet-base", "WordNet-3.0 (Princeton)", wordnet_root, glosses),
    ]
    documents = pa.chunked_array([pa.array(docs + glosses, pa.large_string())])
    return Corpus("debian-docs", "PSF-2.0 AND WordNet-3.0", documents, skips, components)


def component(package: str, license: str, path: Path, docs: list[str]) -> dict:
    return {
        "package": package,
        "version": debian_version(package),
        "license": license,
        "path": str(path),
        "documents": len(docs),
        "bytes": sum(len(d.encode()) for d in docs),
    }


def parquet_documents(
    path: Path,
    name: str,
    documents: DocumentsBuilder,
    skips: Skips,
    text_field: str = TEXT_FIELD,
    place: Callable[[int], None] = lambda n_bytes: None,
) -> None:
    """Rows of a parquet file's `text_field` column (default `text`), row group by row group, each read in
    batches of about PARQUET_BATCH_BYTES (batch_rows); a skip is named by its row in its row group
    ("<name>:row_group=<g>:row=<r>"). Before each row group after the first, `place` gets the bytes of the file
    read so far: the file's size on disk x the share of its row groups' compressed size read (row_group_ends).
    A file of no rows is an "empty" skip.

    Raises:
        DataError: not a readable parquet file, no such column (its columns listed, and the --text-field
            that reads another), a column that is neither string nor binary (naming its type), or a row group
            that cannot be read.
    """
    pf = open_text_shard(
        path, name, text_field, "; give --text-field with the column that holds the documents"
    )
    kind = pf.schema_arrow.field(text_field).type
    if not any(is_type(kind) for is_type in TEXT_TYPES):
        raise DataError(
            f"{name}: the `{text_field}` column holds {kind}, not strings (string or UTF-8 binary)"
        )
    if pf.metadata.num_rows == 0:
        skips.add("empty", name)
    ends = row_group_ends(pf, path.stat().st_size)
    for g in range(pf.num_row_groups):
        if g:
            place(ends[g - 1])
        first = 0  # the row group's row that begins the batch
        for batch in text_batches(pf, g, name, text_field, batch_rows(pf.metadata.row_group(g), text_field)):
            column = batch.cast(pa.large_binary())
            kept = [
                usable(value, f"{name}:row_group={g}:row={row}", skips) for row, value in rows(column, first)
            ]
            documents.extend(
                column if all(kept) else pc.filter(column, pa.array(kept, pa.bool_()), memory_pool=POOL)
            )
            first += len(column)


def batch_rows(group: pq.RowGroupMetaData, text_field: str, batch_bytes: int = PARQUET_BATCH_BYTES) -> int:
    """The rows of a batch of about `batch_bytes` of row group `group`'s `text_field` column: its rows x
    batch_bytes / its uncompressed size (the footer's), at least 1. E.g. 1,000 rows of 64 MiB, 8 MiB: 125."""
    size = next(
        (
            group.column(c).total_uncompressed_size
            for c in range(group.num_columns)
            if group.column(c).path_in_schema == text_field
        ),
        0,
    )
    return max(1, group.num_rows * batch_bytes // size if size else group.num_rows)


def rows(column: pa.Array, first: int = 0) -> Iterator[tuple[int, bytes | None]]:
    """(row, value) of each row of a binary array, its rows numbered from `first`, read PARQUET_SLICE_ROWS rows
    at a time as Python bytes."""
    for start in range(0, len(column), PARQUET_SLICE_ROWS):
        yield from enumerate(column.slice(start, PARQUET_SLICE_ROWS).to_pylist(), first + start)


def usable(value: bytes | None, where: str, skips: Skips) -> bool:
    """Whether a parquet value is a document: not null ("null_text"), UTF-8 ("invalid_utf8"), neither empty
    nor whitespace only ("empty"); a skip is counted in `skips` at `where`."""
    if value is None:
        skips.add("null_text", where)
        return False
    try:
        text = value.decode("utf-8")
    except UnicodeDecodeError:
        skips.add("invalid_utf8", where)
        return False
    if not text.strip():
        skips.add("empty", where)
        return False
    return True


def row_group_ends(pf: pq.ParquetFile, n_bytes: int) -> list[int]:
    """Where in a parquet file of `n_bytes` on disk each row group ends, for a progress line: `n_bytes` x the
    compressed size of the row groups up to it / that of all of them (the footer's metadata; the last one ends at
    `n_bytes`). E.g. 4 row groups of one size in 1,000 bytes: [250, 500, 750, 1000]."""
    meta = pf.metadata
    sizes = [
        sum(meta.row_group(g).column(c).total_compressed_size for c in range(meta.num_columns))
        for g in range(meta.num_row_groups)
    ]
    total = sum(sizes) or 1
    return [n_bytes * read // total for read in itertools.accumulate(sizes)]


def is_utf8_encodable(text: str) -> bool:
    """Whether `text` has a UTF-8 encoding: it holds no lone surrogate (U+D800..U+DFFF), which a JSON escape
    such as "\\ud800" can give and no UTF-8 decoding does."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def jsonl_documents(
    path: Path,
    name: str,
    documents: DocumentsBuilder,
    skips: Skips,
    text_field: str = TEXT_FIELD,
    place: Callable[[int], None] = lambda n_bytes: None,
) -> None:
    """The `text_field` (default "text") of each JSON line (a UTF-8 byte order mark before a line, as Windows
    editors write before the first, is ignored); bad lines are counted skips: invalid_utf8 (a line that is not
    UTF-8, or a text with a lone surrogate escape such as "\\ud800", which has no UTF-8 encoding), invalid_json,
    no_text_field, empty (a blank line, whatever `text_field` is; also a file of no lines). Before a line that
    starts READ_STEP_BYTES or more after the last place told, `place` gets the bytes of the file read so far."""
    read = told = 0
    with open(path, "rb") as f:
        for number, raw in enumerate(f, start=1):
            if read - told >= READ_STEP_BYTES:
                place(read)
                told = read
            read += len(raw)
            where = f"{name}:line={number}"
            if not raw.strip():
                skips.add("empty", where)
                continue
            try:
                record = json.loads(raw.decode("utf-8-sig"))
            except UnicodeDecodeError:
                skips.add("invalid_utf8", where)
                continue
            except json.JSONDecodeError:
                skips.add("invalid_json", where)
                continue
            text = record.get(text_field) if isinstance(record, dict) else None
            if not isinstance(text, str):
                skips.add("no_text_field", where)
                continue
            if not is_utf8_encodable(text):  # a lone surrogate escape ("\ud800") is valid JSON, not text
                skips.add("invalid_utf8", where)
                continue
            keep(text, where, documents, skips)
    if not read:
        skips.add("empty", name)


def local_folder(
    folder: str | Path,
    text_field: str = TEXT_FIELD,
    log: Callable[[str], None] | None = None,
    clock: Callable[[], float] = time.perf_counter,
) -> Corpus:
    """All documents in the files under `folder` (recursively, files sorted by relative path); a .jsonl line's
    and a .parquet row's document is its `text_field` (default "text").

    A leading UTF-8 byte order mark of a text file or a .jsonl line is dropped. Files with other suffixes are
    counted as skips ("unsupported_file"); so are a symbolic link to a directory, which is not followed
    ("symlinked_directory"), a folder holding a manifest.json that `raychat data prepare` wrote
    (shards.prepared_manifest), none of whose files is read ("prepared_dataset", once per folder: its shards,
    the validation shard included, would leak into training), a broken symbolic link, a pipe or a socket
    ("not_a_file"), documents that are not valid UTF-8 ("invalid_utf8": a file, a .jsonl line or a parquet
    value that does not decode, a .jsonl text with a lone surrogate escape), empty documents ("empty"; also a
    .jsonl or .parquet file of no line or row) and those of parquet_documents and jsonl_documents. Hidden files
    and folders are read as any other. `log` (None: silent) receives the reading's progress lines (ReadProgress;
    `clock`: seconds), after, where the memory available now (psutil) is less than reading the files may take
    (memory_needed), memory_warning's line.

    Raises:
        DataError: `folder` is not a directory or is itself a prepared data directory; a parquet file is
            corrupt, lacks the `text_field` column or holds neither strings nor binary in it (parquet_documents).
    """
    root = Path(folder)
    if not root.is_dir():
        raise DataError(f"--source {folder!s}: not a directory (and not one of the named sources)")
    if prepared_manifest(root) is not None:
        raise DataError(
            f"--source {folder!s}: a data directory raychat data prepare wrote ({MANIFEST}): its shards are "
            "prepared already (train on it with --data-dir); give the folder of the original documents"
        )
    documents = DocumentsBuilder()
    skips = Skips()
    whole_files = 0
    files = document_files(root, skips)
    sizes = [p.stat().st_size for p in files]
    total_bytes = sum(sizes)
    need = memory_needed([(p.suffix.lower(), n) for p, n in zip(files, sizes)])
    if log is not None and (warning := memory_warning(total_bytes, need, psutil.virtual_memory().available)):
        log(warning)
    progress = ReadProgress(len(files), total_bytes, log or (lambda m: None), clock)
    for path in files:
        name = str(path.relative_to(root))
        suffix = path.suffix.lower()
        if suffix in TEXT_SUFFIXES:
            kept = len(documents)
            try:
                keep(path.read_bytes().decode("utf-8-sig"), name, documents, skips)
            except UnicodeDecodeError:
                skips.add("invalid_utf8", name)
            whole_files += len(documents) - kept
        elif suffix == ".jsonl":
            jsonl_documents(path, name, documents, skips, text_field, progress.within)
        else:
            try:
                parquet_documents(path, name, documents, skips, text_field, progress.within)
            except DataError as e:  # named by its path within the folder: say which flag gave the folder
                raise DataError(f"--source {folder!s}: {e}") from None
        progress.add(path.stat().st_size)
    progress.done()
    texts = documents.finish()
    comp = {"path": str(root.resolve()), "documents": len(texts), "bytes": text_bytes(texts)}
    return Corpus(
        str(root), "as licensed by the files' owners (local folder)", texts, skips, [comp], whole_files
    )


def memory_needed(files: list[tuple[str, int]]) -> int:
    """The most memory (bytes) preparing `files` ((suffix, bytes on disk) each) was measured to take:
    MEMORY_BASE_BYTES + MEMORY_PER_BYTE x a text or .jsonl file's bytes + MEMORY_PER_PARQUET_BYTE x a .parquet
    file's. E.g. a 100 MB .jsonl and a 10 MB .parquet: 150 + 140 + 52 = 342 MB."""
    per_byte = {".parquet": MEMORY_PER_PARQUET_BYTE}
    return round(MEMORY_BASE_BYTES + sum(per_byte.get(suffix, MEMORY_PER_BYTE) * n for suffix, n in files))


def memory_warning(folder_bytes: int, need: int, available: int) -> str | None:
    """The warning, before a folder of `folder_bytes` (its document files on disk) is read, that preparing it
    takes up to `need` bytes of memory (memory_needed), more than the `available` (psutil's figure); None where it
    fits."""
    if need <= available:
        return None
    return (
        f"warning: preparing {size(folder_bytes)} of documents may take up to {size(need)} of memory (they are "
        f"held whole to be shuffled; README: Data), more than the {size(available)} available: it may be "
        "killed for memory; free some, or prepare a part of the folder"
    )


def document_files(root: Path, skips: Skips) -> list[Path]:
    """The files under `root` that local_folder reads (.txt/.md/.rst, .jsonl, .parquet), sorted by path; what
    it does not read is counted in `skips` (local_folder's doc: unsupported_file, symlinked_directory,
    prepared_dataset, not_a_file)."""
    files: list[Path] = []
    prepared: list[Path] = []
    for path in sorted(root.rglob("*")):  # rglob descends into directories, not through symbolic links
        name = str(path.relative_to(root))
        if any(path.is_relative_to(p) for p in prepared):
            continue
        if path.is_dir():
            if path.is_symlink():
                skips.add("symlinked_directory", name)
            elif prepared_manifest(path) is not None:  # its shards, validation included, are not documents
                skips.add("prepared_dataset", name)
                prepared.append(path)
        elif not path.is_file():
            skips.add("not_a_file", name)
        elif path.suffix.lower() in DOCUMENT_SUFFIXES:
            files.append(path)
        else:
            skips.add("unsupported_file", name)
    return files


class ReadProgress:
    """The progress lines of reading `files` files of `total_bytes` (their sizes on disk), logged as each is
    read (add) and within a large one (within: a .jsonl file every READ_STEP_BYTES, a .parquet file at each row
    group): once reading has run READ_QUIET_S and the bytes read have reached another tenth of total_bytes
    (files when total_bytes is 0; raychat.log.TenthsProgress), e.g. "read 120/1,200 files (30% of 812.40 MB)
    in 1m02s, eta 2m25s" (the files read whole, the share of the bytes), the ETA the mean rate so far x the bytes
    left; then one line at the end (done), also for a folder read faster than READ_QUIET_S: "read 1,200 files
    (812.40 MB) in 3m27s". A folder of one 200 MB file reads "read 0/1 file (40% of 200.00 MB) in 6s, eta
    9s" while it reads it. `clock`: seconds."""

    def __init__(
        self,
        files: int,
        total_bytes: int,
        log: Callable[[str], None],
        clock: Callable[[], float] = time.perf_counter,
    ):
        self.files, self.total_bytes, self.log = files, total_bytes, log
        self.read, self.read_bytes = 0, 0
        self.pace = TenthsProgress(total_bytes or files, READ_QUIET_S, clock)

    def within(self, n_bytes: int) -> None:
        """`n_bytes` of the file being read are read: logs a line when one is due (above)."""
        if self.total_bytes:
            self.line(self.read_bytes + n_bytes)

    def add(self, n_bytes: int) -> None:
        """One more file, of `n_bytes` on disk, read: logs a line when one is due (above)."""
        self.read, self.read_bytes = self.read + 1, self.read_bytes + n_bytes
        if self.read < self.files:  # else the end line follows
            self.line(self.read_bytes if self.total_bytes else self.read)

    def line(self, done: int) -> None:
        due = self.pace.due(done)
        if due is None:
            return
        share = done / (self.total_bytes or self.files)
        elapsed, eta = due
        self.log(
            f"read {self.read:,}/{plural(self.files, 'file')} ({share:.0%} of {size(self.total_bytes)}) in "
            f"{duration(elapsed)}, eta {duration(eta)}"
        )

    def done(self) -> None:
        """The reading's last line."""
        elapsed = self.pace.elapsed()
        self.log(f"read {plural(self.files, 'file')} ({size(self.total_bytes)}) in {duration(elapsed)}")
