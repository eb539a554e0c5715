"""KVCache and attention.CacheBatch: per-row write offsets, every attention plan against the dense-mask
reference, compaction, replication, budget arithmetic."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from raychat.engine import KVBudgetError, KVCache


def filled(value: float, B: int, T: int, H: int = 1, D: int = 2) -> torch.Tensor:
    return torch.full((B, H, T, D), float(value))


def test_rows_write_at_their_own_lengths_only_new_tokens():
    cache = KVCache(n_layer=1, batch_size=3, n_kv_head=1, max_len=8, head_dim=2)
    cache.lengths[:] = torch.tensor([2, 4, 0])
    batch = cache.batch(0, 2, 1)  # rows 0 and 1, different lengths
    assert batch.plan == "lengths" and batch.S == 5  # S = max(2, 4) + 1
    assert batch.position_ids.tolist() == [[2], [4]]
    k = torch.tensor([1.0, 2.0])[:, None, None, None].expand(2, 1, 1, 2)
    batch.attend(0, filled(0, 2, 1), k, filled(5, 2, 1))
    assert cache.k[0, 0, 0, :, 0].tolist() == [0, 0, 1, 0, 0, 0, 0, 0]  # row 0 wrote slot 2
    assert cache.k[0, 1, 0, :, 0].tolist() == [0, 0, 0, 0, 2, 0, 0, 0]  # row 1 wrote slot 4
    assert cache.k[0, 2].abs().sum() == 0 and cache.v[0, :2, 0, :, 0].sum() == 5 * 2
    mask = cache.attention_mask([0, 1], 1)
    assert mask[:, 0, 0].tolist() == [[True, True, True, False, False], [True] * 5]
    cache.advance([0, 1], 1)
    assert cache.lengths.tolist() == [3, 5, 0]


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


@pytest.mark.parametrize(
    "starts, T, plan, backend",
    [
        ([0, 0, 0], 5, "causal", "dense"),  # fresh prompts (right padding only hides padded queries)
        ([3, 3, 3], 4, "lower_right", "dense"),  # a later prefill chunk of equal-offset rows
        ([6, 6, 6], 1, "full", "dense"),  # decode, equal lengths: no mask
        ([3, 9, 0], 1, "lengths", "dense"),  # decode, different lengths
        ([3, 9, 0], 4, "lengths", "dense"),  # chunks at different offsets
        ([3, 9, 0], 1, "lengths", "flex"),  # FlexAttention (eager reference on CPU)
        ([3, 9, 0], 3, "lengths", "flex"),
        ([3, 9, 0], 1, "static", "dense"),  # compiled-decode shapes: S = max_len
    ],
)
def test_every_plan_equals_the_dense_mask_reference(starts, T, plan, backend):
    """GQA (4 query heads, 2 kv heads); rows 1..3 of a 5-row cache whose other rows hold junk."""
    torch.manual_seed(0)
    L, B, Hq, Hkv, D, max_len = 2, 3, 4, 2, 8, 16
    cache = KVCache(L, 5, Hkv, max_len, D)
    cache.k.normal_()
    cache.v.normal_()
    cache.lengths[1:4] = torch.tensor(starts)
    history_k, history_v = cache.k.clone(), cache.v.clone()
    batch = cache.batch(1, B, T, backend=backend, static=plan == "static")
    assert batch.plan == plan
    q, k, v = torch.randn(B, Hq, T, D), torch.randn(B, Hkv, T, D), torch.randn(B, Hkv, T, D)
    y = batch.attend(1, q, k, v)
    # reference: the history plus the new tokens, attended with the dense mask j <= starts[b] + t
    S = max(starts) + T
    ref_k, ref_v = history_k[1, 1:4, :, :S].clone(), history_v[1, 1:4, :, :S].clone()
    for b, s in enumerate(starts):
        ref_k[b, :, s : s + T], ref_v[b, :, s : s + T] = k[b], v[b]
    mask = cache.attention_mask([1, 2, 3], T)
    ref = F.scaled_dot_product_attention(q, ref_k, ref_v, attn_mask=mask, enable_gqa=True)
    torch.testing.assert_close(y, ref, atol=1e-5, rtol=1e-5)
    # only the new tokens were written: everything else (other rows, other layer, other slots) unchanged
    written = torch.zeros_like(cache.k, dtype=torch.bool)
    for b, s in enumerate(starts):
        written[1, 1 + b, :, s : s + T] = True
    assert torch.equal(cache.k[~written], history_k[~written])
    assert torch.equal(cache.v[~written], history_v[~written])


def test_plan_static_needs_one_token_and_overflow_and_bad_rows():
    cache = KVCache(1, 2, 1, 4, 2)
    cache.lengths[1] = 4
    with pytest.raises(ValueError, match="5 tokens > max_len 4"):
        cache.batch(1, 1, 1)
    with pytest.raises(ValueError, match=r"rows 2..2 outside the cache's 0..1"):
        cache.batch(2, 1, 1)
    with pytest.raises(ValueError, match="one token per row, got T=2"):
        cache.batch(0, 1, 2, static=True)
    with pytest.raises(ValueError, match="max_len must be > 0"):
        KVCache(1, 1, 1, 0, 2)


def test_replicate_copies_history_and_length():
    cache = KVCache(2, 4, 1, 6, 2)
    cache.k[:, 0, :, :3] = 7.0
    cache.v[:, 0, :, :3] = 8.0
    cache.lengths[0] = 3
    cache.replicate(0, [0, 1, 3])  # the source itself is skipped
    assert cache.lengths.tolist() == [3, 3, 0, 3]
    assert torch.equal(cache.k[:, 1], cache.k[:, 0]) and torch.equal(cache.v[:, 3], cache.v[:, 0])
    assert cache.k[:, 2].abs().sum() == 0


def test_compact_moves_the_last_busy_rows_into_the_holes():
    cache = KVCache(1, 6, 1, 4, 1)
    for row in range(6):
        cache.k[0, row, 0, :, 0] = float(row)
    cache.lengths[:] = torch.tensor([2, 0, 3, 0, 1, 4])
    # busy rows 0, 2, 4, 5 -> they must end in rows 0..3: 4 -> 1, 5 -> 3 (2 stays), one move per hole
    assert cache.compact([0, 2, 4, 5]) == {4: 1, 5: 3}
    assert cache.lengths.tolist() == [2, 1, 3, 4, 0, 0]
    # row 1 took row 4's 1 token, row 3 row 5's 4 tokens
    assert cache.k[0, :4, 0, :, 0].tolist() == [[0] * 4, [4, 1, 1, 1], [2] * 4, [5] * 4]
    assert cache.compact([0, 1, 2, 3]) == {}


def test_budget_arithmetic():
    cfg = SimpleNamespace(n_layer=12, n_kv_head=6, head_dim=128)
    # 2 * 12 * 6 * 128 * 2 bytes (bf16) = 36864 bytes per token
    assert KVCache.bytes_per_token(cfg, torch.bfloat16) == 36864
    assert KVCache.rows_for_budget(cfg, 36864 * 2048 * 3 + 1, 2048, torch.bfloat16) == 3
    with pytest.raises(KVBudgetError, match=r"at most 3 rows of 2048 tokens fit"):
        KVCache.for_model(cfg, 4, 2048, torch.bfloat16, budget_bytes=36864 * 2048 * 3 + 1)
