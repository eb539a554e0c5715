"""Data: corpora -> parquet shards, tokenization, packing, the row sources training reads, replay."""
