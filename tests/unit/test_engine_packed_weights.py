"""engine/packed_weights.py: PackedGPT computes GPT.forward (no cache, with the engine's KV cache, logits_at),
follows in-place weight updates and new storage; each matmul's kernel rule (MKL on the (in, out) copy for
small products, oneDNN packed above) equals F.linear; models it cannot read are left to their own forward;
the engine's greedy output with packing equals the plain path's."""

from __future__ import annotations

import ctypes

import psutil
import pytest
import torch
import torch.nn.functional as F
from support.engine_fixtures import byte_tokenizer, reference_greedy, tiny_gpt
from torch import nn

from raychat.engine import ModelRunner
from raychat.engine.packed_weights import (
    SMALL_MATMUL_MACS,
    PackedGPT,
    PackedMatmul,
    available,
    onednn_rows,
    small_matmul,
    supports,
)

pytestmark = pytest.mark.skipif(
    not available(torch.device("cpu"), torch.float32), reason="torch built without oneDNN"
)


@torch.no_grad()
def test_packed_gpt_equals_the_models_forward_with_and_without_the_kv_cache():
    tok = byte_tokenizer()
    model = tiny_gpt(tok)  # GQA: 4 query heads over 2 kv heads
    packed = PackedGPT(model)
    ids = torch.randint(0, tok.vocab_size, (3, 9), generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(packed(ids), model(ids), rtol=1e-5, atol=1e-5)
    at = torch.tensor([8, 0, 4])
    torch.testing.assert_close(packed(ids, logits_at=at), model(ids, logits_at=at), rtol=1e-5, atol=1e-5)
    # the engine's path: a 9-token prefill, then 3 decode steps, each against the model on its own cache
    plain, fast = ModelRunner(model, tok, packed_weights=False), ModelRunner(model, tok)
    assert isinstance(fast._forward, PackedGPT) and plain._forward is model
    caches = plain.new_cache(3, 16), fast.new_cache(3, 16)
    pieces = [r.tolist() for r in ids]
    for _ in range(4):
        a, b = plain.forward_rows(caches[0], 0, pieces), fast.forward_rows(caches[1], 0, pieces)
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-5)
        assert a.abs().max() > 1  # real logits, not a degenerate model
        pieces = [[int(t)] for t in a.argmax(-1)]
    torch.testing.assert_close(caches[1].k, caches[0].k, rtol=1e-5, atol=1e-5)


@torch.no_grad()
def test_packed_gpt_follows_in_place_updates_and_new_storage():
    tok = byte_tokenizer()
    model = tiny_gpt(tok)
    packed = PackedGPT(model)
    ids = torch.tensor([[1, 40, 41, 42]])
    before = packed(ids)
    model.load_state_dict({k: v * 1.5 for k, v in model.state_dict().items()})  # an RL weight sync
    after = packed(ids)
    assert not torch.allclose(after, before)
    torch.testing.assert_close(after, model(ids), rtol=1e-5, atol=1e-5)
    model.model.layers[0].self_attn.k_proj.weight = nn.Parameter(torch.zeros(32, 64))  # other storage
    torch.testing.assert_close(packed(ids), model(ids), rtol=1e-5, atol=1e-5)
    model.model.layers[1].mlp.up_proj.weight.copy_(torch.randn(model.config.intermediate_size, 64))
    torch.testing.assert_close(packed(ids), model(ids), rtol=1e-5, atol=1e-5)
    model.lm_head = nn.Linear(64, tok.vocab_size, bias=False)  # a submodule replaced, then updated in place
    torch.testing.assert_close(packed(ids), model(ids), rtol=1e-5, atol=1e-5)
    model.lm_head.weight.mul_(3)
    torch.testing.assert_close(packed(ids), model(ids), rtol=1e-5, atol=1e-5)
    model.model.layers[0].mlp = Doubled(model.model.layers[0].mlp)  # a type it cannot compute: the model's
    torch.testing.assert_close(packed(ids), model(ids), rtol=1e-5, atol=1e-5)  # own forward runs


class Doubled(nn.Module):
    def __init__(self, inner):
        super().__init__()
        self.inner = inner

    def forward(self, x):
        return 2 * self.inner(x)


def test_small_products_run_mkl_and_large_ones_onednn_both_equal_to_f_linear():
    """The kernel rule: rows * in * out <= 2**22 multiply-adds -> MKL on the (in, out) copy, else oneDNN.
    A 256 x 256 weight switches above 2**22 / 65,536 = 64 rows; both kernels equal F.linear to fp32
    rounding (summation order only)."""
    assert SMALL_MATMUL_MACS == 4_194_304
    assert small_matmul(64, 256, 256) and not small_matmul(65, 256, 256)
    assert small_matmul(1, 512, 4096) and not small_matmul(3, 512, 4096)  # 2,097,152 vs 6,291,456
    weight = torch.randn(256, 256, generator=torch.Generator().manual_seed(0)) / 16
    matmul = PackedMatmul(weight)
    assert matmul.small_rows == 64
    for rows in (1, 64, 65, 300):
        x = torch.randn(rows, 1, 256)
        torch.testing.assert_close(matmul(x), F.linear(x, weight), rtol=1e-5, atol=1e-5)


def test_models_it_cannot_read_keep_their_own_forward():
    """A hook or a Linear subclass (torchao's Float8Linear is one) would change what a projection computes:
    such a model is not packed ("auto") or is refused (True)."""
    tok = byte_tokenizer()
    model = tiny_gpt(tok)
    assert supports(model)
    handle = model.model.layers[1].mlp.down_proj.register_forward_hook(lambda m, i, o: o * 2)
    assert not supports(model)
    assert ModelRunner(model, tok)._forward is model
    with pytest.raises(ValueError, match="packed_weights=True needs a raychat GPT of its own module types"):
        ModelRunner(model, tok, packed_weights=True)
    handle.remove()
    assert supports(model)
    handle = model.register_forward_pre_hook(lambda m, args: None)  # on the GPT itself: it would never run
    assert not supports(model)
    handle.remove()
    torch.nn.utils.parametrize.register_parametrization(model.model.norm, "weight", Doubled(nn.Identity()))
    assert not supports(model)  # a parametrized weight: its value is computed on every access
    assert not supports(nn.Sequential(nn.Linear(4, 4)))
    with pytest.raises(ValueError, match="PackedGPT needs a raychat GPT of its own module types"):
        PackedGPT(nn.Sequential(nn.Linear(4, 4)))


def test_engine_greedy_with_packing_equals_the_plain_path_and_the_no_cache_reference():
    tok = byte_tokenizer()
    model = tiny_gpt(tok)
    prompts = [[tok.bos_id, *range(40, 40 + n)] for n in (3, 9, 5)]
    packed = ModelRunner(model, tok).generate_batch(prompts, max_tokens=12, temperature=0.0)
    plain = ModelRunner(model, tok, packed_weights=False).generate_batch(
        prompts, max_tokens=12, temperature=0.0
    )
    assert [r.tokens for r in packed] == [r.tokens for r in plain]
    stop = {tok.bos_id, tok.special_id("<|assistant_end|>")}
    for p, r in zip(prompts, packed):
        assert r.completion_tokens == reference_greedy(model, p, 12, stop)


def test_packed_weights_option_is_checked():
    tok = byte_tokenizer()
    with pytest.raises(ValueError, match="packed_weights must be 'auto', True or False, got 'yes'"):
        ModelRunner(tiny_gpt(tok), tok, packed_weights="yes")
    with pytest.raises(ValueError, match="packed_weights=True needs .* float32 weights"):
        ModelRunner(tiny_gpt(tok), tok, dtype="bfloat16", packed_weights=True)


def test_refresh_weights_picks_up_a_write_the_version_counter_misses():
    """A collective (or `param.data` writes) changes the memory without bumping the version counter:
    RolloutWorker calls refresh_weights after such a sync, and the next forward uses the new weights."""
    tok = byte_tokenizer()
    model = tiny_gpt(tok)
    engine = ModelRunner(model, tok)
    prompt = [[tok.bos_id, 40, 41]]
    assert engine.forward_rows(engine.new_cache(1, 8), 0, prompt).abs().max() > 0
    version = model.lm_head.weight._version
    model.lm_head.weight.data.zero_()
    assert model.lm_head.weight._version == version
    engine.refresh_weights()
    assert torch.equal(engine.forward_rows(engine.new_cache(1, 8), 0, prompt), torch.zeros(1, tok.vocab_size))


def test_onednn_rows_round_up_to_8_sizes_per_power_of_two():
    """onednn_rows: exact below 16, else up to the next 2**n + j * 2**(n - 3); at most 12.5% padding, and
    rows 1..8,192 take 88 shapes: 15 exact (1..15), 8 per power of two from 16 to 4,096 (72), and 8,192."""
    assert [onednn_rows(r) for r in (1, 15, 16, 17, 33, 65, 129, 300, 520, 1024, 1025)] == [
        1, 15, 16, 18, 36, 72, 144, 320, 576, 1024, 1152,
    ]  # fmt: skip
    buckets = {onednn_rows(r) for r in range(1, 8193)}
    assert len(buckets) == 15 + 8 * 9 + 1 == 88
    assert all(r <= onednn_rows(r) < 1.125 * r for r in range(1, 8193))
    assert sorted(b for b in buckets if 64 < b <= 128) == [72, 80, 88, 96, 104, 112, 120, 128]


@torch.no_grad()
def test_onednn_memory_stays_bounded_over_many_row_counts():
    """oneDNN keeps ~0.6 MiB for every input shape it meets (engine/packed_weights.py: Memory). 400 row counts
    (155..554) reach it as 16 shapes (160..256 by 16, 288..512 by 32, 576): the process grows by ~10 MiB,
    where one shape per row count grew it by ~230 MiB (measured before onednn_rows). Results equal F.linear.
    A weight shape no other test uses, so no cached shape is shared."""
    libc = ctypes.CDLL("libc.so.6")
    weight = torch.randn(200, 136, generator=torch.Generator().manual_seed(0)) / 12
    matmul = PackedMatmul(weight)
    assert matmul.small_rows == 154  # 2**22 // (200 * 136): rows above go to oneDNN
    rows = range(155, 555)
    assert len({onednn_rows(r) for r in rows}) == 16

    def rss_mib() -> float:
        libc.malloc_trim(0)  # freed memory back to the system: what is left is held
        return psutil.Process().memory_info().rss / 2**20

    matmul(torch.randn(2000, 136))  # a first call: oneDNN's own start-up, not a shape's cost
    before = rss_mib()
    for r in rows:
        matmul(torch.randn(r, 136))
    assert rss_mib() - before < 64
    for r in (
        155,
        161,
        300,
        554,
    ):  # the zero rows change nothing (F.linear keeps state per shape too: not above)
        x = torch.randn(r, 136)
        torch.testing.assert_close(matmul(x), F.linear(x, weight), rtol=1e-5, atol=1e-5)
