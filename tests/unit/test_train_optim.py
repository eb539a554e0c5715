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
from raychat.speedrun import speedrun_flags
from raychat.train.muon import Muon
from raychat.train.optim import build_optimizers, lr_multiplier, muon_ns_choice, set_lr
from raychat.train.plan import make_plan, mfu_line, peak_flops_of, print_plan

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


def test_a_run_resumed_with_other_lrs_and_weight_decay_trains_with_them(tmp_path):
    """torch's load_state_dict put the checkpoint's lr, initial_lr and weight_decay back into every param group:
    `pretrain` resumed with --matrix-lr 0.05 --weight-decay 0 went on at 0.02 and 0.1, while its next
    checkpoint's meta.json recorded 0.05 and 0. The moments still come from the checkpoint."""
    model = _model()
    optimizers = build_optimizers(model, _cfg("float32"))
    _train(model, optimizers, range(2))
    save_optimizers(tmp_path, optimizers)
    changed = {**LRS, "matrix_lr": 0.05, "embedding_lr": 0.5, "weight_decay": 0.0, "ns_dtype": "float32"}
    resumed = build_optimizers(model, from_dict(TrainConfig, changed).optim)
    load_optimizers(tmp_path, resumed)
    muon, adamw = resumed
    assert (muon.param_groups[0]["initial_lr"], muon.param_groups[0]["weight_decay"]) == (0.05, 0.0)
    assert adamw.param_groups[0]["initial_lr"] == pytest.approx(0.5 * (768 / 128) ** 0.5)  # width 128
    assert set_lr(resumed, 0.5) == 0.025  # the schedule scales this run's peak
    p, q = optimizers[0].param_groups[0]["params"][0], muon.param_groups[0]["params"][0]
    assert torch.equal(optimizers[0].state[p]["momentum_buffer"], muon.state[q]["momentum_buffer"])
    assert adamw.state[adamw.param_groups[0]["params"][0]]["step"] == 2


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


def test_the_plan_shows_the_settings_the_run_trains_with(capsys):
    """`--dry-run` printed sizes only: a user's preset (its lrs, schedule, clipping, FP8, cadence) was
    nowhere to check, and --help shows the flags' defaults, not the preset's. The AdamW lrs are printed as
    applied: x (768 / width) ** 0.5 = sqrt(6) = 2.449 at width 128 (depth 2 x aspect ratio 64)."""
    values = dict(depth=2, aspect_ratio=64, head_dim=32, num_iterations=40, total_batch_size=4096,
                  matrix_lr=0.03, warmup_ratio=0.25, warmdown_ratio=0.5, final_lr_frac=0.1, weight_decay=0.1,
                  grad_clip=0.5, fp8=True, eval_every=4, checkpoint_every=2, keep_checkpoints=1, log_every=5)  # fmt: skip
    cfg = from_dict(TrainConfig, values)
    plan = make_plan(cfg, VOCAB)
    assert build_optimizers(GPT(ModelConfig(**plan.model_config)), cfg.optim)[1].param_groups[0][
        "lr"
    ] == pytest.approx(0.2 * 6**0.5)  # what the plan's embedding lr says
    print_plan(cfg, plan)
    out = capsys.readouterr().out
    # 6N + 12 x layers x heads x head_dim x T (4 heads of 32, T 256): forward and backward, as MFU counts them
    assert (
        f"FLOPs per token: {6 * plan.scaling_params + 12 * 2 * 4 * 32 * 256:,} (training: 6 x parameters without "
        "the embedding + attention)\n" in out
    )
    assert out.splitlines()[-6:-1] == [
        "lr (peak): Muon 0.03 for the hidden matrices; AdamW x 2.449 (= (width 128 / 768) ** -0.5): embedding "
        "0.4899, lm_head 0.009798, norms 0.04899",
        "schedule: lr warmup 10 steps (0.25 of 40) from 0.1 x peak, constant, warmdown 20 steps (0.5) to 0.1 x "
        "peak after the last step, which trains at 0.145 x peak",
        "regularization: Muon weight decay 0.1, grad clipping at global norm 0.5",
        "precision: float32 on CPU, FP8 tensorwise (torchao, emulated on CPU), torch.compile off",
        "cadence: a log line every 5 steps; evaluation every 4 steps and at the end; checkpoint every 2 steps "
        "and at the end, the newest 1 kept",
    ]
    off = from_dict(
        TrainConfig, {**values, "grad_clip": 0, "eval_every": 0, "checkpoint_every": 0, "fp8": False}
    )
    print_plan(off, make_plan(off, VOCAB))
    out = capsys.readouterr().out
    assert "regularization: Muon weight decay 0.1, no grad clipping\n" in out
    assert "precision: float32 on CPU, FP8 off, torch.compile off\n" in out
    assert "evaluation at the end only; checkpoint at the end only, the newest 1 kept\n" in out
    assert out.splitlines()[-1] == CPU_MFU


CPU_MFU = (
    "mfu: n/a on CPU (a CPU has no known peak FLOP/s): give --peak-flops, the peak FLOP/s of one worker's device, "
    "to get it"
)


def test_the_plan_says_once_what_mfu_is_measured_against():
    """A CPU run's step lines said `mfu n/a` every step and nothing why; the plan now says it once, with the flag
    that gets MFU (as the speedrun names it: its preset's key), and what a GPU run's MFU divides by."""
    cfg = lambda **kw: from_dict(TrainConfig, kw)  # noqa: E731
    assert mfu_line(cfg()) == CPU_MFU
    assert mfu_line(cfg(peak_flops=2e12)) == "mfu: over --peak-flops 2e12 FLOP/s a device"
    assert mfu_line(cfg(use_gpu=True)) == (
        "mfu: over the dense bf16 peak of a known GPU (H100 PCIe, H100 NVL, H100, H200 NVL, H200, A100, L4, A10G); "
        "n/a on another: give --peak-flops, the peak FLOP/s of one worker's device, to get it"
    )
    assert mfu_line(cfg(), speedrun_flags("tiny", "pretrain").option) == CPU_MFU.replace(
        "--peak-flops", "train.peak_flops"
    )


@pytest.mark.parametrize(
    "name,peak",
    [
        ("NVIDIA H100 80GB HBM3", 989e12),
        ("NVIDIA H100 PCIe", 756e12),
        ("NVIDIA H100 NVL", 835e12),
        ("NVIDIA H200", 989e12),
        (
            "NVIDIA H200 NVL",
            835e12,
        ),  # its own data sheet: 1,671 TFLOP/s bf16 with sparsity; had the SXM's 989
        ("NVIDIA A100-SXM4-80GB", 312e12),
        ("NVIDIA L4", 121e12),
        ("NVIDIA L40S", None),
        ("NVIDIA L40", None),
        ("NVIDIA GH200 480GB", None),
    ],
)
def test_a_gpus_peak_is_looked_up_by_its_whole_model_name(name, peak):
    """MFU's denominator (Trainer.peak_flops, bench/gpu_check.py). Matched as a substring, "L4" gave an L40S the
    L4's 121 TFLOP/s (its MFU read ~3x too high) and "H100" gave the PCIe card the SXM's 989 (~24% too low);
    a GPU of no known model gets None (MFU n/a, --peak-flops gives it)."""
    assert peak_flops_of(name) == peak


def test_pretrain_help_shows_the_flags_defaults_and_the_plan_the_presets(tmp_path, capsys):
    """`pretrain --help` says `--checkpoint-every ... (default: 100)`, the flag's own default, while a run with
    the default --preset cpu checkpoints every 125 steps: the help says so, and --dry-run's plan shows 125."""
    from raychat.cli import main

    with pytest.raises(SystemExit):
        main(["pretrain", "--help"])
    flat = " ".join(capsys.readouterr().out.split())
    assert "steps between checkpoints (and at the end; 0 = only at the end) (default: 100)" in flat
    assert (
        "The defaults shown below are the flags' own: the preset (--preset, default cpu) sets many of them"
        in flat
    )
    assert main(["pretrain", "--storage-path", str(tmp_path / "runs"), "--dry-run"]) == 0
    assert (
        "cadence: a log line every 1 step; evaluation every 50 steps and at the end; checkpoint every 125 steps "
        "and at the end, the newest 2 kept\n" in capsys.readouterr().out
    )
