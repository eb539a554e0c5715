"""One learner update on a hand-built batch equals a naive reference computation (no Ray)."""

import pytest
import torch
import torch.nn.functional as F
from support.rl_fixtures import rl_config, tiny_checkpoint

from raychat.checkpoint import load_model
from raychat.checkpoint_manager import CheckpointManager
from raychat.rl.learner import Learner
from raychat.storage import open_storage
from raychat.train.optim import build_optimizers

# prompt tokens (mask 0), sampled tokens (mask 1), a forced tool output (mask 0) in the first row
BATCH = [
    {"tokens": [1, 5, 9, 20, 21, 30, 31, 22, 7], "mask": [0, 0, 0, 1, 1, 0, 0, 1, 1], "advantage": 0.75},
    {"tokens": [1, 6, 40, 41], "mask": [0, 0, 1, 1], "advantage": -0.25},
    {"tokens": [1, 5, 8, 50, 51, 52], "mask": [0, 0, 0, 1, 1, 1], "advantage": -0.5},
]


def reference_loss(model, batch, normalization, temperature, L):
    """Sample by sample, token by token, over mask-1 predicted tokens: -A * pi/stopgrad(pi) (value -A, gradient
    -A * d log pi: REINFORCE)."""
    N = sum(sum(s["mask"][1:]) for s in batch)
    total = 0.0
    for s in batch:
        logits = model(torch.tensor([s["tokens"][:-1]]))[0] / temperature
        logp = F.log_softmax(logits, -1)
        terms = [
            -s["advantage"] * torch.exp(logp[t, s["tokens"][t + 1]] - logp[t, s["tokens"][t + 1]].detach())
            for t in range(len(s["tokens"]) - 1)
            if s["mask"][t + 1]
        ]
        row = sum(terms)
        total = (
            total
            + {
                "token": row / N,
                "sequence": row / len(terms) / len(batch),
                "constant": row / (len(batch) * L),
            }[normalization]
        )
    return total


@pytest.mark.parametrize("normalization", ["token", "sequence", "constant"])
def test_learner_step_equals_reference(tmp_path, small_tokenizer, normalization):
    ckpt = tiny_checkpoint(tmp_path / "ck", small_tokenizer, seed=3)
    cfg = rl_config(checkpoint=ckpt, normalization=normalization, micro_batch_size=2, temperature=0.7, max_tokens=8,
                   matrix_lr=0.01, embedding_lr=0.1, unembedding_lr=0.01, scalar_lr=0.01, grad_clip=0.5)  # fmt: skip
    learner = Learner(ckpt, cfg)
    # make lm_head non-trivial so logits (and gradients everywhere) are not near zero
    with torch.no_grad():
        learner.model.lm_head.weight.normal_(0, 0.5, generator=torch.Generator().manual_seed(0))
    ref_model, _, _ = load_model(ckpt)
    ref_model.load_state_dict(learner.model.state_dict())
    ref_model.train()
    # SGD makes the update exactly -lr * clipped gradient, so the comparison checks the gradient itself
    learner.optimizers = [torch.optim.SGD(learner.model.parameters(), lr=0.1)]
    ref_opts = [torch.optim.SGD(ref_model.parameters(), lr=0.1)]

    stats = learner.step([dict(s) for s in BATCH])

    loss = reference_loss(ref_model, BATCH, normalization, 0.7, 8)
    loss.backward()
    norm = torch.nn.utils.clip_grad_norm_(list(ref_model.parameters()), 0.5)
    for opt in ref_opts:
        opt.step()
    # by hand: row sums of -A are -3 (4 tokens), +0.5 (2), +1.5 (3); N = 9, S = 3, L = 8
    hand = {"token": -1 / 9, "sequence": (-0.75 + 0.25 + 0.5) / 3, "constant": -1 / 24}[normalization]
    assert stats["loss"] == pytest.approx(hand, abs=1e-6) and loss.item() == pytest.approx(hand, abs=1e-6)
    assert stats["grad_norm"] == pytest.approx(norm.item(), rel=1e-4)
    assert stats["num_tokens"] == 9 and stats["num_sequences"] == 3 and stats["version"] == 1
    assert stats["normalization"] == normalization and stats["ratio_mean"] == pytest.approx(1.0)
    ref = dict(ref_model.named_parameters())
    for name, p in learner.model.named_parameters():
        assert torch.allclose(p, ref[name], atol=1e-6), name
    assert any(
        not torch.equal(p, q) for p, q in zip(learner.model.parameters(), load_model(ckpt)[0].parameters())
    )


def test_default_optimizers_step(tmp_path, small_tokenizer):
    """With the default Muon + AdamW (build_optimizers) the update matches the reference up to Muon's
    low-precision Newton-Schulz iteration."""
    ckpt = tiny_checkpoint(tmp_path / "ck", small_tokenizer, seed=3)
    cfg = rl_config(checkpoint=ckpt, micro_batch_size=2)
    learner = Learner(ckpt, cfg)
    ref_model, _, _ = load_model(ckpt)
    ref_model.train()
    ref_opts = build_optimizers(ref_model, cfg.optim)
    learner.step([dict(s) for s in BATCH])
    reference_loss(ref_model, BATCH, "token", 1.0, 48).backward()
    torch.nn.utils.clip_grad_norm_(list(ref_model.parameters()), cfg.optim.grad_clip)
    for opt in ref_opts:
        opt.step()
    start = dict(load_model(ckpt)[0].named_parameters())
    for name, p in learner.model.named_parameters():
        step, ref_step = p - start[name], ref_model.get_parameter(name) - start[name]
        rel = ((step - ref_step).norm() / ref_step.norm().clamp(min=1e-12)).item()
        assert rel < 0.05, (name, rel)


def test_micro_batch_size_does_not_change_the_update(tmp_path, small_tokenizer):
    ckpt = tiny_checkpoint(tmp_path / "ck", small_tokenizer, seed=4)
    cfg = rl_config(checkpoint=ckpt, micro_batch_size=1)
    a, b = Learner(ckpt, cfg), Learner(ckpt, rl_config(checkpoint=ckpt, micro_batch_size=3))
    sa, sb = a.step([dict(s) for s in BATCH]), b.step([dict(s) for s in BATCH])
    assert sa["loss"] == pytest.approx(sb["loss"], rel=1e-5) and sa["grad_norm"] == pytest.approx(
        sb["grad_norm"], rel=1e-4
    )
    for p, q in zip(a.model.parameters(), b.model.parameters()):
        assert torch.allclose(p, q, atol=1e-6)


def test_checkpoint_round_trip_restores_optimizer(tmp_path, small_tokenizer):
    ckpt = tiny_checkpoint(tmp_path / "ck", small_tokenizer, seed=5)
    cfg = rl_config(checkpoint=ckpt)
    a = Learner(ckpt, cfg)
    a.step([dict(s) for s in BATCH])
    checkpoints = CheckpointManager(open_storage(tmp_path), "rl")
    checkpoints.prepare(1)
    checkpoints.commit(1, [a.save(checkpoints, step=1)], "rl")  # what RLRun.save does with its learners
    b = Learner(ckpt, cfg)
    assert b.restore(checkpoints.uri(1)) == {"step": 1, "version": 1} and b.version == 1
    assert b.weights_hash() == a.weights_hash()
    # same optimizer state -> the next update is identical
    a.step([dict(s) for s in BATCH[:2]])
    b.step([dict(s) for s in BATCH[:2]])
    assert b.weights_hash() == a.weights_hash()


def test_a_rank_the_checkpoints_world_lacked_restores_its_version(tmp_path, small_tokenizer):
    """Resuming with more --learner-workers than the checkpoint was saved by: rank 1 of 2 restores a checkpoint
    of one learner (it indexed the old world's data states by its own rank: IndexError)."""
    ckpt = tiny_checkpoint(tmp_path / "ck", small_tokenizer, seed=5)
    a = Learner(ckpt, rl_config(checkpoint=ckpt))
    a.step([dict(s) for s in BATCH])
    checkpoints = CheckpointManager(open_storage(tmp_path), "rl")
    checkpoints.prepare(1)
    checkpoints.commit(1, [a.save(checkpoints, step=1)], "rl")
    b = Learner(ckpt, rl_config(checkpoint=ckpt, learner_workers=2), rank=1, world_size=2)
    assert b.restore(checkpoints.uri(1)) == {"step": 1, "version": 1} and b.version == 1
    assert b.weights_hash() == a.weights_hash()


def test_learner_runs_fp8_and_compile_like_the_trainer(tmp_path, small_tokenizer):
    """--fp8 and --compile (the trainer's option names, RLConfig.model): the learner's hidden Linear layers become
    torchao Float8Linear (emulated on CPU), its step runs the compiled model through the one forward_backward,
    and the update is the plain learner's up to FP8 rounding; the weights keep the plain layout (publishing,
    checkpoints)."""
    ckpt = tiny_checkpoint(tmp_path / "ck", small_tokenizer, seed=3)
    plain = Learner(ckpt, rl_config(checkpoint=ckpt, micro_batch_size=2))
    fast = Learner(ckpt, rl_config(checkpoint=ckpt, micro_batch_size=2, fp8=True, compile=True))
    assert not plain.cfg.model.fp8 and not plain.cfg.model.compile and plain.train_model is plain.model
    assert type(fast.train_model).__name__ == "OptimizedModule" and fast.train_model._orig_mod is fast.model
    converted = sorted(
        n.split(".")[-1] for n, m in fast.model.named_modules() if type(m).__name__ == "Float8Linear"
    )
    assert converted == sorted(["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])
    for learner in (plain, fast):
        with torch.no_grad():  # the tiny init's lm_head is ~0: make the gradients reach every layer
            for name, p in learner.model.named_parameters():
                if name.endswith(("lm_head.weight", "o_proj.weight", "down_proj.weight")):
                    p.normal_(0, 0.5, generator=torch.Generator().manual_seed(0))
        # SGD makes the update exactly -lr * clipped gradient, so the comparison checks the gradient itself
        learner.optimizers = [torch.optim.SGD(learner.model.parameters(), lr=0.1)]
    start = {k: v.clone() for k, v in plain.model.state_dict().items()}
    a, b = plain.step([dict(s) for s in BATCH]), fast.step([dict(s) for s in BATCH])
    # on-policy the loss's value is -sum(A) / N whatever the model: rows -3, +0.5, +1.5 over N = 9 tokens
    assert a["loss"] == pytest.approx(-1 / 9, abs=1e-6) and b["loss"] == pytest.approx(-1 / 9, abs=1e-6)
    assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=0.1) and b["grad_norm"] != a["grad_norm"]
    assert b["num_tokens"] == 9 and b["version"] == 1
    assert {k: v.shape for k, v in fast.model.state_dict().items()} == {
        k: v.shape for k, v in plain.model.state_dict().items()
    }
    # e4m3 forward and e5m2 gradient casts (3 and 2 mantissa bits) move every update by 13-20% (measured), so
    # FP8 did run, and no more than that: the gradient is the plain one's
    for (name, p), q in zip(fast.model.named_parameters(), plain.model.parameters()):
        step, ref_step = p - start[name], q - start[name]
        rel = ((step - ref_step).norm() / ref_step.norm()).item()
        assert 0.02 < rel < 0.35, (name, rel)
