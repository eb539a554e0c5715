"""The training dataloader: shards / task mixtures -> tokenized, packed T+1 rows (Ray Data pipeline, packing, cursor)."""
