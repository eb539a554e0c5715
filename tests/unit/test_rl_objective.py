"""Policy-gradient objective: the issue's hand-worked normalization values, masking, advantages, pass@k."""

import math

import pytest
import torch

from raychat.rl.objective import (
    collate,
    group_advantages,
    normalized_loss,
    pass_at_k,
    per_token_loss,
    token_logprobs,
)


def _rows(lengths, values, T):
    loss = torch.zeros(len(lengths), T)
    mask = torch.zeros(len(lengths), T, dtype=torch.bool)
    for i, (n, v) in enumerate(zip(lengths, values)):
        loss[i, :n], mask[i, :n] = v, True
    return loss, mask


def test_token_mean_vs_sequence_mean():
    # row 0: 5 tokens of loss 2; row 1: 1 token of loss 10 -> token-mean 20/6, sequence-mean (2 + 10)/2
    loss, mask = _rows([5, 1], [2.0, 10.0], T=5)
    assert normalized_loss(loss, mask, "token", 6, 2).item() == pytest.approx(3.3333, abs=1e-4)
    assert normalized_loss(loss, mask, "sequence", 6, 2).item() == pytest.approx(6.0)


def test_advantage_normalizations_with_loss_minus_a():
    # A = +1 on a length-2 row and -1 on a length-4 row; on-policy per-token loss is -A
    logp = torch.zeros(2, 4, requires_grad=True)
    _, mask = _rows([2, 4], [0, 0], T=4)
    loss_tok, ratio = per_token_loss(logp, torch.tensor([1.0, -1.0]))
    assert torch.equal(loss_tok[0], torch.full((4,), -1.0)) and torch.equal(ratio, torch.ones(2, 4))
    assert normalized_loss(loss_tok, mask, "sequence", 6, 2).item() == pytest.approx(0.0)
    assert normalized_loss(loss_tok, mask, "token", 6, 2).item() == pytest.approx(0.3333, abs=1e-4)
    assert normalized_loss(loss_tok, mask, "constant", 6, 2, constant_length=4).item() == pytest.approx(0.25)


def test_micro_batches_sum_to_the_step_loss():
    # token-mean over the whole step: split the two rows into two micro-batches, each divided by global N=6
    loss, mask = _rows([5, 1], [2.0, 10.0], T=5)
    parts = [normalized_loss(loss[i : i + 1], mask[i : i + 1], "token", 6, 2) for i in range(2)]
    assert sum(p.item() for p in parts) == pytest.approx(20 / 6)
    parts = [normalized_loss(loss[i : i + 1], mask[i : i + 1], "sequence", 6, 2) for i in range(2)]
    assert sum(p.item() for p in parts) == pytest.approx(6.0)


def test_gradient_is_zero_at_forced_tool_output_positions():
    # tokens: prompt (mask 0) x2, sampled x2, forced tool output x2 (mask 0), sampled x1
    sample = {"tokens": [1, 2, 3, 4, 5, 6, 7], "mask": [0, 0, 1, 1, 0, 0, 1], "advantage": 0.5}
    b = collate([sample])
    assert b["loss_mask"].tolist() == [[False, True, True, False, False, True]]  # mask[1:]
    logits = torch.randn(1, 6, 11, requires_grad=True)
    logp = token_logprobs(logits, b["labels"])
    loss_tok, _ = per_token_loss(logp, b["advantages"])
    normalized_loss(loss_tok, b["loss_mask"], "token", 3, 1).backward()
    g = logits.grad[0]
    for t in (0, 3, 4):  # predicting prompt token 2 and forced tokens 5, 6
        assert torch.equal(g[t], torch.zeros(11))
    for t in (1, 2, 5):
        assert g[t].abs().sum() > 0
    # d(-A logp_y / N)/d logits = -A/N (onehot(y) - softmax): check one sampled position exactly
    p = torch.softmax(logits.detach()[0, 1], -1)
    expected = -(0.5 / 3) * (torch.nn.functional.one_hot(torch.tensor(3), 11).float() - p)
    assert torch.allclose(g[1], expected, atol=1e-6)


def test_clipped_ratio():
    # behavior logprob log(0.5), current log(0.8): ratio 1.6 clipped at 1.2 for A > 0; unclipped for A < 0
    logp = torch.log(torch.tensor([[0.8]])).requires_grad_(True)
    old = torch.log(torch.tensor([[0.5]]))
    loss, ratio = per_token_loss(logp, torch.tensor([1.0]), old, clip_eps=0.2)
    assert ratio.item() == pytest.approx(1.6) and loss.item() == pytest.approx(-1.2)
    loss.sum().backward()
    assert logp.grad.item() == 0.0  # clipped: no gradient
    loss, _ = per_token_loss(logp, torch.tensor([-1.0]), old, clip_eps=0.2)
    assert loss.item() == pytest.approx(1.6)  # -min(1.6 * -1, 1.2 * -1) = 1.6


def test_group_advantages():
    assert group_advantages([1, 0, 0, 1, 1, 1], 3) == pytest.approx([2 / 3, -1 / 3, -1 / 3, 0, 0, 0])
    # population std of [1, 0] is 0.5 -> +-1; a constant group stays 0 (eps)
    assert group_advantages([1, 0, 1, 1], 2, scale_by_std=True) == pytest.approx([1, -1, 0, 0], abs=1e-5)
    with pytest.raises(ValueError, match="group_size"):
        group_advantages([1, 0, 1], 2)


def test_temperature_logprobs():
    logits = torch.tensor([[[2.0, 0.0]]])
    lp = token_logprobs(logits, torch.tensor([[0]]), temperature=2.0)
    assert lp.item() == pytest.approx(math.log(math.e / (math.e + 1)))


def test_pass_at_k():
    assert pass_at_k(8, 0, 1) == 0.0 and pass_at_k(8, 8, 3) == 1.0
    assert pass_at_k(8, 2, 1) == pytest.approx(0.25)
    assert pass_at_k(8, 2, 2) == pytest.approx(1 - (6 * 5) / (8 * 7))  # 1 - C(6,2)/C(8,2)
    assert pass_at_k(4, 1, 4) == 1.0
    with pytest.raises(ValueError):
        pass_at_k(4, 5, 1)


def test_bad_inputs():
    loss, mask = _rows([1], [1.0], T=1)
    with pytest.raises(ValueError, match="normalization must be one of"):
        normalized_loss(loss, mask, "mean", 1, 1)
    with pytest.raises(ValueError, match="constant_length"):
        normalized_loss(loss, mask, "constant", 1, 1)
    with pytest.raises(ValueError, match="tokens"):
        collate([{"tokens": [1, 2], "mask": [0], "advantage": 0.0}])
