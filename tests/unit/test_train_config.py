import argparse
import os
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from raychat.checkpoint_manager import commit_directory
from raychat.cli import main as raychat_main
from raychat.commands import PARSERS
from raychat.config import (
    ConfigError,
    TrainConfig,
    add_flags,
    from_dict,
    preset_names,
    preset_values,
    to_dict,
)
from raychat.data.corpus.shards import write_manifest, write_shards
from raychat.log import size
from raychat.loss import cross_entropy_sum, normalize
from raychat.model import ModelConfig
from raychat.train import launch
from raychat.train.launch import (
    COMMANDS,
    config_from,
    elastic_grad_accum,
    scaling_config,
    schedule_change,
    stopped_early_line,
)
from raychat.train.optim import lr_multiplier, lr_peak_from, warmdown_start
from raychat.train.plan import (
    make_plan,
    power_law_batch_size,
    print_plan,
    round_to_micro_steps,
    schedule_line,
)
from raychat.train.pretrain import data_line
from raychat.train.sft import sft_defaults


def test_lr_schedule_by_hand():
    # 10 steps, 2 warmup, 4 warmdown to 0.1
    lrs = [lr_multiplier(s, 10, 0.2, 0.4, 0.1) for s in range(10)]
    assert lrs[:2] == [0.5, 1.0]
    assert lrs[2:6] == [1.0] * 4
    assert lrs[6:] == pytest.approx([1.0, 0.775, 0.55, 0.325])


@pytest.mark.parametrize(
    "n, multipliers, last_words",
    [
        (1, [1.0], "warmdown 0 steps (0.4): the last step trains at 1 x peak"),  # W = round(0.4) = 0
        (2, [1.0, 1.0], "warmdown 1 step (0.4) to 0 x peak after the last step, which trains at 1 x peak"),
        (3, [1.0] * 3, "warmdown 1 step (0.4) to 0 x peak after the last step, which trains at 1 x peak"),
        (5, [1.0] * 4 + [0.5], "warmdown 2 steps (0.4) to 0 x peak after the last step, which trains at 0.5 x peak"),
        (10, [1.0] * 7 + [0.75, 0.5, 0.25], "warmdown 4 steps (0.4) to 0 x peak after the last step, which trains "
         "at 0.25 x peak"),
    ],
)  # fmt: skip
def test_the_warmdown_of_a_small_run_by_hand(n, multipliers, last_words):
    """A user's 2-step SFT run planned "warmdown 1 step (0.4) ... to 0 x peak" and trained both steps at the
    peak. The lr is nanochat's (base_train.py's get_lr_multiplier): warmdown W = round(0.4 n) steps from step
    n - W at (n - step) / W, 1 at its first step, 1 / W at the last; 0 (final_lr_frac) only at step n, after the
    last update, so no step is wasted at lr 0 and a 1-step warmdown keeps the peak. The plan now says so."""
    assert [lr_multiplier(s, n, 0.0, 0.4, 0.0) for s in range(n)] == multipliers
    line = schedule_line(from_dict(TrainConfig, {"num_iterations": n}), n)
    assert line == f"schedule: lr warmup 0 steps (0 of {n}), constant, {last_words}"


def test_the_schedule_of_a_normal_run_and_a_warmup_by_hand():
    """1000 steps, warmdown 400 from step 600: step 600 at 1, step 800 at 200 / 400, the last (999) at 1 / 400;
    with final_lr_frac 0.1 the last is 0.0025 + 0.9975 x 0.1 = 0.10225. A warmup of 2 of 8 steps starts at
    1 / 2 and a 1-step one at the peak, as a 1-step warmdown ends there."""
    assert [lr_multiplier(s, 1000, 0.0, 0.4, 0.0) for s in (599, 600, 601, 800, 999, 1000)] == pytest.approx(
        [1.0, 1.0, 0.9975, 0.5, 0.0025, 0.0]
    )
    assert lr_multiplier(999, 1000, 0.0, 0.4, 0.1) == pytest.approx(0.10225)
    assert schedule_line(from_dict(TrainConfig, {"final_lr_frac": 0.1}), 1000) == (
        "schedule: lr warmup 0 steps (0 of 1,000), constant, warmdown 400 steps (0.4) to 0.1 x peak after the "
        "last step, which trains at 0.1023 x peak"
    )
    assert [lr_multiplier(s, 8, 0.25, 0.5, 0.1) for s in range(8)] == pytest.approx(
        [0.5, 1, 1, 1, 1, 0.775, 0.55, 0.325]
    )
    assert schedule_line(from_dict(TrainConfig, {"warmup_ratio": 0.25, "warmdown_ratio": 0.5}), 8).startswith(
        "schedule: lr warmup 2 steps (0.25 of 8) from 0.5 x peak, constant, warmdown 4 steps (0.5) to 0 x peak"
    )
    assert [lr_multiplier(s, 4, 0.25, 0.25, 0.0) for s in range(4)] == [1.0] * 4  # U = W = 1: all at the peak
    assert schedule_line(from_dict(TrainConfig, {"warmup_ratio": 0.25, "warmdown_ratio": 0.25}), 4) == (
        "schedule: lr warmup 1 step (0.25 of 4) from 1 x peak, constant, warmdown 1 step (0.25) to 0 x peak "
        "after the last step, which trains at 1 x peak"
    )


def test_lr_at_a_resume_step_under_another_horizon_by_hand():
    """A run of 10 steps (2 warmup, warmdown from step 6 to 0.1) resumed at step 8 (multiplier 0.55) with
    another horizon N: warmup round(0.2 N), warmdown round(0.4 N) from step N - round(0.4 N)."""
    schedule = (0.2, 0.4, 0.1)
    assert (warmdown_start(10, 0.4), warmdown_start(20, 0.4), warmdown_start(9, 0.4)) == (6, 12, 5)
    assert lr_multiplier(8, 10, *schedule) == pytest.approx(0.55)  # progress 2/4: 0.5 + 0.5 * 0.1
    # 20 steps: step 8 is before the new warmdown (12): back to the peak, 1
    assert lr_multiplier(8, 20, *schedule) == 1.0
    assert lr_peak_from(8, 20, *schedule) == 1.0
    # 9 steps: warmdown 4 from step 5; progress 1/4: 0.25 + 0.75 * 0.1 = 0.325, and never higher after
    assert lr_multiplier(8, 9, *schedule) == pytest.approx(0.325)
    assert lr_peak_from(8, 9, *schedule) == pytest.approx(0.325)
    # 1000 steps: step 9 is in the new warmup of 200 (10/200 = 0.05, below the old 0.325), which then climbs
    # to 1 at step 199
    assert lr_multiplier(9, 10, *schedule) == pytest.approx(0.325)
    assert lr_multiplier(9, 1000, *schedule) == pytest.approx(0.05)
    assert lr_peak_from(9, 1000, *schedule) == 1.0


def test_the_resume_line_numbers_steps_as_the_step_lines_do():
    """Step lines count from 1 ("step 10/10" is the last), but the resume line said "warmdown from step 8" of a
    10-step run whose plan says "warmdown 2 steps (0.2)": 0-based. Those 2 steps are 9 (still at the peak) and
    10 (0.5: the first lowered); a checkpoint of step 9 resumes with step 10 at (10 - 9) / 2 = 0.5, or
    (10 - 9) / 4 = 0.25 under a warmdown of 0.4 (4 steps: 7..10)."""
    was = from_dict(TrainConfig, {"num_iterations": 10, "warmup_ratio": 0, "warmdown_ratio": 0.2})
    assert schedule_line(was, 10).startswith(
        "schedule: lr warmup 0 steps (0 of 10), constant, warmdown 2 steps"
    )
    assert [lr_multiplier(s, 10, 0, 0.2, 0) for s in (7, 8, 9)] == [1, 1, 0.5]  # 0-based: steps 8, 9, 10

    def line(step: int, **now):
        cfg = from_dict(TrainConfig, {**to_dict(was), **now})
        meta = {"step": step, "plan": {"num_iterations": 10}, "config": to_dict(was)}
        return schedule_change(
            meta, cfg, SimpleNamespace(num_iterations=cfg.train.horizon.num_iterations), "d", COMMANDS
        )

    assert line(9, warmdown_ratio=0.4) == (
        "lr schedule changed on resume (--warmdown-ratio: 0.2 -> 0.4): 10 -> 10 steps, warmdown from step 9 -> 7; "
        "lr multiplier of step 10 (the first this run trains): 0.5 -> 0.25"
    )
    assert line(5, num_iterations=20) == (  # 20 steps: warmdown 4 steps, 17..20
        "lr schedule changed on resume (--num-iterations: 10 -> 20): 10 -> 20 steps, warmdown from step 9 -> 17; "
        "lr multiplier of step 6 (the first this run trains): 1 -> 1"
    )
    with pytest.raises(ConfigError) as refused:
        line(9, num_iterations=20)
    assert str(refused.value) == (
        "--num-iterations: the run's checkpoint d (step 9) was made with 10, this run asks for 20: its lr warmdown "
        "began at step 9 and is at multiplier 0.5; this run's schedule would raise it to 1 (--allow-rewarm to "
        "re-warm on purpose, or the checkpoint's settings to finish the warmdown)"
    )


def test_lr_at_or_past_the_last_step_is_the_schedules_end():
    """A finished run's checkpoint (step N) resumed with a longer horizon: under its own schedule step N is
    the end's value, final_lr_frac, or 1 without a warmdown (this once divided by a warmdown of 0)."""
    assert lr_multiplier(10, 10, 0.2, 0.4, 0.1) == pytest.approx(0.1)
    assert lr_multiplier(12, 10, 0.2, 0.4, 0.1) == pytest.approx(0.1)
    assert lr_multiplier(10, 10, 0.0, 0.0, 0.0) == 1.0
    assert lr_multiplier(9, 10, 0.0, 0.0, 0.0) == 1.0


def test_grad_accum_derived_and_clear_error():
    """The refusal names the flags as typed (it said `device_batch_size x seq_len x num_workers`) and the nearest
    totals allowed: 10000 // 4096 = 2 -> 8192 or 12288."""
    cfg = from_dict(TrainConfig, dict(device_batch_size=8, seq_len=256, num_workers=2))
    assert cfg.grad_accum_steps(16384) == 4
    with pytest.raises(ValueError) as e:
        cfg.grad_accum_steps(10000)
    assert str(e.value) == (
        "--total-batch-size 10000 is not a multiple of --device-batch-size x --seq-len x --num-workers = "
        "8 x 256 x 2 = 4096; allowed: a multiple of 4096, e.g. 8192 or 12288"
    )


def test_power_law_batch_size():
    assert power_law_batch_size(1e10, 4096) == 2**19  # the anchor
    # 2^19 * (1e8 / 1e10) ** 0.383 = 89,044 -> nearest power of two 2^16 (log2 = 16.44)
    assert power_law_batch_size(1e8, 4096) == 2**16
    assert power_law_batch_size(1e3, 4096) == 4096  # never below one micro-step


def test_round_to_micro_steps_by_hand():
    assert round_to_micro_steps(65536, 6144) == 67584  # 10.67 micro-steps -> 11
    assert round_to_micro_steps(65536, 12288) == 61440  # 5.33 -> 5
    assert round_to_micro_steps(3072, 6144) == 6144  # a half rounds up
    assert round_to_micro_steps(100, 6144) == 6144  # never below one micro-step


@pytest.mark.parametrize(
    "workers, total, accum, counted",
    [
        (1, 65536, 32, "1 worker"),
        (2, 65536, 16, "2 workers"),
        (3, 67584, 11, "3 workers"),
        (6, 61440, 5, "6 workers"),
    ],
)
def test_automatic_batch_size_gives_a_valid_plan_for_any_worker_count(
    workers, total, accum, counted, capsys, tmp_path
):
    # depth 4, 20 tokens/param: D = 20 x 4,262,656 = 85.3M tokens -> power law 2^19 (D / 1e10)^0.383 = 84,534
    # -> 2^16 = 65,536, then rounded to a multiple of 8 rows x 256 tokens x workers
    values = dict(depth=4, seq_len=256, device_batch_size=8, num_workers=workers, target_param_data_ratio=20)
    cfg = from_dict(TrainConfig, values)
    p = make_plan(cfg, vocab_size=4096)
    assert (p.auto_batch_size, p.total_batch_size, p.grad_accum) == (65536, total, accum)
    assert p.num_iterations == round(20 * 4_262_656 / total)
    print_plan(cfg, p)
    out = capsys.readouterr().out
    change = "kept" if total == 65536 else f"rounded to {total:,}"
    assert (  # counted: the plan once read "1 workers"
        f"batch: {total:,} tokens/step = {counted} x 8 rows x 256 tokens x {accum} accumulation steps\n"
        f"  (automatic: power law 65,536 tokens, {change}: the nearest multiple of {counted} x 8 rows x 256 "
        f"tokens = {workers * 2048:,})\n"
    ) in out
    assert not out.startswith("init from")
    ck = tmp_path / "long" / "checkpoint_000300"
    ck.mkdir(parents=True)
    commit_directory(ck, 300, "sft")
    print_plan(from_dict(TrainConfig, {**values, "init_from": str(ck)}), p)  # `latest`, resolved
    assert capsys.readouterr().out.startswith(f"init from: {ck} (sft checkpoint, step 300)\n")
    with pytest.raises(
        ValueError, match="not a multiple"
    ):  # an explicit batch that does not divide: an error
        make_plan(from_dict(TrainConfig, {**values, "total_batch_size": 8192 * 3 + 1024}), vocab_size=4096)


def test_plan_horizon_from_param_data_ratio():
    cfg = from_dict(
        TrainConfig,
        dict(
            depth=2,
            seq_len=64,
            device_batch_size=4,
            num_workers=2,
            total_batch_size=1024,
            target_param_data_ratio=10,
        ),
    )
    p = make_plan(cfg, vocab_size=512)
    assert p.grad_accum == 2  # 1024 / (4 * 64 * 2)
    assert p.num_iterations == round(10 * p.scaling_params / 1024)
    assert p.tokens == p.num_iterations * 1024


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--depth", "0"], "--depth must be a positive integer"),
        (["--device-batch-size", "-1"], "--device-batch-size must be a positive integer"),
        (["--fp8-recipe", "bogus"], "invalid choice"),
    ],
)
def test_bad_flags_are_clear_errors(flags, message, capsys):
    parser = argparse.ArgumentParser()
    add_flags(parser, TrainConfig, preset="cpu")
    try:
        args = parser.parse_args(flags)
    except SystemExit:
        assert message in capsys.readouterr().err
        return
    with pytest.raises(ValueError, match=message):
        config_from(args, TrainConfig(), "pretrain")


@pytest.mark.parametrize(
    "depth, ratio, head_dim, group, width, heads, allowed",
    [
        (1, 64, 32, 3, 64, 2, "1, 2"),  # the tiny preset's shape
        (3, 40, 32, 3, 128, 4, "1, 2, 4"),  # 120 rounded up to a multiple of 32
        (26, 64, 128, 2, 1664, 13, "1, 13"),  # the cluster preset's shape: 13 heads, a prime
        (2, 64, 64, 4, 128, 2, "1, 2"),  # a group larger than the heads
    ],
)
def test_a_kv_group_that_does_not_divide_the_heads_is_refused_by_the_config(
    depth, ratio, head_dim, group, width, heads, allowed, tmp_path, capsys
):
    """--kv-group was checked only when the model was built (raychat.model.ModelConfig.from_depth, with torch):
    `raychat submit` submitted the stage and the job failed in the cluster; a local run said "kv_group=3 must
    divide n_head=2", naming no flag. The config refuses it now, with the model's arithmetic worked by hand."""
    shape = {"depth": depth, "aspect_ratio": ratio, "head_dim": head_dim}
    message = (
        f"--kv-group {group} does not divide the {heads} query heads (width {width}: --depth {depth} x "
        f"--aspect-ratio {ratio} = {depth * ratio} rounded up to a multiple of --head-dim {head_dim}; {width} / "
        f"{head_dim} = {heads}); allowed: {allowed}"
    )
    with pytest.raises(ConfigError) as refused:
        from_dict(TrainConfig, {**shape, "kv_group": group})
    assert str(refused.value) == message
    with pytest.raises(
        ValueError, match=f"^kv_group={group} must divide n_head={heads}$"
    ):  # the model agrees
        ModelConfig.from_depth(depth, 512, 64, ratio, head_dim, group)
    largest = int(allowed.split(", ")[-1])  # the most KV sharing allowed: both build it
    assert from_dict(TrainConfig, {**shape, "kv_group": largest}).model.kv_group == largest
    assert ModelConfig.from_depth(depth, 512, 64, ratio, head_dim, largest).n_kv_head == 1
    if depth == 1:  # a local run refuses it at once with the same line, writing nothing
        argv = ["pretrain", "--preset", "tiny", "--storage-path", str(tmp_path / "runs"), "--kv-group", "3"]
        assert raychat_main(argv) == 2
        assert capsys.readouterr().err == (
            f"raychat pretrain: error: {message}  (RAYCHAT_DEBUG=1 shows the traceback)\n"
        )
        assert list(tmp_path.iterdir()) == []


def test_presets_load_and_validate():
    """Each shipped preset is valid on its own (a command checks it merged with its flags)."""
    assert preset_names() == ["cluster", "cpu", "gpu8", "tiny"]
    for name in preset_names():
        for stage in ("pretrain", "sft"):
            from_dict(TrainConfig, preset_values(name, stage))  # validated in __post_init__
    with pytest.raises(FileNotFoundError, match="known presets"):
        preset_values("nope", "pretrain")


def test_step_loss_is_token_normalized_over_micro_batches():
    """10 and 100 target tokens with CE 1.0 and 2.0 in separate micro-batches -> 210/110, not 1.5."""
    vocab = 4

    def logits_with_ce(ce, n):
        # logits [a, 0, 0, 0] with target 0: CE = log(1 + 3 e^-a) -> a = -log((e^ce - 1) / 3)
        a = -torch.log(torch.expm1(torch.tensor(ce)) / 3)
        x = torch.zeros(1, n, vocab)
        x[..., 0] = a
        return x.requires_grad_()

    mb1, mb2 = logits_with_ce(1.0, 10), logits_with_ce(2.0, 100)
    n_targets = 110
    total = 0.0
    for x in (mb1, mb2):
        s, n = cross_entropy_sum(
            x, torch.zeros(1, x.shape[1], dtype=torch.long), torch.ones(1, x.shape[1], dtype=torch.bool)
        )
        normalize(s, n_targets).backward()
        total += s.item()
    assert total / n_targets == pytest.approx(210 / 110, abs=1e-5)
    # one micro-batch holding both gives the same loss and gradients
    both = torch.cat([mb1.detach(), mb2.detach()], dim=1).requires_grad_()
    s, n = cross_entropy_sum(
        both, torch.zeros(1, 110, dtype=torch.long), torch.ones(1, 110, dtype=torch.bool)
    )
    assert n.item() == 110
    normalize(s, int(n)).backward()
    torch.testing.assert_close(both.grad, torch.cat([mb1.grad, mb2.grad], dim=1))
    # every token's gradient weight is 1/110: d(loss)/d(logit of target) = (p - 1) / 110
    p = torch.softmax(mb1.detach()[0, 0], -1)[0]
    assert mb1.grad[0, 0, 0].item() == pytest.approx((p.item() - 1) / 110, rel=1e-5)


def test_fp8_filter_and_eval_swap_share_weights():
    from torchao.float8.float8_linear import Float8Linear

    from raychat.train.fp8 import convert_to_fp8, fp8_filter, fp8_line, high_precision_linears

    keep = fp8_filter()
    assert keep(nn.Linear(64, 128), "model.layers.0.mlp.up_proj")
    assert not keep(nn.Linear(32, 15), "model.layers.0.x")
    assert not keep(nn.Linear(64, 128), "lm_head")

    net = nn.Sequential()
    net.add_module("big", nn.Linear(64, 128, bias=False))
    net.add_module("small", nn.Linear(128, 15, bias=False))
    net.add_module("lm_head", nn.Linear(15, 64, bias=False))
    assert convert_to_fp8(net, emulate=True) == 1
    assert isinstance(net.big, Float8Linear) and type(net.small) is nn.Linear
    assert fp8_line(net, "tensorwise") == (  # the run logs it: which layers --fp8 reached
        "FP8 (tensorwise): 1 of the model's 3 Linear layers train in FP8 (lm_head and layers with a dimension "
        "below 64 or not a multiple of 16 stay in high precision)"
    )
    narrow = nn.Sequential(nn.Linear(32, 48, bias=False))
    convert_to_fp8(narrow, emulate=True)
    assert fp8_line(narrow, "rowwise").startswith(
        "warning: --fp8: none of the model's 1 Linear layers trains in FP8"
    )
    x = torch.randn(4, 64)
    net(x).sum().backward()  # trains through torchao's emulated FP8 matmul on CPU
    weight = net.big.weight
    with high_precision_linears(net):
        assert type(net.big) is nn.Linear
        assert net.big.weight is weight  # shared, not copied
        torch.testing.assert_close(net.big(x), x @ weight.T)
    assert isinstance(net.big, Float8Linear) and net.big.weight is weight


def test_elastic_flag_scaling_config_and_batch_on_every_world_size():
    cfg = lambda **kw: from_dict(TrainConfig, dict(device_batch_size=2, seq_len=32, **kw))  # noqa: E731
    assert scaling_config(cfg(num_workers=2, min_workers=1)).num_workers == (1, 2)
    assert scaling_config(cfg(num_workers=2)).num_workers == 2  # min 0: fixed
    assert scaling_config(cfg(num_workers=2, min_workers=2)).num_workers == 2
    # 384 tokens = 2 rows x 32 tokens x {1 worker x 6, 2 workers x 3, 3 workers x 2} micro-batches
    assert elastic_grad_accum(cfg(num_workers=3, min_workers=1), 384) == {1: 6, 2: 3, 3: 2}
    assert elastic_grad_accum(cfg(num_workers=2), 384) == {2: 3}
    with pytest.raises(ValueError) as e:  # every world size 1..3 divides 2 x 32 x lcm(1, 2, 3) = 384
        elastic_grad_accum(cfg(num_workers=3, min_workers=1), 256)
    assert str(e.value) == (
        "--total-batch-size 256 is not a multiple of --device-batch-size x --seq-len x --num-workers = "
        "2 x 32 x 3 = 192; allowed: a multiple of 384, e.g. 384"
    )
    with pytest.raises(
        ValueError
    ) as e:  # the flag, the values allowed, the value given (as the range checks)
        cfg(num_workers=2, min_workers=3)
    assert str(e.value) == (
        "--min-workers must be 0 (fixed at --num-workers) or 1..2 (elastic, at most --num-workers 2), got 3"
    )
    with pytest.raises(ValueError) as e:
        cfg(num_workers=2, min_workers=-1)
    assert str(e.value) == "--min-workers must be >= 0, got -1"


def test_the_batch_line_submit_refuses_with_is_the_stages_own(capsys):
    """`raychat submit sft --preset tiny ... --num-workers 8` was accepted and the job failed in the cluster on its
    plan's line; submit now refuses it first (tests/unit/test_cli.py::test_a_submitted_stages_arguments_are_...)
    with what the stage's plan (make_plan, as `raychat sft` builds its config) raises."""
    parser = argparse.ArgumentParser()
    PARSERS["sft"](
        parser.add_subparsers()
    )  # `raychat sft`'s parser, and its config as raychat.train.sft.main
    cfg = config_from(
        parser.parse_args(["sft", "--preset", "tiny", "--num-workers", "8"]), sft_defaults(), "sft"
    )
    with pytest.raises(ValueError) as stage:
        make_plan(cfg, vocab_size=512)
    with pytest.raises(SystemExit):
        raychat_main(["submit", "sft", "--preset", "tiny", "--storage-path", "/mnt/r", "--num-workers", "8"])
    assert capsys.readouterr().err == (
        f"raychat submit: error: stage sft: {stage.value} (`raychat sft --help` lists its flags)\n"
    )
    assert str(stage.value).startswith("--total-batch-size 512 is not a multiple of ")


def test_automatic_batch_of_an_elastic_run_divides_on_every_world_size():
    # as above, 2^16 = 65,536 tokens; on 2 or 3 workers: a multiple of 8 x 256 x lcm(2, 3) = 12,288 -> 5 x = 61,440
    values = dict(depth=4, seq_len=256, device_batch_size=8, num_workers=3, min_workers=2)
    cfg = from_dict(TrainConfig, {**values, "target_param_data_ratio": 20})
    p = make_plan(cfg, vocab_size=4096)
    assert (p.auto_batch_size, p.total_batch_size) == (65536, 61440)
    assert elastic_grad_accum(cfg, p.total_batch_size) == {2: 15, 3: 10}


def test_the_data_line_says_how_many_epochs_the_run_reads(tmp_path, small_tokenizer):
    """Nothing said that a run's tokens were more than its data: the stream silently went round again. 8 equal
    documents of 800 bytes, n tokens each with its BOS; 4 of them train (3,200 bytes), 4 validate: 800 / n
    bytes a token, so 4n tokens of training text; --overflow crop keeps one row of 65 of each: 260 an epoch."""
    doc = "a b c d " * 100
    n = len(small_tokenizer.encode(doc)) + 1
    assert n > 65  # longer than a row: crop keeps 65 of each
    write_manifest(
        tmp_path, {"source": "t", "shards": write_shards([doc] * 8, tmp_path, 2, log=lambda *_: None)}
    )

    def cfg(overflow: str) -> TrainConfig:
        return from_dict(TrainConfig, {"data_dir": str(tmp_path), "seq_len": 64, "overflow": overflow})

    head = (
        f"data: 1 training shard, 0.0032 MB of text, about {4 * n:,} tokens ({800 / n:.2f} bytes/token on the "
        "validation shard)"
    )
    assert data_line(cfg("crop"), small_tokenizer, 520) == (
        f"{head}; --overflow crop keeps at most a row (65 tokens) of each document, about {100 * 65 / n:.2g}% of "
        "them: 260 tokens an epoch; the run's 520 tokens are 2 epochs: from the second on the same documents "
        "repeat, each epoch in another order"
    )
    assert data_line(cfg("split"), small_tokenizer, n) == f"{head}; the run's {n:,} tokens are 0.25 epochs"


def test_a_run_stopped_by_stop_after_says_it_is_not_finished():
    """`--stop-after 14` of 40 steps ended with `final checkpoint: ...` and `final metrics: ...` alone, as a
    finished run does."""
    assert stopped_early_line(14, 40, 14) == (
        "stopped at step 14 of 40 (--stop-after 14): the run is not finished; the same command without "
        "--stop-after (or with a later one) resumes it to step 40"
    )
    assert stopped_early_line(40, 40, 40) is None and stopped_early_line(40, 40, -1) is None


def test_a_written_shards_line_says_text_and_disk(tmp_path):
    """`wrote shard_00000.parquet: train, 1,940 documents, 2.70 MB` was the compressed file's size, beside a
    summary of `21.15 MB of text`: a shard of 7 MB of text read as 2.7."""
    lines = []
    entries = write_shards(["a" * 600_000, "b" * 400_000], tmp_path, 2, log=lines.append)
    assert lines[0] == (
        f"  wrote shard_00000.parquet: train, 1 document, 600.0 kB of text, {size(entries[0]['file_bytes'])} on disk"
    )
    assert entries[0]["file_bytes"] < 100_000  # zstd: the disk figure is not the text's


@pytest.mark.parametrize("preset, controller_sees", [(None, "0.5"), ("3", "3")])
def test_fit_has_ray_trains_controller_poll_the_workers_every_half_second_unless_set(
    monkeypatch, preset, controller_sees
):
    """Ray Train's controller reads RAY_TRAIN_HEALTH_CHECK_INTERVAL_S from the driver's environment when
    trainer.fit() creates it (Ray's default 2 s: a finished run reached the driver 2.8-3.7 s after the
    workers' function returned, 0.7-1.3 s at 0.5 s; bench/results/run_end.md). fit() sets 0.5 s unless the
    user set a value; the worker group's start timeout is --schedule-timeout-s (one placement attempt). The Ray
    calls around trainer.fit() (Ray Data's stats actor, the placement reporter's thread) are stubbed: this
    checks the environment alone."""
    monkeypatch.delenv("RAY_TRAIN_HEALTH_CHECK_INTERVAL_S", raising=False)
    monkeypatch.delenv("RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S", raising=False)
    if preset is not None:
        monkeypatch.setenv("RAY_TRAIN_HEALTH_CHECK_INTERVAL_S", preset)
    monkeypatch.setattr(launch, "get_or_create_stats_actor", lambda: None)
    monkeypatch.setattr(
        launch, "WaitReporter", lambda *a: SimpleNamespace(start=lambda: SimpleNamespace(stop=lambda: None))
    )
    seen = {}

    class Trainer:
        def fit(self):
            seen.update(
                {
                    k: os.environ.get(k)
                    for k in ("RAY_TRAIN_HEALTH_CHECK_INTERVAL_S", "RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S")
                }
            )
            return "result"

    cfg = from_dict(TrainConfig, {"schedule_timeout_s": 45})
    assert launch.fit(Trainer(), cfg, capacity=None) == "result"
    assert seen == {
        "RAY_TRAIN_HEALTH_CHECK_INTERVAL_S": controller_sees,
        "RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S": "45",
    }
