"""build_optimizers: which parameters Muon and AdamW get, the Newton-Schulz dtype choice, and exact resume
through the trainer's checkpoint functions (raychat.checkpoint: save_optimizers / save_rank_state and
load_optimizers / load_rng / load_rank_states)."""

import pytest
import torch

from raychat.checkpoint import load_optimizers, load_rank_states, load_rng, save_optimizers, save_rank_state
from raychat.config import ConfigError, TrainConfig, from_dict
from raychat.loss import cross_entropy_sum, global_target_count, normalize
from raychat.masks import make_batch
from raychat.model import GPT, ModelConfig
from raychat.train.muon import Muon
from raychat.train.optim import build_optimizers, lr_multiplier, muon_ns_choice, set_lr
from raychat.train.plan import make_plan, print_plan

LRS = {
    "matrix_lr": 0.02,
    "embedding_lr": 0.2,
    "unembedding_lr": 0.004,
    "scalar_lr": 0.02,
    "weight_decay": 0.1,
}


def _cfg(ns_dtype: str = "auto"):
    return from_dict(TrainConfig, {**LRS, "ns_dtype": ns_dtype}).optim


VOCAB = 256


def _model(seed: int = 0) -> GPT:
    # depth 2, width 128, 2 heads of 64, SwiGLU hidden 384
    return GPT(ModelConfig.from_depth(2, VOCAB, 32)).init_weights(seed)


def _train(model: GPT, optimizers: list, steps: range, n_iter: int = 6) -> None:
    """The loop's step (raychat.train.loop): scheduled lr, 2 micro-batches, token-normalized CE, clip."""
    for step in steps:
        g = torch.Generator().manual_seed(step)
        micro = [make_batch(torch.randint(1, VOCAB, (2, 33), generator=g), bos_id=0) for _ in range(2)]
        set_lr(optimizers, lr_multiplier(step, n_iter, 0.0, 0.5, 0.0))
        n = global_target_count(mb["loss_mask"] for mb in micro)
        for mb in micro:
            logits = model(mb["input_ids"], position_ids=mb["position_ids"])
            normalize(cross_entropy_sum(logits, mb["labels"], mb["loss_mask"])[0], n).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        for opt in optimizers:
            opt.step()
        for opt in optimizers:
            opt.zero_grad(set_to_none=True)


def test_muon_gets_the_hidden_matrices_and_adamw_the_rest():
    model = _model()
    muon, adamw = build_optimizers(model, _cfg("float32"))
    assert isinstance(muon, Muon) and muon.ns_dtype == torch.float32
    names = {id(p): n for n, p in model.named_parameters()}
    muon_names = {names[id(p)] for p in muon.param_groups[0]["params"]}
    per_layer = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
    assert len(muon_names) == 2 * len(per_layer)
    assert all(n.endswith(".weight") and n.split(".")[-2] in per_layer for n in muon_names)
    groups = [[names[id(p)] for p in g["params"]] for g in adamw.param_groups]
    assert groups[0] == ["model.embed_tokens.weight"] and groups[1] == ["lm_head.weight"]
    assert all(names[id(p)].endswith("norm.weight") for p in adamw.param_groups[2]["params"])
    scale = (128 / 768) ** -0.5
    assert [g["initial_lr"] for g in adamw.param_groups] == pytest.approx(
        [0.2 * scale, 0.004 * scale, 0.02 * scale]
    )
    assert muon.param_groups[0]["weight_decay"] == 0.1 and muon.param_groups[0]["initial_lr"] == 0.02


def test_ns_dtype_setting():
    model = _model()
    assert build_optimizers(model, _cfg("bfloat16"))[0].ns_dtype == torch.bfloat16
    choice = muon_ns_choice(model)  # "auto": by the CPU's capability
    assert choice.dtype == (torch.bfloat16 if torch.cpu._is_avx512_bf16_supported() else torch.float32)
    assert build_optimizers(model, _cfg())[0].ns_dtype == choice.dtype
    assert choice.describe().startswith("Newton-Schulz in ") and choice.device == "cpu"
    with pytest.raises(ConfigError, match=r"--ns-dtype .*'auto', 'float32', 'bfloat16'"):
        _cfg("fp8")


@pytest.mark.parametrize("ns_dtype", ["float32", "bfloat16"])
def test_resume_from_checkpoint_gives_bit_identical_steps(tmp_path, ns_dtype):
    """Train 2 steps, checkpoint (weights + optimizer file + rank state), resume into a fresh model: the next 3 steps
    match an uninterrupted run bit for bit (Muon momentum, AdamW moments and step, lr schedule)."""
    model = _model()
    optimizers = build_optimizers(model, _cfg(ns_dtype))
    _train(model, optimizers, range(2))
    weights = {k: v.clone() for k, v in model.state_dict().items()}
    save_optimizers(tmp_path, optimizers)
    save_rank_state(tmp_path, 0, {"step": 2})

    resumed = _model(seed=1)
    resumed.load_state_dict(weights)
    resumed_opts = build_optimizers(resumed, _cfg(ns_dtype))
    load_optimizers(tmp_path, resumed_opts)
    assert load_rng(tmp_path, 0) and load_rank_states(tmp_path) == [{"step": 2}]
    cold = _model(seed=1)  # same weights, fresh optimizer state: must differ (the test can fail)
    cold.load_state_dict(weights)
    cold_opts = build_optimizers(cold, _cfg(ns_dtype))

    for m, opts in ((model, optimizers), (resumed, resumed_opts), (cold, cold_opts)):
        _train(m, opts, range(2, 5))
    for (name, p), q in zip(model.named_parameters(), resumed.parameters()):
        assert torch.equal(p, q), name
    assert any(not torch.equal(p, r) for p, r in zip(model.parameters(), cold.parameters()))
    for a, b in zip(optimizers, resumed_opts):
        for p, q in zip(a.param_groups[0]["params"], b.param_groups[0]["params"]):
            for key, value in a.state[p].items():
                assert torch.equal(torch.as_tensor(value), torch.as_tensor(b.state[q][key])), key


@pytest.mark.parametrize(
    ("avx512_bf16", "ns_dtype", "expected"),
    [
        (
            False,
            "auto",
            "Newton-Schulz in float32 on cpu (the CPU has no AVX512-BF16: bf16 matmul is emulated)",
        ),
        (True, "auto", "Newton-Schulz in bfloat16 on cpu (the CPU has AVX512-BF16)"),
        (True, "float32", "Newton-Schulz in float32 on cpu (requested)"),
    ],
)
def test_the_printed_plan_shows_the_newton_schulz_choice(
    monkeypatch, capsys, avx512_bf16, ns_dtype, expected
):
    """The capability rule's answer and its reason are in the plan the driver prints before training."""
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: avx512_bf16)
    cfg = from_dict(TrainConfig, {"ns_dtype": ns_dtype, "num_iterations": 10, "total_batch_size": 4096})
    print_plan(cfg, make_plan(cfg, VOCAB))
    lines = capsys.readouterr().out.splitlines()
    assert (
        f"optimizer: Muon for the hidden matrices, {expected}; AdamW for the embedding, lm_head and norms"
        in lines
    )


def test_the_plan_of_a_gpu_run_on_a_driver_without_cuda_names_the_workers_rule(capsys):
    if torch.cuda.is_available():
        pytest.skip("this driver has CUDA: the plan shows its own GPU's choice")
    cfg = from_dict(TrainConfig, {"use_gpu": True, "num_iterations": 10, "total_batch_size": 4096})
    print_plan(cfg, make_plan(cfg, VOCAB))
    assert (
        "Muon for the hidden matrices, Newton-Schulz dtype chosen on each GPU worker: bfloat16 at compute "
        "capability >= 8.0, else float32; AdamW" in capsys.readouterr().out
    )
