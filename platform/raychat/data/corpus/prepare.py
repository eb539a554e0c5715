"""`raychat data prepare`: a corpus -> parquet text shards + manifest.json (the first stage of the data flow).

  debian-docs | DIR   load documents (corpora) -> shuffle (random.Random(seed)) -> cut into K near-equal
                      shards, the last one validation (shards.write_shards) -> manifest.json
  fineweb-edu | climbmix
                      download the first N hub shards + the pinned validation shard (download) -> check
                      each -> manifest.json (hub shards are kept byte for byte: already shuffled upstream)

The manifest is written last and the previous one is removed first, so `shards.list_shards(out)` only ever
sees a finished directory. Once it is written, every shard file in the directory that it does not list is
deleted (remove_stale_shards): those of a previous manifest, or of a run killed before writing its own
(only in a directory that was prepare's when the run started: holds_earlier_data).

A run holds the lease on its output (raychat.lease.output_lease: <out>/lease.json) from before it removes the
manifest until it has written the new one: a second run into the same directory at once is refused in one line
naming the holder, before it touches anything; a dead holder's lease is taken over.
"""

from __future__ import annotations

import math
import random
import sys
from pathlib import Path

import numpy as np
import pyarrow.fs as pafs

from raychat.atomic import is_leftover, remove_leftovers
from raychat.checkpoint_manager import check_output_target
from raychat.config import from_args, to_flat
from raychat.config.data import PrepareConfig
from raychat.data.corpus import corpora
from raychat.data.corpus.download import (
    HUB_SOURCES,
    DownloadError,
    check_url_pattern,
    download_shards,
    shard_indices,
)
from raychat.data.corpus.shards import (
    COMPRESSION,
    FORMAT,
    MANIFEST,
    DataError,
    inspect_shard,
    is_shard_name,
    prepared_manifest,
    shard_entry,
    split_evenly,
    write_manifest,
    write_shards,
)
from raychat.lease import LEASE_FILE, LOCK_FILE, output_lease
from raychat.log import log, plural, size
from raychat.storage import check_writable, open_storage, output_directory

_DEFAULTS = PrepareConfig()  # the defaults of `raychat data prepare` and prepare()
DEFAULT_SOURCE = _DEFAULTS.source
DEFAULT_OUT = _DEFAULTS.output_dir()
DEFAULT_ROWS_PER_SHARD = 1024
DEFAULT_HUB_SHARDS = 1
# A local corpus's validation shard is warned about (never resized: the cut is the manifest's) when it holds
# more than this share of the documents or of the text (2 shards: a half; the default 1024 rows a shard
# gives the default corpus 6 shards: a sixth) ...
VALIDATION_MAX_SHARE = 0.2
# ... or less text than this. A judgment, not a measurement: below it the validation BPB of one checkpoint
# moves with which documents the cut happened to hold.
VALIDATION_MIN_BYTES = 100_000


def is_earlier_data(out: Path, entries: list) -> bool:
    """Whether `out`, whose entries (pafs.FileInfo, its leftovers aside: check_output_target) are given, is
    prepare's: it holds a manifest prepare wrote, or only shard files (a run that stopped between removing the
    old manifest and writing the new one), its lease (LEASE_FILE: a live run's, or a killed one's) and the
    lease's lock file (LOCK_FILE: left by a run killed while it held the lock) aside."""
    return prepared_manifest(out) is not None or all(
        e.type == pafs.FileType.File
        and (is_shard_name(e.base_name) or e.base_name in (LEASE_FILE, LOCK_FILE))
        for e in entries
    )


def holds_earlier_data(out: Path) -> bool:
    """Whether the local `out` is missing, empty or is_earlier_data (its leftovers aside): a directory whose
    unlisted shard files prepare may delete (remove_stale_shards). prepare() called on another directory (the
    CLI refuses one: prepare_kwargs) deletes nothing there; False where `out` cannot be listed (a file: the
    write's own check names it)."""
    selector = pafs.FileSelector(str(out.absolute()), allow_not_found=True)
    try:
        entries = pafs.LocalFileSystem().get_file_info(selector)
    except OSError:
        return False
    return is_earlier_data(out, [e for e in entries if not is_leftover(e.base_name)])


def check_shard_options(num_shards: int | None, rows_per_shard: int | None) -> None:
    """The shard options of a local source, checked before its corpus is loaded.

    Raises:
        ValueError: both given, or a value < 1 (naming the flag).
    """
    if num_shards is not None and rows_per_shard is not None:
        raise ValueError("give --num-shards or --rows-per-shard for a local source, not both")
    if num_shards is not None and num_shards < 1:
        raise ValueError(
            f"--num-shards must be >= 1 (train shards; one validation shard is added), got {num_shards}"
        )
    if rows_per_shard is not None and rows_per_shard < 1:
        raise ValueError(f"--rows-per-shard must be >= 1, got {rows_per_shard}")


def count_shards(documents: int, num_shards: int | None, rows_per_shard: int | None) -> int:
    """Total shards (train + 1 validation) for a local corpus.

    num_shards given: num_shards train shards + 1 validation shard. Otherwise
    max(2, ceil(documents / rows_per_shard)) shards, so no shard holds more than rows_per_shard documents.
    Raises:
        ValueError: both or a non-positive value given (check_shard_options), or fewer documents than
            shards.
    """
    check_shard_options(num_shards, rows_per_shard)
    total = (
        num_shards + 1
        if num_shards
        else max(2, math.ceil(documents / (rows_per_shard or DEFAULT_ROWS_PER_SHARD)))
    )
    if documents < total:
        are = "is" if documents == 1 else "are"
        fix = f"; give --num-shards {documents - 1} at most" if num_shards and documents >= 2 else ""
        raise ValueError(
            f"{plural(documents, 'document')} {are} too few for {total} shards (train + validation: one "
            f"document at least each){fix}"
        )
    return total


def split_line(n_documents: int, n_shards: int, seed: int) -> str:
    """The line that announces a local corpus's cut of `n_documents` documents into `n_shards` shards
    (count_shards), the last the validation one (write_shards: split_evenly), with the share held out of
    training, e.g. "shuffling 37 documents (seed 0) into 2 shards: 1 train of 19 documents + 1 validation of
    18 documents (49%, held out of training)"; a train count that varies by shard reads "5 train of 983-984
    documents"; a share under 1% has one significant digit (0.2%)."""
    sizes = [end - start for start, end in split_evenly(n_documents, n_shards)]
    train, val = sizes[:-1], sizes[-1]
    each = plural(max(train), "document")
    if min(train) != max(train):
        each = f"{min(train):,}-{each}"
    share = 100 * val / n_documents
    share_text = f"{share:.0f}%" if share >= 1 else f"{share:.1g}%"  # 0.2%, not 0%
    return (
        f"shuffling {plural(n_documents, 'document')} (seed {seed}) into {n_shards} shards: {n_shards - 1} "
        f"train of {each} + 1 validation of {plural(val, 'document')} ({share_text}, held out of training)"
    )


def skipped_summary(skips: corpora.Skips) -> str:
    """'skipped 3 documents (empty: 1 (e.g. a.txt); invalid_utf8: 2 (e.g. b.txt, c.txt))': by reason, with
    examples."""
    reasons = "; ".join(
        f"{reason}: {n} (e.g. {', '.join(skips.examples.get(reason, []))})"
        for reason, n in sorted(skips.counts.items())
    )
    return f"skipped {plural(skips.total, 'document')} ({reasons})"


def no_documents(source: str, skips: corpora.Skips, text_field: str = corpora.TEXT_FIELD) -> str:
    """The error for a source that gave no document: what was skipped, by reason, with examples, and where
    .jsonl lines lacked `text_field`, the flag that reads another field."""
    if not skips.total:
        return (
            f"--source {source}: no usable documents: it holds no text (documents are .txt, .md and .rst "
            "files, .jsonl lines and .parquet rows)"
        )
    return f"--source {source}: no usable documents: {skipped_summary(skips)}{text_field_hint(skips, text_field)}"


def text_field_hint(skips: corpora.Skips, text_field: str) -> str:
    """'; a .jsonl line's document is its 'text' field: give --text-field ...' where lines lacked it, else ''."""
    if not skips.counts.get("no_text_field"):
        return ""
    return f"; a .jsonl line's document is its {text_field!r} field: give --text-field with the field that holds it"


SHARD_OPTIONS = (
    "--num-shards, or a smaller --rows-per-shard"  # what makes more shards, as `data prepare` names it
)


def validation_warnings(entries: list[dict], shard_options: str = SHARD_OPTIONS) -> list[str]:
    """Warnings about the validation shard (the last of `entries`, write_shards's) of a local corpus: it
    holds more than VALIDATION_MAX_SHARE of the documents or of the text (naming shard_options, what gives more
    shards), or less than VALIDATION_MIN_BYTES of text. None when it is neither."""
    val = entries[-1]
    documents = sum(e["documents"] for e in entries)
    text = sum(e["bytes"] for e in entries)
    doc_share = val["documents"] / documents
    byte_share = val["bytes"] / text if text else 0.0
    warnings = []
    if doc_share > VALIDATION_MAX_SHARE or byte_share > VALIDATION_MAX_SHARE:
        warnings.append(
            f"warning: the validation shard {val['file']} holds {val['documents']:,} of {documents:,} documents "
            f"({doc_share:.0%}) and {size(val['bytes'])} of {size(text)} of text ({byte_share:.0%}), held out "
            f"of training: more shards ({shard_options}) hold out less"
        )
    if val["bytes"] < VALIDATION_MIN_BYTES:
        warnings.append(
            f"warning: the validation shard {val['file']} holds only {size(val['bytes'])} of text "
            f"({plural(val['documents'], 'document')}): a validation loss measured on less than "
            f"{size(VALIDATION_MIN_BYTES)} is noise; a larger corpus gives a larger one"
        )
    return warnings


def load_corpus(
    source: str, out: Path, log, out_flag: str = "--out", text_field: str = corpora.TEXT_FIELD
) -> corpora.Corpus:
    if not source.strip():
        raise ValueError(f"--source: empty; give debian-docs, {', '.join(HUB_SOURCES)} or a directory")
    if source == "debian-docs":
        log("loading the default corpus: Debian python3.11-doc (reST, cleaned) + wordnet-base glosses")
        return corpora.debian_docs()
    folder = Path(source).expanduser()
    if not folder.is_dir():  # before the "loading" line: a mistyped source name is not a folder being read
        what = "a file" if folder.is_file() else "no such directory"
        raise ValueError(
            f"--source {source}: {what}; give debian-docs, {', '.join(HUB_SOURCES)} or a directory of documents"
        )
    if out.resolve().is_relative_to(folder.resolve()):
        raise ValueError(
            f"the output {out} ({out_flag}) lies inside --source {source}: the shards would be read as input "
            "next time"
        )
    log(f"loading documents from folder {folder}")
    return corpora.local_folder(folder, text_field, log)


def prepare_corpus(
    corpus: corpora.Corpus,
    out: Path,
    num_shards,
    rows_per_shard,
    seed,
    row_group_size,
    log,
    text_field=None,
    shard_options: str = SHARD_OPTIONS,
) -> dict:
    n = len(corpus.documents)
    total = count_shards(n, num_shards, rows_per_shard)
    log(split_line(n, total, seed))
    order = list(range(n))  # shuffled as the documents themselves were: the same seed gives the same shards
    random.Random(seed).shuffle(order)
    order = np.array(order, np.int64)  # 8 bytes a document, not a Python int's 36
    entries = write_shards(corpus.documents, out, total, row_group_size, log, order=order)
    for warning in validation_warnings(entries, shard_options):
        log(warning)
    return {
        "format": FORMAT,
        "source": corpus.source,
        "license": corpus.license,
        "components": corpus.components,
        **({"text_field": text_field} if text_field is not None else {}),
        "seed": seed,
        "shuffle": "random.Random(seed).shuffle over all documents before sharding",
        "compression": COMPRESSION,
        "row_group_size": row_group_size,
        "documents": sum(e["documents"] for e in entries),
        "bytes": sum(e["bytes"] for e in entries),
        "skipped": dict(sorted(corpus.skips.counts.items())),
        "skipped_examples": dict(sorted(corpus.skips.examples.items())),
        "validation_shard": entries[-1]["file"],
        "shards": entries,
    }


def prepare_hub(name, out: Path, num_shards, url_pattern, old: dict | None, download_opts: dict, log) -> dict:
    hub = HUB_SOURCES[name]
    pattern = url_pattern or hub.url_pattern
    indices = shard_indices(num_shards, hub.val_index)
    log(
        f"downloading {len(indices) - 1} train shards + validation shard {hub.val_index} of {name} from {pattern}"
    )
    known = {}
    if old and old.get("url_pattern") == pattern:
        known = {s["file"]: s["sha256"] for s in old.get("shards", [])}
    paths = download_shards(pattern, indices, out, known_sha256=known, log=log, **download_opts)
    entries = []
    for i, path in enumerate(paths):
        documents, text_bytes = inspect_shard(path)
        split = "val" if i == len(paths) - 1 else "train"
        entries.append(
            shard_entry(path, split, documents, text_bytes) | {"url": pattern.format(index=indices[i])}
        )
    return {
        "format": FORMAT,
        "source": name,
        "license": hub.license,
        "card": hub.card,
        "url_pattern": pattern,
        "seed": None,
        "shuffle": "upstream (the hub shards are pre-shuffled and kept byte for byte)",
        "documents": sum(e["documents"] for e in entries),
        "bytes": sum(e["bytes"] for e in entries),
        "skipped": {},
        "skipped_examples": {},
        "validation_shard": entries[-1]["file"],
        "shards": entries,
    }


def prepare(
    source: str = _DEFAULTS.source,
    out: str | Path = DEFAULT_OUT,
    num_shards: int | None = _DEFAULTS.num_shards,
    rows_per_shard: int | None = _DEFAULTS.rows_per_shard,
    seed: int = _DEFAULTS.seed,
    row_group_size: int = _DEFAULTS.row_group_size,
    url_pattern: str | None = _DEFAULTS.url_pattern,
    workers: int | None = _DEFAULTS.workers,
    text_field: str | None = _DEFAULTS.text_field,
    attempts: int = 5,
    backoff_s: float = 1.0,
    out_flag: str = "--out",
    log=log,
    shard_options: str = SHARD_OPTIONS,
) -> dict:
    """Prepare a data directory of parquet text shards; returns the manifest (also written to out/manifest.json).

    Args:
        source: "debian-docs" (default corpus), "fineweb-edu" or "climbmix" (hub downloads), or a folder of
            .txt/.md/.rst/.jsonl/.parquet files.
        out: the data directory.
        num_shards: local sources: train shards (a validation shard is added). Hub sources: train shards to
            download (default 1; the pinned validation shard is added).
        rows_per_shard: local sources only: the most documents a shard holds (default 1024) when num_shards
            is not given.
        seed: the shuffle seed (local sources; a hub source refuses one other than the default).
        row_group_size: rows per parquet row group (local sources; a hub source refuses one other than the
            default).
        url_pattern: hub sources only: a mirror's URL pattern with an {index} field.
        text_field: a folder source only: the .jsonl field and .parquet column holding each document
            (None: "text"); recorded in the manifest when given.
        workers, attempts, backoff_s: hub sources: parallel downloads (None: download_shards' default), tries
            per shard, first retry delay (s). A local source refuses workers (it is read in this process).
        out_flag: the flag an error about `out` names.
        shard_options: what the warning about a large validation share names to make more shards (the
            speedrun's: its preset's keys, "data.num_shards, or a smaller data.rows_per_shard").
    Nothing is created before the arguments and a local source are checked; the shard options of a local
    source are checked before it is loaded. A local corpus's validation shard that holds a large share of it
    or little text is a warning in the log (validation_warnings); the cut stays as it is.
    Raises:
        ValueError: bad arguments (the message names the flag), `out` cannot be written (names out_flag);
        raychat.lease.LeaseHeld (a ValueError): another live run writes `out` (one line: its lease, the holder
            and what to do), raised once the input is checked, before anything in `out` changes;
        DataError: unreadable input (names the file), a local source with no usable document (no_documents:
            the skips by reason) or too few for its shards (count_shards, with the skips by reason);
        corpora.CorpusNotInstalled: a Debian package is missing; DownloadError: a shard could not be fetched;
        KeyboardInterrupt (Ctrl-C) once `out` is being written: its message says that `out` holds no finished
            data and to run the command again (the lease is released; a local source's shards left are
            removed then, a hub source's downloaded whole are reused: download_shards).
    """
    out = Path(out)
    if row_group_size < 1:
        raise ValueError(f"--row-group-size must be >= 1, got {row_group_size}")
    if text_field is not None and (source in HUB_SOURCES or source == "debian-docs"):
        raise ValueError(
            f"--text-field applies to a --source DIR (its .jsonl and .parquet files), not to --source {source}"
        )
    if source in HUB_SOURCES:
        for flag, value, default in (
            ("--rows-per-shard", rows_per_shard, _DEFAULTS.rows_per_shard),
            ("--seed", seed, _DEFAULTS.seed),
            ("--row-group-size", row_group_size, _DEFAULTS.row_group_size),
        ):
            if value != default:
                raise ValueError(f"{flag} applies to local sources only: hub shards are kept as downloaded")
        num = DEFAULT_HUB_SHARDS if num_shards is None else num_shards
        val_index = HUB_SOURCES[source].val_index
        if not 1 <= num <= val_index:  # fail before touching `out`
            raise ValueError(
                f"--num-shards must be in [1, {val_index}] for --source {source} (its train shards come before "
                f"its validation shard {val_index}), got {num}"
            )
        if url_pattern is not None:
            check_url_pattern(url_pattern)
        download_opts = {"attempts": attempts, "backoff_s": backoff_s}
        if workers is not None:
            download_opts["workers"] = workers

        def write(old: dict | None) -> dict:
            return prepare_hub(source, out, num, url_pattern, old, download_opts, log)
    else:
        for flag, value in (("--url-pattern", url_pattern), ("--workers", workers)):
            if value is not None:
                raise ValueError(
                    f"{flag} applies to hub sources only ({', '.join(HUB_SOURCES)}), not to --source {source}"
                )
        check_shard_options(num_shards, rows_per_shard)  # before the corpus is loaded
        field = corpora.TEXT_FIELD if text_field is None else text_field
        corpus = load_corpus(source, out, log, out_flag, field)
        if len(corpus.documents) == 0:
            raise DataError(no_documents(source, corpus.skips, field))
        try:  # fail before touching `out`
            count_shards(len(corpus.documents), num_shards, rows_per_shard)
        except ValueError as e:  # too few documents: say what was skipped, as no_documents does
            skipped = f"; {skipped_summary(corpus.skips)}" if corpus.skips.total else ""
            hint = text_field_hint(corpus.skips, field)
            if corpus.whole_files:  # e.g. one large .txt file, which is one document
                hint += (
                    f"; a .txt, .md or .rst file is one document, whole ({plural(corpus.whole_files, 'file')} "
                    'here): split a large one into a file a document, or into a .jsonl of a {"text": ...} a line'
                )
            raise DataError(f"--source {source}: {e}{skipped}{hint}") from e

        def write(old: dict | None) -> dict:
            return prepare_corpus(
                corpus, out, num_shards, rows_per_shard, seed, row_group_size, log, text_field, shard_options
            )

    check_writable(open_storage(out, out_flag), out_flag)
    with output_lease(out, "--run-name" if out_flag == "--storage-path" else out_flag):
        old = prepared_manifest(out)
        ours = holds_earlier_data(out)  # before anything but the lease is written
        (out / MANIFEST).unlink(
            missing_ok=True
        )  # no reader takes the directory for finished until the new one
        remove_leftovers(out)  # of a run that was killed (a live run's are not: it holds the lease)
        try:
            manifest = write(old)
            write_manifest(out, manifest)
        except KeyboardInterrupt:  # Ctrl-C: say what the directory holds now
            removed = ": the earlier one was removed as the run started" if old is not None else ""
            again = (
                "which downloads only the shards not yet downloaded whole"
                if source in HUB_SOURCES
                else "which prepares it from the start"
            )
            raise KeyboardInterrupt(
                f"{out} holds no finished data now (no {MANIFEST}{removed}); run the same command again, {again}"
            ) from None
        stale = remove_stale_shards(out, manifest) if ours else []
    if stale:
        shown = ", ".join(stale[: corpora.EXAMPLES_PER_REASON]) + (
            ", ..." if len(stale) > corpora.EXAMPLES_PER_REASON else ""
        )
        log(f"removed {plural(len(stale), 'earlier shard')} that {MANIFEST} does not list ({shown})")
    report(out, manifest, log)
    return manifest


def remove_stale_shards(out: Path, manifest: dict) -> list[str]:
    """Delete the shard files directly in `out` (names shard_name gives, is_shard_name) that `manifest`, the
    one just written there, does not list: an earlier run's extra shards, whether its manifest listed them or
    the run was killed before writing one. Called once the manifest is written, so a file it lists is never
    deleted and a run killed before it leaves the earlier shards for the next run to remove. Returns their
    names, sorted."""
    keep = {s["file"] for s in manifest["shards"]}
    stale = sorted(
        p.name for p in out.iterdir() if is_shard_name(p.name) and p.name not in keep and not p.is_dir()
    )
    for name in stale:
        (out / name).unlink(missing_ok=True)
    return stale


def report(out: Path, manifest: dict, log) -> None:
    shards = manifest["shards"]
    on_disk = sum(s["file_bytes"] for s in shards)
    log(
        f"prepared {out}: {plural(manifest['documents'], 'document')}, {size(manifest['bytes'])} of text, "
        f"{plural(len(shards), 'shard')} ({len(shards) - 1:,} train + validation {manifest['validation_shard']}), "
        f"{size(on_disk)} on disk; source {manifest['source']} ({manifest['license']})"
    )
    skipped = manifest["skipped"]
    if skipped:
        log(f"skipped {plural(sum(skipped.values()), 'document')}:")
        for reason, n in skipped.items():
            log(f"  {reason}: {n:,}  (e.g. {', '.join(manifest['skipped_examples'].get(reason, []))})")
    else:
        log("skipped 0 documents")
    if skipped.get("no_text_field"):  # a mistyped --text-field, or one not given, still prepares the rest
        field = manifest.get("text_field", corpora.TEXT_FIELD)
        log(
            f"warning: {plural(skipped['no_text_field'], '.jsonl line')} without a {field!r} string field "
            "were skipped: where documents are under another field, give --text-field with the field that holds it"
        )


def prepare_kwargs(config: PrepareConfig) -> dict:
    """prepare()'s arguments for a PrepareConfig: its options, with `out` = the output directory and `out_flag`
    the flag that names it. Writes nothing (prepare checks that `out` can be written, once its input is good).

    Raises ValueError naming the flag: the output is on object storage or lies through a symbolic link out of
    the storage root; it is neither empty nor an earlier data directory (is_earlier_data): a checkpoint, a
    training run's checkpoints, a tokenizer, other files (--out or --run-name)."""
    out, flag = output_directory(config.out, config.storage_path, config.run_name)
    check_output_target(
        open_storage(out),
        out,
        "--out" if config.out else "--run-name",
        "prepared data",
        "an earlier data directory",
        lambda entries, killed: is_earlier_data(Path(out), entries),
    )
    values = {k: v for k, v in to_flat(config).items() if k not in ("storage_path", "run_name")}
    return {**values, "out": out, "out_flag": flag}


def run(args) -> int:
    """Exit 2 for bad input (as every command), 4 when a hub shard cannot be downloaded."""
    try:
        prepare(**prepare_kwargs(from_args(args, PrepareConfig, "data", where="data settings")))
    except (ValueError, FileNotFoundError) as e:  # DataError and CorpusNotInstalled are ValueErrors
        print(f"raychat data prepare: error: {e}", file=sys.stderr)
        return 2
    except DownloadError as e:
        print(f"raychat data prepare: error: {e}", file=sys.stderr)
        return 4
    return 0
