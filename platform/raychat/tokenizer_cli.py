"""`raychat tokenizer train`: train the BPE on the training shards and report bytes per token.

Reads --data-dir (a run under --storage-path, default `data`, or a directory) and writes
<storage-path>/<run-name>/tokenizer.json (default runs/tokenizer) or --out, holding the lease on that directory
(raychat.lease.output_lease: <out>/lease.json) from before it trains until tokenizer.json is saved."""

from __future__ import annotations

import time
from collections.abc import Iterator

import pyarrow.parquet as pq

from raychat.atomic import remove_leftovers
from raychat.checkpoint_manager import check_output_target
from raychat.config import from_args
from raychat.config.data import TokenizerConfig
from raychat.data.corpus.shards import DataError, check_text_column, list_shards, null_text_message
from raychat.lease import LEASE_FILE, LOCK_FILE, output_lease
from raychat.log import log, plural
from raychat.storage import check_writable, open_storage, output_directory, run_directory
from raychat.tokenizer import Tokenizer

TOKENIZER_OPTIONS = ("--vocab-size", "--max-chars")  # what small_vocabulary_warning names by default


def iter_texts(files: list[str], max_chars: int) -> Iterator[str]:
    """Texts of the `text` column of `files`, in order, at most max_chars characters in all (<= 0: no limit):
    the text that reaches the cap is cut to the characters left, and no text follows it.

    Raises:
        DataError: a null `text` (naming the shard and the row), which raychat data prepare never writes.
    """
    left = max_chars
    for f in files:
        pf = pq.ParquetFile(f)
        row = 0
        for rg in range(pf.num_row_groups):
            for text in pf.read_row_group(rg, columns=["text"]).column("text").to_pylist():
                if text is None:
                    raise DataError(null_text_message(f, row))
                row += 1
                if max_chars > 0 and len(text) >= left:
                    yield text[:left]
                    return
                left -= len(text)
                yield text


def bytes_per_token(tokenizer: Tokenizer, texts: list[str]) -> float:
    """UTF-8 bytes / tokens over `texts` (higher = better compression)."""
    n_bytes = sum(len(t.encode("utf-8")) for t in texts)
    n_tokens = sum(len(ids) for ids in tokenizer.encode_batch(texts, num_threads=2))
    return n_bytes / max(n_tokens, 1)


def small_vocabulary_warning(
    got: int, asked: int, chars: int, capped: bool, options: tuple[str, str] = TOKENIZER_OPTIONS
) -> str:
    """The warning of a tokenizer trained for `asked` tokens that came out with `got` (fewer) from `chars`
    characters of training text, `capped` when --max-chars cut it: what it means (BPE ran out of pairs to merge;
    the file, and the embedding of a model pretrained with it, have `got`) and what to do (more text, or ask for
    `got`), naming `options` (the options of the vocabulary and of the cap: the speedrun's preset keys)."""
    vocab_option, cap_option = options
    more = f"a {cap_option} above {chars:,}, which cut it, or " if capped else ""
    return (
        f"warning: the training text ({chars:,} characters) supports only {got:,} tokens, not the {asked:,} "
        f"asked: BPE ran out of pairs to merge (every distinct word of it is one token), so tokenizer.json has "
        f"{got:,} tokens and a model pretrained with it an embedding of {got:,} rows; for {asked:,}, train on "
        f"more text ({more}a larger, more varied corpus), or give {vocab_option} {got} to ask for what this "
        "text gives"
    )


def train_tokenizer(
    data_dir: str,
    out: str,
    vocab_size: int,
    max_chars: int = TokenizerConfig().max_chars,
    out_flag: str = "--out",
    options: tuple[str, str] = TOKENIZER_OPTIONS,
) -> dict:
    """Train on at most `max_chars` characters (<= 0: all) of the training shards of `data_dir`, in order, the
    document that reaches the cap cut there (iter_texts), saying so in a line first (BPE training prints
    nothing until it ends); save to `out` (the leftovers of killed writes there
    removed first: raychat.atomic.remove_leftovers); returns the report dict. Holds the lease on `out`
    (output_lease; a refusal says to use another `out_flag`) from before it trains until it has saved. A text
    that supports fewer than `vocab_size` tokens gives a smaller tokenizer, with a warning
    (small_vocabulary_warning, naming `options`: the options of the vocabulary and of max_chars).

    Raises:
        DataError: a shard whose `text` is not strings or holds a null (check_text_column: naming the shard
            and the row), before any work.
        raychat.lease.LeaseHeld (a ValueError): another live run writes `out` (one line: its lease, the holder
            and what to do), before any work.
    """
    train_files, val_file = list_shards(data_dir)
    for shard in [*train_files, val_file]:
        check_text_column(shard)
    with output_lease(out, out_flag):
        remove_leftovers(
            out
        )  # of a run that was killed while saving (a live run's are not: it holds the lease)
        limit = f"at most {max_chars:,} characters" if max_chars > 0 else "all the text"
        log(
            f"training the tokenizer (vocabulary {vocab_size}) on {limit} of "
            f"{plural(len(train_files), 'train shard')} in {data_dir} ..."
        )
        chars = 0

        def texts() -> Iterator[str]:
            nonlocal chars
            for text in iter_texts(train_files, max_chars):
                chars += len(text)
                yield text

        t0 = time.perf_counter()
        tokenizer = Tokenizer.train(texts(), vocab_size)
        seconds = time.perf_counter() - t0
        if tokenizer.vocab_size < vocab_size:
            capped = 0 < max_chars <= chars
            log(small_vocabulary_warning(tokenizer.vocab_size, vocab_size, chars, capped, options))
        path = tokenizer.save(out)
    sample = list(iter_texts(train_files, 5_000_000))
    val = list(iter_texts([val_file], 5_000_000))
    report = {
        "path": str(path),
        "vocab_size": tokenizer.vocab_size,
        "version": tokenizer.version,
        "train_seconds": round(seconds, 2),
        "train_bytes_per_token": round(bytes_per_token(tokenizer, sample), 3),
        "val_bytes_per_token": round(bytes_per_token(tokenizer, val), 3),
    }
    log(
        f"tokenizer: vocab {report['vocab_size']} version {report['version']} trained in {seconds:.1f}s; "
        f"bytes/token train {report['train_bytes_per_token']} val {report['val_bytes_per_token']} -> {path}"
    )
    return report


def is_raychat_tokenizer(directory: str) -> bool:
    """Whether Tokenizer.load reads directory/tokenizer.json."""
    try:
        Tokenizer.load(directory)
    except (OSError, ValueError):
        return False
    return True


def is_earlier_tokenizer(directory: str, names: list[str]) -> bool:
    """Whether a directory holding the files `names` (its leftovers aside) is an earlier tokenizer's: a raychat
    tokenizer.json, its lease (LEASE_FILE: a live run's, or a killed one's) and the lease's lock file
    (LOCK_FILE: left by a run killed while it held the lock) aside."""
    names = [n for n in names if n not in (LEASE_FILE, LOCK_FILE)]
    return not names or (names == ["tokenizer.json"] and is_raychat_tokenizer(directory))


def main(args) -> int:
    """`raychat tokenizer train` (its parser: raychat.commands.tokenizer).

    Raises ValueError naming the flag: --data-dir holds no prepared data, or a shard whose `text` column is
    not strings or holds a null (naming the shard and the row: raychat data prepare writes neither); the
    output is on object storage, lies through a symbolic link out of the storage root, cannot be written, or
    holds anything but an earlier tokenizer (a raychat tokenizer.json alone) or nothing, the leftovers of a
    killed write and a lease aside (removed before the new tokenizer.json is saved): a checkpoint, a training
    run's checkpoints, prepared data, other files (--out or --run-name); raychat.lease.LeaseHeld: another
    live run writes the output (train_tokenizer). Nothing is written before."""
    c = from_args(args, TokenizerConfig, "tokenizer", where="tokenizer settings")
    data_dir = run_directory(c.data_dir, c.storage_path, "--data-dir")
    try:  # a missing or unfinished data directory, or a shard raychat did not write: fails before any work
        train_files, val_file = list_shards(data_dir)
        for shard in [*train_files, val_file]:
            check_text_column(shard)
    except (OSError, ValueError) as e:
        raise ValueError(f"--data-dir: {e}") from e
    out, flag = output_directory(c.out, c.storage_path, c.run_name)
    out_flag = "--out" if c.out else "--run-name"
    check_output_target(
        open_storage(out),
        out,
        out_flag,
        "a tokenizer",
        "an earlier tokenizer",
        lambda entries, killed: is_earlier_tokenizer(out, [e.base_name for e in entries]),
    )
    check_writable(open_storage(out, flag), flag)
    train_tokenizer(data_dir, out, c.vocab_size, c.max_chars, out_flag)
    return 0
