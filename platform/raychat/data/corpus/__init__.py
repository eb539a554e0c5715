"""Corpus preparation: raw text -> parquet text shards + manifest (download, corpora, cleaning, shards)."""
