"""Configurations of the data stages: `raychat data prepare` (PrepareConfig, a preset's `data` section) and
`raychat tokenizer train` (TokenizerConfig, its `tokenizer` section). raychat.data.corpus.prepare and
raychat.tokenizer_cli take their defaults from here.

Both write <storage-path>/<run-name> (default runs/data and runs/tokenizer, as the speedrun's layout) unless
--out names another directory; the tokenizer reads --data-dir, a directory or a run under the same root.
These are directories on a filesystem every node mounts (local or NFS): the training workers read them.
"""

from __future__ import annotations

from dataclasses import dataclass

from raychat.config.schema import SEED_MAX, Section, option, owned_literal


@dataclass
class PrepareConfig(Section):
    """Corpus -> parquet text shards + manifest.json."""

    source: str = option("debian-docs", "debian-docs | fineweb-edu | climbmix | DIR")
    storage_path: str = option("runs", "storage root (a local or NFS directory) the shards go under")
    run_name: str = option("data", "run name: the shards go to <storage-path>/<run-name>", kind="run_name")
    out: str | None = option(None, "output directory; not given: <storage-path>/<run-name>")
    num_shards: int | None = option(
        None, "train shards (one validation shard is always added); hub sources: how many to download; "
        "local sources: instead of --rows-per-shard; not given: 1 for a hub source, and for a local one as "
        "many as --rows-per-shard needs", ge=1,
    )  # fmt: skip
    rows_per_shard: int | None = option(
        None, "local sources: at most this many documents a shard; not given: 1024", ge=1
    )
    seed: int = option(0, "local sources: shuffle seed", ge=0, le=SEED_MAX)
    row_group_size: int = option(1024, "local sources: rows per parquet row group", ge=1)
    url_pattern: str | None = option(
        None,
        "hub sources: a mirror URL with {index}, e.g. http://host/shard_{index:05d}.parquet; not "
        "given: the source's own URL",
    )
    text_field: str | None = option(
        None, "a --source DIR only: the .jsonl field and .parquet column that hold each document (.txt, .md "
        "and .rst files are read whole); not given: text",
    )  # fmt: skip
    workers: int | None = option(
        None, "hub sources only: parallel downloads; not given: "
        f"{owned_literal('raychat.data.corpus.download', 'DOWNLOAD_WORKERS')}", ge=1,
    )  # fmt: skip

    def output_dir(self) -> str:
        return self.out or f"{self.storage_path.rstrip('/')}/{self.run_name}"


@dataclass
class TokenizerConfig(Section):
    """Byte-level BPE on the training shards."""

    storage_path: str = option("runs", "storage root (a local or NFS directory)")
    run_name: str = option(
        "tokenizer", "run name: tokenizer.json goes to <storage-path>/<run-name>", kind="run_name"
    )
    data_dir: str = option(
        "runs/data", "shards from `raychat data prepare`: a directory or a run name under --storage-path "
        "(given --storage-path and not this: the run 'data' there)",
    )  # fmt: skip
    out: str | None = option(None, "output directory; not given: <storage-path>/<run-name>")
    vocab_size: int = option(
        4096, "total vocabulary incl. special tokens (gpu8: 65536), 265 (256 bytes + 9 specials) to 2**20",
        ge=265, le=2**20,  # raychat.tokenizer.MIN_VOCAB_SIZE; test_config checks that they agree
    )  # fmt: skip
    max_chars: int = option(
        2_000_000_000,
        "train on at most this many characters of the training shards, in order: the document that reaches "
        "the cap is cut there (<= 0: no limit)",
    )

    def output_dir(self) -> str:
        return self.out or f"{self.storage_path.rstrip('/')}/{self.run_name}"
