"""The KV cache's dtype option (ModelRunner kv_dtype): "auto" follows the one bf16 rule (raychat.model.fast_bf16,
also Muon's Newton-Schulz dtype), keys are stored rounded to the cache's dtype, attention runs in it and the
logits come back in fp32, and the Scheduler sizes its slots with the cache's bytes per token."""

from __future__ import annotations

import pytest
import torch
from support.engine_fixtures import byte_tokenizer, tiny_gpt

from raychat.engine import KVCache, ModelRunner, Scheduler
from raychat.engine.runner import resolve_kv_dtype
from raychat.model import fast_bf16
from raychat.train.muon import choose_ns_dtype


@pytest.fixture(scope="module")
def tok():
    return byte_tokenizer()


def test_auto_follows_the_newton_schulz_rule():
    fast, reason = fast_bf16("cpu")
    expected = torch.bfloat16 if fast else torch.float32
    assert resolve_kv_dtype("auto", torch.device("cpu"), torch.float32) == expected
    assert choose_ns_dtype("auto", "cpu").dtype == expected
    assert choose_ns_dtype("auto", "cpu").reason == reason
    assert resolve_kv_dtype("model", torch.device("cpu"), torch.float32) == torch.float32
    assert resolve_kv_dtype("bfloat16", torch.device("cpu"), torch.float32) == torch.bfloat16
    with pytest.raises(ValueError, match="kv_dtype must be"):
        resolve_kv_dtype("fp8", torch.device("cpu"), torch.float32)


def test_bf16_cache_stores_rounded_keys_and_returns_fp32_logits(tok):
    model = tiny_gpt(tok)
    prompt = [tok.bos_id, *tok.encode("the rounded keys")]
    e32 = ModelRunner(model, tok, prefix_cache_tokens=0)
    e16 = ModelRunner(model, tok, kv_dtype="bfloat16", prefix_cache_tokens=0)
    c32, c16 = e32.new_cache(1, 64), e16.new_cache(1, 64)
    assert (c32.k.dtype, c16.k.dtype) == (torch.float32, torch.bfloat16)
    l32, l16 = e32.prefill(c32, [0], [prompt]), e16.prefill(c16, [0], [prompt])
    n = len(prompt)
    # layer 0's keys/values depend on the tokens alone: the bf16 cache holds the fp32 ones rounded
    assert torch.equal(c16.k[0, 0, :, :n], c32.k[0, 0, :, :n].to(torch.bfloat16))
    assert torch.equal(c16.v[0, 0, :, :n], c32.v[0, 0, :, :n].to(torch.bfloat16))
    assert l16.dtype == torch.float32
    assert 0 < float((l16 - l32).abs().max()) < 0.05  # rounded (not equal), close
    d32, d16 = e32.decode(c32, [0], [5]), e16.decode(c16, [0], [5])
    assert d16.dtype == torch.float32 and float((d16 - d32).abs().max()) < 0.05


def test_scheduler_slots_use_the_cache_bytes(tok):
    model = tiny_gpt(tok)
    engine = ModelRunner(model, tok, kv_dtype="bfloat16", prefix_cache_tokens=0)
    bpt16 = KVCache.bytes_per_token(model.config, torch.bfloat16)
    assert bpt16 * 2 == KVCache.bytes_per_token(model.config, torch.float32)
    sched = Scheduler(engine, max_slots=8, max_len=64, kv_budget_bytes=3 * 64 * bpt16)
    assert sched.max_slots == 3 and sched.cache.k.dtype == torch.bfloat16


def test_kv_dtypes_the_configs_offer_are_exactly_what_resolve_kv_dtype_accepts():
    from raychat.engine.runner import DTYPES, KV_DTYPES

    assert KV_DTYPES == ("model", "auto", *DTYPES)
    for name in KV_DTYPES:
        assert resolve_kv_dtype(name, torch.device("cpu"), torch.float32) in DTYPES.values()
    with pytest.raises(ValueError, match="kv_dtype must be"):
        resolve_kv_dtype("fp8", torch.device("cpu"), torch.float32)
