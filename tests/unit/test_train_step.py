"""raychat.train.step.forward_backward, the one forward/backward of every stage: with the token cross entropy
(raychat.loss.TokenCrossEntropy) and the policy gradient (raychat.rl.objective.PolicyGradientLoss) it gives the
gradients and sums of the two loops it replaced bit for bit, and 2 DDP ranks (gloo) give the gradients of one
process, with the gradient all-reduce in the last micro-batch's backward only. raychat.train.step.optimizer_step
clips to the global norm and steps, and on a non-finite norm steps nothing and raises NonFiniteError (the stop
on Ray Train, without a retry, is tests/ray/test_train_ray.py's)."""

import contextlib
import math

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
from torch.nn.parallel import DistributedDataParallel

from raychat.loss import TokenCrossEntropy, cross_entropy_sum, global_target_count, normalize
from raychat.masks import make_batch
from raychat.model import GPT, ModelConfig
from raychat.ports import free_ports
from raychat.rl.objective import (
    PolicyGradientLoss,
    collate,
    normalized_loss,
    per_token_loss,
    token_logprobs,
)
from raychat.train.step import NonFiniteError, autocast_for, forward_backward, optimizer_step

VOCAB = 32
# prompt tokens (mask 0), sampled tokens (mask 1), a forced tool output (mask 0) in the first row
SAMPLES = [
    {"tokens": [1, 5, 9, 20, 21, 30, 31, 22, 7], "mask": [0, 0, 0, 1, 1, 0, 0, 1, 1], "advantage": 0.75},
    {"tokens": [1, 6, 10, 11], "mask": [0, 0, 1, 1], "advantage": -0.25},
    {"tokens": [1, 5, 8, 12, 13, 14], "mask": [0, 0, 0, 1, 1, 1], "advantage": -0.5},
    {"tokens": [1, 7, 3, 4, 2], "mask": [0, 0, 1, 1, 1], "advantage": 1.0},
]


def _model(seed: int = 0) -> GPT:
    cfg = ModelConfig(
        vocab_size=VOCAB, n_layer=1, n_embd=32, n_head=2, n_kv_head=2, head_dim=16, intermediate_size=64,
        max_seq_len=16,
    )  # fmt: skip
    model = GPT(cfg).init_weights(seed=seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("o_proj.weight", "down_proj.weight", "lm_head.weight")):
                p.normal_(0, 0.3, generator=torch.Generator().manual_seed(seed))  # losses differ per token
    return model


def _ce_micro() -> list[dict]:
    """4 micro-batches of 2 packed rows (T = 8, documents starting at BOS 0), unequal target counts."""
    g = torch.Generator().manual_seed(1)
    micro = []
    for i in range(4):
        rows = torch.randint(1, VOCAB, (2, 9), generator=g)
        rows[:, 0] = 0
        rows[0, 3 + i] = 0  # a second document in the first row
        micro.append(make_batch(rows, bos_id=0))
    return micro


def _pg_micro(size: int = 2) -> list[dict]:
    """The samples in micro-batches of `size` (right-padded by collate)."""
    return [collate(SAMPLES[i : i + size]) for i in range(0, len(SAMPLES), size)]


PG = PolicyGradientLoss("token", temperature=0.7, clip_eps=0.2, constant_length=8)


def _grads(model) -> list[torch.Tensor]:
    return [p.grad.clone() for p in model.parameters()]


def test_cross_entropy_equals_the_former_trainer_loop_bit_for_bit():
    model, micro = _model(), _ce_micro()
    sums = forward_backward(model, micro, TokenCrossEntropy(), contextlib.nullcontext, world=1)
    got = _grads(model)

    model.zero_grad(set_to_none=True)  # the Trainer's loop before the one step function (world 1)
    n = global_target_count(mb["loss_mask"] for mb in micro)
    loss_sum = torch.zeros((), dtype=torch.float64)
    for mb in micro:
        logits = model(mb["input_ids"], position_ids=mb["position_ids"], segment_ids=mb.get("segment_ids"))
        ce_sum, _ = cross_entropy_sum(logits, mb["labels"], mb["loss_mask"])
        normalize(ce_sum, n, 1).backward()
        loss_sum += ce_sum.detach().double()
    assert sums.totals == [n] and n == sum(int(mb["loss_mask"].sum()) for mb in micro)
    assert sums.stats[0] / n == (loss_sum / n).item()
    for a, b in zip(got, _grads(model)):
        assert torch.equal(a, b)
    # the step loss is the token mean of the CE over every target of the step (not a mean of means)
    ce = [
        F.cross_entropy(
            model(mb["input_ids"])[mb["loss_mask"]], mb["labels"][mb["loss_mask"]], reduction="sum"
        )
        for mb in micro
    ]
    assert sums.stats[0] / n == pytest.approx(sum(x.item() for x in ce) / n, rel=1e-5)


def test_policy_gradient_equals_the_former_learner_loop_bit_for_bit():
    model, micro = _model(), _pg_micro()
    sums = forward_backward(model, micro, PG, contextlib.nullcontext, world=1)
    got = _grads(model)

    model.zero_grad(set_to_none=True)  # the Learner's loop before the one step function (world 1)
    num_tokens = sum(int(b["loss_mask"].sum()) for b in micro)
    stats = torch.zeros(5, dtype=torch.float64)
    for b in micro:
        logits = model(b["input_ids"])
        logp = token_logprobs(logits, b["labels"], 0.7)
        loss_tok, ratio = per_token_loss(logp, b["advantages"], None, 0.2)
        loss = normalized_loss(loss_tok, b["loss_mask"], "token", num_tokens, 4, 8)
        (loss * 1).backward()
        m = b["loss_mask"]
        clipped = ((ratio - 1).abs() > 0.2) & m
        full = F.log_softmax(logits.detach()[m] / 0.7, dim=-1)  # the sampled tokens' distributions
        entropy = -(full.exp() * full).sum()
        stats += torch.tensor(
            [loss.item(), float(ratio[m].sum()), float(clipped.sum()), float(m.sum()), float(entropy)],
            dtype=torch.float64,
        )
    assert sums.totals == [num_tokens, 4] and num_tokens == 12
    assert sums.stats[:4] == stats.tolist()[:4]
    assert sums.stats[4] == pytest.approx(stats[4].item(), rel=1e-6)  # summed a row at a time there
    for a, b in zip(got, _grads(model)):
        assert torch.equal(a, b)
    # on-policy the surrogate's value is -sum(A over sampled tokens) / N: rows -3, +0.5, +1.5, -3 -> -4 / 12
    assert sums.stats[0] == pytest.approx(-4 / 12, abs=1e-6)
    assert sums.stats[1:4] == [12.0, 0.0, 12.0]  # ratios all 1, none clipped, 12 sampled tokens
    assert 0 < sums.stats[4] / 12 < math.log(VOCAB)  # a mean entropy below the uniform distribution's


def _rank(rank: int, world: int, port: int, out) -> None:
    """Rank `rank` of 2: DDP over its half of the micro-batches of each loss; the gradient all-reduces counted."""
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        for name, micro, loss in (("ce", _ce_micro(), TokenCrossEntropy()), ("pg", _pg_micro(1), PG)):
            model = _model()
            ddp = DistributedDataParallel(model)
            reduced = []

            def counting_allreduce(state, bucket, reduced=reduced):
                reduced.append(bucket.index())
                return allreduce_hook(state, bucket)

            ddp.register_comm_hook(None, counting_allreduce)
            half = len(micro) // world
            mine = micro[rank * half : (rank + 1) * half]
            sums = forward_backward(ddp, mine, loss, autocast_for(torch.device("cpu")), world)
            out[(name, rank)] = {"sums": sums, "grads": _grads(model), "reduced": reduced, "micro": len(mine)}
    finally:
        dist.destroy_process_group()


def test_two_ddp_ranks_give_the_gradient_of_one_process():
    with mp.Manager() as manager:
        out = manager.dict()
        mp.spawn(_rank, args=(2, free_ports(1)[0], out), nprocs=2, join=True)
        results = dict(out)
    for name, micro, loss in (("ce", _ce_micro(), TokenCrossEntropy()), ("pg", _pg_micro(1), PG)):
        model = _model()
        one = forward_backward(model, micro, loss, contextlib.nullcontext, world=1)
        for rank in (0, 1):
            r = results[(name, rank)]
            assert r["sums"].totals == one.totals  # counts summed over both ranks
            assert r["sums"].stats == pytest.approx(one.stats, rel=1e-6)  # stats all-reduced once
            for a, b in zip(_grads(model), r["grads"]):
                torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)
            # no_sync on all but the last micro-batch: each gradient bucket is all-reduced exactly once
            assert r["micro"] == 2 and sorted(r["reduced"]) == sorted(set(r["reduced"])) and r["reduced"]
        assert math.isfinite(one.stats[0])


def _linear_with_grads(weight_grad: list[float]) -> torch.nn.Linear:
    """Linear(3, 1) with weight [[1, 2, 3]], bias [0.5] and the given weight gradient (bias gradient 0)."""
    layer = torch.nn.Linear(3, 1)
    with torch.no_grad():
        layer.weight.copy_(torch.tensor([[1.0, 2.0, 3.0]]))
        layer.bias.fill_(0.5)
    layer.weight.grad = torch.tensor([weight_grad])
    layer.bias.grad = torch.zeros(1)
    return layer


def test_optimizer_step_clips_to_the_global_norm_and_steps():
    layer = _linear_with_grads([3.0, 4.0, 0.0])  # global L2 norm sqrt(9 + 16) = 5
    opt = torch.optim.SGD(layer.parameters(), lr=0.1)
    assert optimizer_step(layer.parameters(), [opt], grad_clip=1.0, step=7) == pytest.approx(5.0)
    # clipped to norm 1 (x 1/5), then w -= 0.1 * g: [1, 2, 3] - 0.1 * [0.6, 0.8, 0]
    torch.testing.assert_close(layer.weight.detach(), torch.tensor([[0.94, 1.92, 3.0]]))
    assert layer.weight.grad is None and layer.bias.grad is None


@pytest.mark.parametrize("bad", [float("inf"), float("nan")])
def test_a_non_finite_grad_norm_steps_nothing_and_raises_naming_the_step(bad):
    layer = _linear_with_grads([bad, 0.0, 0.0])
    opt = torch.optim.SGD(layer.parameters(), lr=0.1)
    with pytest.raises(NonFiniteError, match=f"grad norm is {bad} at step 7: the update was skipped") as e:
        optimizer_step(layer.parameters(), [opt], grad_clip=1.0, step=7)
    assert (e.value.what, e.value.step) == ("grad norm", 7)
    torch.testing.assert_close(layer.weight.detach(), torch.tensor([[1.0, 2.0, 3.0]]))  # not stepped
    assert layer.weight.grad is None and layer.bias.grad is None  # cleared for the next step
