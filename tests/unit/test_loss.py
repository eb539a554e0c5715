import math

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from raychat.loss import cross_entropy_sum, global_target_count, normalize
from raychat.model import GPT, ModelConfig
from raychat.ports import free_ports


def test_cross_entropy_sum_hand_values():
    # uniform logits over V=4: every target costs ln 4; 3 of 5 positions are targets
    logits = torch.zeros(1, 5, 4)
    labels = torch.tensor([[0, 1, 2, 3, 0]])
    mask = torch.tensor([[True, False, True, True, False]])
    loss_sum, n = cross_entropy_sum(logits, labels, mask)
    assert n.item() == 3
    assert loss_sum.item() == pytest.approx(3 * math.log(4), abs=1e-6)
    # logits [2, 0, 0], label 0: -log(e^2 / (e^2 + 2)) = log(1 + 2 e^-2)
    loss_sum, n = cross_entropy_sum(
        torch.tensor([[[2.0, 0.0, 0.0]]]), torch.tensor([[0]]), torch.tensor([[True]])
    )
    assert loss_sum.item() == pytest.approx(math.log(1 + 2 * math.exp(-2)), abs=1e-6)


def test_masking_uses_the_loss_mask_never_a_token_id():
    eos = 3
    logits = torch.randn(1, 4, 5)
    labels = torch.tensor([[1, eos, eos, eos]])  # a real EOS target, then padding with the same id
    mask = torch.tensor([[True, True, False, False]])
    loss_sum, n = cross_entropy_sum(logits, labels, mask)
    ref = torch.nn.functional.cross_entropy(logits[0, :2], labels[0, :2], reduction="sum")
    assert n.item() == 2
    torch.testing.assert_close(loss_sum, ref)


def test_zero_targets_give_zero_loss_not_nan():
    logits = torch.full((2, 3, 5), float("inf"))  # even garbage logits at masked positions
    loss_sum, n = cross_entropy_sum(
        logits, torch.zeros(2, 3, dtype=torch.long), torch.zeros(2, 3, dtype=torch.bool)
    )
    assert n.item() == 0 and loss_sum.item() == 0.0
    loss = normalize(loss_sum, global_target_count([torch.zeros(2, 3, dtype=torch.bool)]))
    assert loss.item() == 0.0 and not math.isnan(loss.item())


def _model_and_data(seed=0):
    torch.manual_seed(seed)
    cfg = ModelConfig(
        vocab_size=32,
        n_layer=1,
        n_embd=32,
        n_head=2,
        n_kv_head=2,
        head_dim=16,
        intermediate_size=64,
        max_seq_len=8,
    )
    model = GPT(cfg).init_weights(seed=seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("o_proj.weight", "down_proj.weight", "lm_head.weight")):
                p.normal_(0, 0.3)  # away from the identity / uniform init, so per-token losses differ
    ids = torch.randint(0, 32, (4, 8))
    labels = torch.randint(0, 32, (4, 8))
    # very unequal target counts per row: a mean of per-row means would differ from the token mean
    mask = torch.zeros(4, 8, dtype=torch.bool)
    mask[0, :1] = True
    mask[1, :8] = True
    mask[2, 2:5] = True
    mask[3, 6:8] = True
    return model, ids, labels, mask


def _grads(model):
    return [p.grad.clone() for p in model.parameters()]


def test_grad_accumulation_1_vs_4_is_identical():
    model, ids, labels, mask = _model_and_data()
    n = global_target_count([mask])
    s, _ = cross_entropy_sum(model(ids), labels, mask)
    normalize(s, n).backward()
    full, full_loss = _grads(model), s.item() / n

    model.zero_grad()
    micro = [(ids[i : i + 1], labels[i : i + 1], mask[i : i + 1]) for i in range(4)]
    n4 = global_target_count([m for _, _, m in micro])
    assert n4 == n == 14
    total = 0.0
    for x, y, m in micro:
        s, _ = cross_entropy_sum(model(x), y, m)
        normalize(s, n4).backward()
        total += s.item()
    for g1, g4 in zip(full, _grads(model)):
        torch.testing.assert_close(g1, g4, atol=1e-6, rtol=0)
    assert total / n4 == pytest.approx(full_loss, abs=1e-6)

    # a mean of per-micro-batch means gives a different loss here (the test can tell them apart)
    means = [cross_entropy_sum(model(x), y, m) for x, y, m in micro]
    assert abs(sum(s.item() / k.item() for s, k in means) / 4 - full_loss) > 1e-2


def _rank_worker(rank, world, port, out):
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        model, ids, labels, mask = _model_and_data()
        rows = slice(2 * rank, 2 * rank + 2)
        n = global_target_count([mask[rows]])  # all-reduced over both ranks
        s, _ = cross_entropy_sum(model(ids[rows]), labels[rows], mask[rows])
        normalize(s, n, world_size=world).backward()
        for p in model.parameters():  # what DDP does: average gradients over ranks
            dist.all_reduce(p.grad)
            p.grad /= world
        out[rank] = {"n": n, "grads": _grads(model)}
    finally:
        dist.destroy_process_group()


def test_one_rank_vs_two_ranks_is_identical():
    model, ids, labels, mask = _model_and_data()
    s, _ = cross_entropy_sum(model(ids), labels, mask)
    normalize(s, global_target_count([mask])).backward()
    single = _grads(model)

    with mp.Manager() as manager:
        out = manager.dict()
        mp.spawn(_rank_worker, args=(2, free_ports(1)[0], out), nprocs=2, join=True)
        results = dict(out)
    assert results[0]["n"] == results[1]["n"] == 14
    for r in (0, 1):
        for g1, g2 in zip(single, results[r]["grads"]):
            torch.testing.assert_close(g1, g2, atol=1e-6, rtol=0)
