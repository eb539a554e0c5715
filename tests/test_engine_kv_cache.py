"""KVCache: per-row write offsets, attention mask and positions by hand, replication, budget arithmetic."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from raychat.engine import KVBudgetError, KVCache


def filled(value: float, B: int, T: int, H: int = 1, D: int = 2) -> torch.Tensor:
    return torch.full((B, H, T, D), float(value))


def test_rows_write_at_their_own_lengths_and_mask_hides_stale_slots():
    cache = KVCache(n_layer=1, batch_size=3, n_kv_head=1, max_len=8, head_dim=2)
    cache.lengths[:] = torch.tensor([2, 0, 4])
    rows = [0, 2]  # non-adjacent rows, different lengths
    view = cache.view(rows, 1)
    k_all, v_all = view.update(
        0, torch.tensor([1.0, 2.0])[:, None, None, None].expand(2, 1, 1, 2), filled(5, 2, 1)
    )
    assert k_all.shape == (2, 1, 5, 2)  # S = max(2, 4) + 1
    assert cache.k[0, 0, 0, :, 0].tolist() == [0, 0, 1, 0, 0, 0, 0, 0]  # row 0 wrote slot 2
    assert cache.k[0, 2, 0, :, 0].tolist() == [0, 0, 0, 0, 2, 0, 0, 0]  # row 2 wrote slot 4
    assert cache.k[0, 1].abs().sum() == 0
    mask = cache.attention_mask(rows, 1)
    assert mask[:, 0, 0].tolist() == [[True, True, True, False, False], [True] * 5]
    assert cache.position_ids(rows, 1).tolist() == [[2], [4]]
    cache.advance(rows, 1)
    assert cache.lengths.tolist() == [3, 0, 5]


def test_prefill_mask_is_causal_after_history():
    cache = KVCache(1, 1, 1, 8, 2)
    cache.lengths[0] = 2
    # query t sees slots j <= 2 + t
    assert cache.attention_mask([0], 3)[0, 0].int().tolist() == [
        [1, 1, 1, 0, 0],
        [1, 1, 1, 1, 0],
        [1, 1, 1, 1, 1],
    ]
    assert cache.position_ids([0], 3).tolist() == [[2, 3, 4]]


def test_replicate_copies_history_and_length():
    cache = KVCache(2, 4, 1, 6, 2)
    cache.k[:, 0, :, :3] = 7.0
    cache.v[:, 0, :, :3] = 8.0
    cache.lengths[0] = 3
    cache.replicate(0, [1, 3])
    assert cache.lengths.tolist() == [3, 3, 0, 3]
    assert torch.equal(cache.k[:, 1], cache.k[:, 0]) and torch.equal(cache.v[:, 3], cache.v[:, 0])
    assert cache.k[:, 2].abs().sum() == 0


def test_overflow_and_bad_rows():
    cache = KVCache(1, 2, 1, 4, 2)
    cache.lengths[1] = 4
    with pytest.raises(ValueError, match="5 tokens > max_len 4"):
        cache.view([1], 1)
    with pytest.raises(IndexError, match="outside 0..1"):
        cache.view([2], 1)
    with pytest.raises(ValueError, match="max_len must be > 0"):
        KVCache(1, 1, 1, 0, 2)


def test_budget_arithmetic():
    cfg = SimpleNamespace(n_layer=12, n_kv_head=6, head_dim=128)
    # 2 * 12 * 6 * 128 * 2 bytes (bf16) = 36864 bytes per token
    assert KVCache.bytes_per_token(cfg, torch.bfloat16) == 36864
    assert KVCache.rows_for_budget(cfg, 36864 * 2048 * 3 + 1, 2048, torch.bfloat16) == 3
    with pytest.raises(KVBudgetError, match=r"at most 3 rows of 2048 tokens fit"):
        KVCache.for_model(cfg, 4, 2048, torch.bfloat16, budget_bytes=36864 * 2048 * 3 + 1)
