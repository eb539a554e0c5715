"""engine/packed_weights.py: oneDNN-packed Linears equal nn.Linear, follow in-place weight updates, and are only
active inside `with`; the engine's greedy output with packing equals the plain path's."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from support.engine_fixtures import byte_tokenizer, reference_greedy, tiny_gpt
from torch import nn

from raychat.engine import ModelRunner
from raychat.engine.packed_weights import SMALL_MATMUL_MACS, PackedLinears, available, small_matmul

pytestmark = pytest.mark.skipif(
    not available(torch.device("cpu"), torch.float32), reason="torch built without oneDNN"
)


def test_packed_linear_equals_nn_linear_and_follows_in_place_updates():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(24, 40, bias=False), nn.Linear(40, 8, bias=True))
    x = torch.randn(5, 3, 24)
    packed = PackedLinears(model)
    with packed:
        y = model(x)
    torch.testing.assert_close(y, F.linear(F.linear(x, model[0].weight), model[1].weight, model[1].bias))
    assert "forward" not in model[0].__dict__  # plain nn.Linear again outside the block
    with torch.no_grad():  # an RL weight sync: load_state_dict copies into the parameters in place
        model.load_state_dict({k: v * 2 for k, v in model.state_dict().items()})
    with packed:
        y2 = model(x)
    torch.testing.assert_close(y2, F.linear(F.linear(x, model[0].weight), model[1].weight, model[1].bias))
    assert not torch.allclose(y2, y)
    with torch.no_grad():  # a new tensor assigned to the parameter (other storage)
        model[1].weight = nn.Parameter(torch.zeros(8, 40))
    with packed:
        torch.testing.assert_close(model(x), model[1].bias.expand(5, 3, 8))


def test_small_products_run_mkl_and_large_ones_onednn_both_equal_to_nn_linear():
    """The kernel rule: rows * in * out <= 2**22 multiply-adds -> MKL on the (in, out) copy, else oneDNN.
    A 256 x 256 weight switches above 2**22 / 65,536 = 64 rows; both kernels equal F.linear to fp32
    rounding (summation order only), with and without a bias."""
    assert SMALL_MATMUL_MACS == 4_194_304
    assert small_matmul(64, 256, 256) and not small_matmul(65, 256, 256)
    assert small_matmul(1, 512, 4096) and not small_matmul(3, 512, 4096)  # 2,097,152 vs 6,291,456
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(256, 256, bias=False), nn.Linear(256, 256, bias=True))
    for rows in (1, 64, 65, 300):
        x = torch.randn(rows, 1, 256)
        with PackedLinears(model):
            y = model(x)
        expected = F.linear(F.linear(x, model[0].weight), model[1].weight, model[1].bias)
        torch.testing.assert_close(y, expected, rtol=1e-5, atol=1e-5)


def test_engine_greedy_with_packing_equals_the_plain_path_and_the_no_cache_reference():
    tok = byte_tokenizer()
    model = tiny_gpt(tok)
    prompts = [[tok.bos_id, *range(40, 40 + n)] for n in (3, 9, 5)]
    packed = ModelRunner(model, tok).generate_batch(prompts, max_tokens=12, temperature=0.0)
    plain = ModelRunner(model, tok, packed_linears=False).generate_batch(
        prompts, max_tokens=12, temperature=0.0
    )
    assert [r.tokens for r in packed] == [r.tokens for r in plain]
    stop = {tok.bos_id, tok.special_id("<|assistant_end|>")}
    for p, r in zip(prompts, packed):
        assert r.completion_tokens == reference_greedy(model, p, 12, stop)


def test_packed_linears_option_is_checked():
    tok = byte_tokenizer()
    with pytest.raises(ValueError, match="packed_linears must be 'auto', True or False, got 'yes'"):
        ModelRunner(tiny_gpt(tok), tok, packed_linears="yes")
    with pytest.raises(ValueError, match="packed_linears=True needs a CPU device, float32 weights"):
        ModelRunner(tiny_gpt(tok), tok, dtype="bfloat16", packed_linears=True)


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
