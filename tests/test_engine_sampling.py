"""Sampling: greedy, temperature, top-k, top-p on hand-worked distributions; per-row independence."""

from __future__ import annotations

import math

import pytest
import torch

from raychat.engine import SamplingParams, make_generator, sample_next
from raychat.engine.sampling import filter_logits

PROBS = torch.tensor([[0.5, 0.3, 0.15, 0.05]])
LOGITS = PROBS.log()


def kept(logits):
    return torch.isfinite(logits[0]).nonzero().flatten().tolist()


def test_top_k_keeps_k_largest():
    assert kept(filter_logits(LOGITS, top_k=2, top_p=None)) == [0, 1]
    assert kept(filter_logits(LOGITS, top_k=4, top_p=None)) == [0, 1, 2, 3]
    assert kept(filter_logits(LOGITS, top_k=0, top_p=None)) == [0, 1, 2, 3]


def test_top_p_smallest_set_reaching_mass():
    # mass before each token (sorted): 0, 0.5, 0.8, 0.95; a token stays while that mass < top_p
    assert kept(filter_logits(LOGITS, top_k=None, top_p=0.5)) == [0]
    assert kept(filter_logits(LOGITS, top_k=None, top_p=0.8)) == [0, 1]
    assert kept(filter_logits(LOGITS, top_k=None, top_p=0.81)) == [0, 1, 2]
    assert kept(filter_logits(LOGITS, top_k=None, top_p=0.01)) == [0]  # never empty
    # unsorted input: same set by id
    perm = torch.tensor([2, 0, 3, 1])
    assert kept(filter_logits(LOGITS[:, perm], top_k=None, top_p=0.8)) == [1, 3]


def test_greedy_is_argmax():
    logits = torch.tensor([[0.1, 2.0, -1.0], [3.0, 3.0, 0.0]])
    assert sample_next(logits, temperature=0).tolist() == [1, 0]


def test_temperature_frequencies():
    # logits [0, ln 3]: p(1) = 3/4 at T=1; at T=0.5 logits double: p(1) = 9/10
    n = 8000
    logits = torch.tensor([[0.0, math.log(3)]]).expand(n, 2)
    gen = make_generator(123)
    f1 = sample_next(logits, 1.0, generator=gen).float().mean().item()
    f05 = sample_next(logits, 0.5, generator=gen).float().mean().item()
    # binomial std: sqrt(.75*.25/8000) = 0.0048, sqrt(.9*.1/8000) = 0.0034; 5 sigma bounds
    assert abs(f1 - 0.75) < 0.025
    assert abs(f05 - 0.9) < 0.017


def test_top_p_renormalizes():
    n = 8000
    out = sample_next(LOGITS.expand(n, 4), 1.0, top_p=0.8, generator=make_generator(7))
    assert set(out.tolist()) <= {0, 1}
    assert abs((out == 0).float().mean().item() - 0.5 / 0.8) < 0.03  # 0.625; std 0.0054


def test_rows_are_independent_and_seeded():
    logits = torch.zeros(64, 2)
    a = sample_next(logits, 1.0, generator=make_generator(0))
    b = sample_next(logits, 1.0, generator=make_generator(0))
    assert a.tolist() == b.tolist()
    assert 0 < a.sum().item() < 64


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"temperature": -0.1}, "temperature"),
        ({"top_k": -1}, "top_k"),
        ({"top_p": 1.5}, "top_p"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"stop": ("",)}, "stop"),
    ],
)
def test_params_validation(kwargs, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


def test_params_single_stop_string_becomes_tuple():
    assert SamplingParams(stop="END").stop == ("END",)
