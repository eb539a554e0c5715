"""Data: corpora -> parquet shards -> tokens -> packed rows."""
