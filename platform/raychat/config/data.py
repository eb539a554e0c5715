"""Configurations of the data stages: `raychat data prepare` (PrepareConfig, a preset's `data` section) and
`raychat tokenizer train` (TokenizerConfig, its `tokenizer` section). raychat.data.prepare and
raychat.tokenizer_cli take their defaults from here."""

from __future__ import annotations

from dataclasses import dataclass

from raychat.config.schema import Section, option


@dataclass
class PrepareConfig(Section):
    """Corpus -> parquet text shards + manifest.json."""

    source: str = option("debian-docs", "debian-docs | fineweb-edu | climbmix | DIR")
    out: str = option("runs/data", "output directory")
    num_shards: int | None = option(
        None, "train shards (one validation shard is always added); hub sources: how many to download "
        "(default 1); local sources: instead of --rows-per-shard", ge=1,
    )  # fmt: skip
    rows_per_shard: int | None = option(
        None, "local sources: at most this many documents a shard (default 1024)", ge=1
    )
    seed: int = option(0, "shuffle seed for local sources")
    row_group_size: int = option(1024, "rows per parquet row group", ge=1)
    url_pattern: str | None = option(
        None, "hub sources: a mirror URL with {index}, e.g. http://host/shard_{index:05d}.parquet"
    )
    workers: int = option(4, "hub sources: parallel downloads", ge=1)


@dataclass
class TokenizerConfig(Section):
    """Byte-level BPE on the training shards."""

    data_dir: str = option("runs/data", "shards from `raychat data prepare`")
    out: str = option("runs/tokenizer", "output directory")
    vocab_size: int = option(4096, "total vocabulary incl. special tokens (gpu8: 65536)", ge=260)
    max_chars: int = option(2_000_000_000, "train on at most this many characters")
