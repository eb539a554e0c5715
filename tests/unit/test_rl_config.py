"""RLConfig: validation messages, YAML round trip, the `raychat rl` flags."""

import json
import re
from pathlib import Path

import pytest
from support.rl_fixtures import rl_config
from support.serve_helpers import write_tiny_checkpoint

from raychat.cli import build_parser, main
from raychat.config import ConfigError, RLConfig, from_dict, preset_values, to_yaml
from raychat.rl.cli import base_model_warning, check_flags_used, config_for, resolve_inputs
from raychat.rl.dispatcher import RolloutDispatcher, split_even
from raychat.rl.loop import RLRun, layout_line, rollout_stats, step_line
from raychat.rl.objective import group_advantages


def test_yaml_round_trip(tmp_path):
    cfg = rl_config(
        init_from="ck", mode="async", max_staleness=2, normalization="constant", constant_length=64
    )
    (tmp_path / "rl.yaml").write_text(to_yaml(cfg, "rl"))
    assert from_dict(RLConfig, preset_values(str(tmp_path / "rl.yaml"), "rl")) == cfg
    assert cfg.denominator_length == 64 and rl_config(max_tokens=40).denominator_length == 40


@pytest.mark.parametrize(
    "kw, match",
    [
        ({"normalization": "mean"}, r"--normalization must be one of \['token', 'sequence', 'constant'\]"),
        ({"mode": "fast"}, r"--mode must be one of \['sync', 'async'\]"),
        ({"weight_sync": "rpc"}, r"--weight-sync must be one of"),
        (
            {"samples_per_prompt": 1},
            "--samples-per-prompt must be >= 2, got 1",
        ),  # a group of one learns nothing
        ({"temperature": 0.0}, "--temperature must be > 0"),
        (  # greedy below raychat.engine.sampling.TEMPERATURE_EPS: G identical samples, no learning signal
            {"temperature": 1e-6},
            "^--temperature must be >= 1e-05, got 1e-06: below it the engine decodes greedily, so a prompt's "
            "--samples-per-prompt samples would be identical and every advantage 0$",
        ),
        ({"constant_length": 0}, "--constant-length"),
        (  # step 0 sampled prompts [0, 1, 0, 1]: each prompt in two groups
            {"task_examples": 2, "prompts_per_step": 4},
            r"^--prompts-per-step 4 exceeds --task-examples 2: a step's prompts would repeat \(one prompt in several "
            r"groups\); raise --task-examples or lower --prompts-per-step$",
        ),
        ({"max_failures": -1}, "--max-failures must be >= 0"),
        ({"deadline_factor": 0}, "^--deadline-factor must be > 0, got 0$"),
        ({"deadline_factor": -2.5}, "^--deadline-factor must be > 0, got -2.5$"),
        (
            {"deadline_factor": 1e308},
            "^--deadline-factor must be <= 1000, got 1e308$",
        ),  # not an infinite wait
        (
            {"weight_sync": "collective", "learner_workers": 2},
            r"--weight-sync collective on CPU \(gloo\) needs --learner-workers 1, got 2",
        ),
    ],
)
def test_validation_names_the_flag(kw, match):
    with pytest.raises(ValueError, match=match):
        rl_config(**kw)


def test_flags_override_yaml(tmp_path):
    (tmp_path / "c.yaml").write_text("rl:\n  steps: 7\n  mode: async\n  deadline_factor: 3\n")
    parser = build_parser("rl")
    cfg = config_for(
        parser.parse_args(["rl", "--preset", str(tmp_path / "c.yaml"), "--steps", "9", "--scale-by-std"])
    )
    assert (cfg.rollout.steps, cfg.asynchrony.mode, cfg.objective.scale_by_std) == (9, "async", True)
    assert cfg.layout.deadline_factor == 3.0  # a preset's rl section sets it too
    (tmp_path / "bad.yaml").write_text("rl:\n  stepz: 7\n")
    with pytest.raises(ValueError, match="unknown rl settings"):
        config_for(parser.parse_args(["rl", "--preset", str(tmp_path / "bad.yaml")]))


def test_cli_help_lists_the_rl_command(capsys):
    with pytest.raises(SystemExit):
        main(["rl", "--help"])
    out = capsys.readouterr().out
    assert (
        "--init-from" in out
        and "--storage-path" in out
        and "--normalization {token,sequence,constant}" in out
        and "--max-staleness" in out
    )
    # the learner failure budget, with its default
    assert re.search(
        r"--max-failures INT\s+failures of a learner or of weight sync .*?\(default: 1\)", out, re.S
    )
    # the knob of every deadline the driver waits for its actors, with its default
    assert re.search(
        r"--deadline-factor FLOAT\s+multiplies every deadline .*?\(default: 1(\.0)?\)", out, re.S
    )
    assert main(["rl", "--steps", "3"]) == 2  # no --init-from


def test_the_old_rl_flags_are_deprecated_aliases(tmp_path, capsys):
    """--checkpoint / --out / --config (RL's flags before issue 25) build the same RLConfig as --init-from /
    --storage-path / --preset, and each prints its deprecation line once."""
    (tmp_path / "c.yaml").write_text("rl:\n  steps: 7\n  checkpoint: ck\n  out: o\n")  # old keys too
    new = config_for(build_parser("rl").parse_args(["rl", "--init-from", "X", "--storage-path", "Y"]))
    assert capsys.readouterr().err == ""
    old = config_for(
        build_parser("rl").parse_args(["rl", "--checkpoint", "X", "--out", "Y", "--checkpoint", "X"])
    )
    assert old == new and (old.run.init_from, old.run.storage_path) == ("X", "Y")
    err = capsys.readouterr().err
    assert err.count("raychat rl: --checkpoint is deprecated, use --init-from") == 1
    assert err.count("raychat rl: --out is deprecated, use --storage-path") == 1
    preset = config_for(build_parser("rl").parse_args(["rl", "--config", str(tmp_path / "c.yaml")]))
    assert (preset.rollout.steps, preset.run.init_from, preset.run.storage_path) == (7, "ck", "o")
    assert capsys.readouterr().err.count("raychat rl: --config is deprecated, use --preset") == 1


def test_split_even():
    assert split_even(list(range(5)), 2) == [[0, 1, 2], [3, 4]]
    assert split_even([1], 3) == [[1]]


def test_more_eval_samples_than_one_at_a_greedy_eval_temperature_are_refused(capsys):
    """The engine decodes greedily below TEMPERATURE_EPS (1e-5), not only at 0, and rl took --eval-samples 4 at
    --eval-temperature 0 (or 1e-6) as 1 sample without a word, while `raychat eval` refuses --samples above 1 at
    --temperature 0: now rl refuses it in one line naming both flags. `rl --help` says so."""
    assert (
        RolloutDispatcher(rl_config(eval_samples=4, eval_temperature=1e-5), None, None, 8).eval_samples == 4
    )
    assert rl_config(eval_samples=1, eval_temperature=0).eval.eval_samples == 1
    for greedy in (0, 1e-6):
        with pytest.raises(ConfigError) as e:
            rl_config(eval_samples=4, eval_temperature=greedy)
        assert str(e.value) == (
            f"--eval-samples 4 needs an --eval-temperature above 0 (at least 1e-05), got {greedy}: greedy decoding "
            "writes the same completion every time (e.g. --eval-temperature 1; or --eval-samples 1)"
        )
    with pytest.raises(SystemExit):
        main(["rl", "--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert "0 (below 1e-5) = greedy, with --eval-samples 1: pass@1 only" in out
    assert "pass@k for k = 1..this; above 1 at an --eval-temperature above 0" in out


def test_rl_from_a_pretraining_checkpoint_is_warned_about(tmp_path):
    """`raychat rl --init-from runs/checkpoints/base` trained a base model, which never saw the chat template,
    without a word (every reward 0); an SFT or RL checkpoint gets no warning."""
    base = str(write_tiny_checkpoint(tmp_path / "base" / "checkpoint_000004", stage="pretrain"))
    assert base_model_warning(base) == (
        f"warning: --init-from {base} is a pretraining checkpoint, not fine-tuned for chat: RL samples "
        "chat-template turns (and calculator calls) that SFT teaches, so expect no reward; give an SFT checkpoint "
        "(raychat sft --init-from this one makes one)"
    )
    for stage in ("sft", "rl"):
        assert (
            base_model_warning(
                str(write_tiny_checkpoint(tmp_path / stage / "checkpoint_000001", stage=stage))
            )
            is None
        )


def test_init_from_latest_that_finds_no_sft_run_says_where_sft_runs_are(tmp_path, capsys):
    """`raychat rl --init-from latest` searches rl's --storage-path (runs/rl), where sft writes nothing: the
    refusal named only that directory, so a user of the speedrun's layout was left guessing; it now says where
    sft's runs are, and that run resolves."""
    sft = str(write_tiny_checkpoint(tmp_path / "checkpoints" / "sft" / "checkpoint_000002", stage="sft"))
    rl_root = tmp_path / "rl"
    assert main(["rl", "--init-from", "latest", "--storage-path", str(rl_root)]) == 2
    assert capsys.readouterr().err == (
        f"raychat rl: error: --init-from: latest: no committed sft checkpoint under {rl_root} ({rl_root} does "
        "not exist); latest searches rl's --storage-path, and raychat sft writes its runs under its own (default "
        "runs/checkpoints): give the SFT run, e.g. --init-from runs/checkpoints/sft/latest (the speedrun's), or "
        "give sft and rl one --storage-path\n"
    )
    given = from_dict(
        RLConfig, {"init_from": f"{tmp_path}/checkpoints/sft/latest", "storage_path": str(rl_root)}
    )
    assert resolve_inputs(given).run.init_from == sft


def test_the_readmes_table_for_openrlhf_and_verl_users_names_rls_flags_and_none_it_lacks(capsys):
    """README's RL table maps OpenRLHF / verl knobs to `raychat rl`'s: every flag it names is one of rl's, and
    the knobs it says rl lacks (KL and its reference model, entropy, top-p / top-k, PPO epochs, warmup, rollout
    dumps; KL and entropy among the step metrics) have no flag, so the table goes stale in this test's sight when either changes."""
    readme = (Path(__file__).parents[2] / "README.md").read_text()
    table = readme.split("### RL (`raychat rl`) for OpenRLHF and verl users", 1)[1].split("\n\n")[2]
    rows = [line.split(" | ") for line in table.splitlines()[2:]]
    named = {flag for _, ours in rows for flag in re.findall(r"`(--[a-z-]+)", ours)}
    with pytest.raises(SystemExit):
        main(["rl", "--help"])
    flags = set(re.findall(r"(?<![\w-])--[a-z][a-z-]*", capsys.readouterr().out))
    core = {"--samples-per-prompt", "--prompts-per-step", "--max-tokens", "--temperature", "--scale-by-std",
            "--normalization", "--clip-eps", "--matrix-lr", "--eval-samples", "--eval-temperature"}  # fmt: skip
    assert len(rows) == 17 and core <= named <= flags, (core - named, named - flags)
    lacking = [ours for _, ours in rows if ours.startswith("none") or "no " in ours]
    assert len(lacking) == 10
    assert not [f for f in flags if re.search(r"kl|ref|entropy|top|epoch|warmup|mini|critic|gae", f)]


def test_the_layout_line_names_each_actor_by_its_role():
    """The run's first line after Ray started read `layout: 2 actors [{'CPU': 0.5}, {'CPU': 0.5}]` for one learner
    and one rollout actor: neither role was named."""
    assert (
        layout_line(rl_config(rollout_workers=1)) == "1 learner x {CPU: 0.5} + 1 rollout actor x {CPU: 0.5}"
    )
    assert layout_line(rl_config(learner_workers=2, cpus_per_learner=2, use_gpu=True)) == (
        "2 learners x {CPU: 2, GPU: 1} + 2 rollout actors x {CPU: 0.5, GPU: 1}"
    )


def test_a_steps_line_shows_the_share_of_prompts_without_a_learning_signal_and_the_steps_in_all():
    """zero_advantage_frac, GRPO's first diagnostic (groups whose samples all scored alike teach nothing), was in
    metrics.jsonl only; the step's stdout line shows it after reward_mean. The step was `step=3`, without the
    run's steps that pretraining's `step 3/50` shows; its ETA was seconds alone (`eta=11220s`), pretraining's
    reads in minutes and hours."""
    line = {"step": 3, "version": 3, "reward_mean": 0.25, "pass_at_1": 0.25, "zero_advantage_frac": 0.5,
            "response_len_mean": 31.5, "loss": -0.002, "grad_norm": 0.03, "sync_time_s": None}  # fmt: skip
    assert step_line(line, 50, 12.4) == (
        "step=3/50 reward_mean=0.25 zero_advantage_frac=0.5 response_len_mean=31.5 loss=-0.002 grad_norm=0.03 "
        "eta=12s"
    )
    assert step_line(line, 50, 725).endswith(" eta=12m05s")
    assert step_line(line, 5000, 11_220.4).endswith(" eta=3h07m")


def hand_made_rollouts(scale_by_std: bool = False) -> list[dict]:
    """2 prompts x 4 samples, prompt-major: prompt 7 solved by samples 0 and 3, prompt 2 by none; the samples
    of prompt 7 from version 5, those of prompt 2 from version 4 (an async step)."""
    rewards = [1.0, 0.0, 0.0, 1.0, 0.0, 0.0, 0.0, 0.0]
    lengths = [10, 24, 7, 24, 12, 12, 3, 16]
    advantages = group_advantages(rewards, 4, scale_by_std)
    return [
        {"prompt_index": 7 if i < 4 else 2, "sample_index": i % 4, "reward": r, "advantage": a,
         "completion_tokens": n, "version": 5 if i < 4 else 4}
        for i, (r, a, n) in enumerate(zip(rewards, advantages, lengths))
    ]  # fmt: skip


def test_a_steps_rollout_stats_have_the_spread_of_rewards_advantages_and_lengths():
    """The step line had reward_mean and zero_advantage_frac but no spread, which OpenRLHF's, verl's and TRL's
    logs show. By hand: rewards 1 0 0 1 | 0 0 0 0: mean 2/8 = 0.25, population std sqrt((2 x 0.75^2 + 6 x
    0.25^2) / 8) = sqrt(0.1875); advantages (Dr. GRPO, r - group mean) 0.5 -0.5 -0.5 0.5 | 0 0 0 0: mean 0, std
    sqrt(4 x 0.25 / 8) = sqrt(0.125); with --scale-by-std group 7's are +-0.5 / (0.5 + 1e-6), std sqrt(4 x
    (0.5 / 0.500001)^2 / 8). Lengths 10 24 7 24 12 12 3 16: mean 108 / 8 = 13.5, min 3, max 24; chunks of 65 and
    43 tokens in 2 s and 4 s: 108 / 4 = 27 tokens/s; staleness from version 5: 0 x 4, 1 x 4."""
    assert [s["advantage"] for s in hand_made_rollouts()] == [0.5, -0.5, -0.5, 0.5, 0, 0, 0, 0]
    results = [{"completion_tokens": 65, "seconds": 2.0}, {"completion_tokens": 43, "seconds": 4.0}]
    stats = rollout_stats(hand_made_rollouts(), results, 5, 4)
    assert stats == {
        "reward_mean": 0.25, "reward_std": pytest.approx(0.1875**0.5), "pass_at_1": 0.25,
        "zero_advantage_frac": 0.5, "advantage_mean": 0.0, "advantage_std": pytest.approx(0.125**0.5),
        "response_len_mean": 13.5, "response_len_min": 3, "response_len_max": 24, "rollout_tokens_per_s": 27.0,
        "rollout_tokens": 108, "staleness_mean": 0.5, "staleness_max": 1, "num_samples": 8, "prompts": [2, 7],
    }  # fmt: skip
    scaled = rollout_stats(hand_made_rollouts(scale_by_std=True), results, 5, 4)
    assert scaled["advantage_std"] == pytest.approx((0.5 * (0.5 / 0.500001) ** 2) ** 0.5)
    assert scaled["advantage_mean"] == pytest.approx(0.0, abs=1e-12)
    line = {"step": 3, "mode": "sync", **stats, "loss": -0.002}
    assert step_line(line, 50, 12.4) == (
        "step=3/50 reward_mean=0.25 reward_std=0.433 zero_advantage_frac=0.5 advantage_std=0.3536 "
        "response_len_mean=13.5 response_len_min=3 response_len_max=24 loss=-0.002 rollout_tokens_per_s=27 "
        "staleness_mean=0.5 eta=12s"
    )


def test_an_evaluations_line_says_what_it_measured(tmp_path):
    """`eval step 5: step=5 pass@1=0.25 ...` named the step twice and neither the held-out problems nor the
    samples that pass@k is over; a greedy evaluation samples each problem once."""
    sft = str(write_tiny_checkpoint(tmp_path / "sft" / "checkpoint_000001", stage="sft"))
    evaluation = {"step": 5, "pass@1": 0.25, "pass@2": 0.375}

    def line(**kw):
        return RLRun(
            rl_config(init_from=sft, storage_path=str(tmp_path / "rl"), eval_examples=16, **kw)
        ).eval_line(evaluation)

    assert line(eval_samples=2) == "eval step 5 (16 held-out problems x 2 samples): pass@1=0.25 pass@2=0.375"
    assert line(eval_samples=1, eval_temperature=0).startswith(
        "eval step 5 (16 held-out problems x 1 sample): "
    )
    assert not (tmp_path / "rl").exists()


def test_a_steps_line_shows_rollout_tokens_per_s_of_10000_or_more_as_a_whole_number():
    """A tiny run's step line read `rollout_tokens_per_s=1.629e+04` (4 significant digits in exponent form) beside
    `rollout_tokens_per_s=7344` a step later; pretraining's line shows tok/s whole. Values of a real run's
    metrics.jsonl line (tiny preset, 2 prompts x 4 samples of 24 tokens)."""
    line = {"step": 1, "reward_mean": 0.0, "zero_advantage_frac": 1.0, "response_len_mean": 24.0,
            "rollout_tokens_per_s": 16285.825741734929, "learner_step_s": 0.016566411999519914}  # fmt: skip
    assert step_line(line, 6, 0.2) == (
        "step=1/6 reward_mean=0 zero_advantage_frac=1 response_len_mean=24 rollout_tokens_per_s=16286 "
        "learner_step_s=0.01657 eta=0s"
    )
    slower = line | {"rollout_tokens_per_s": 7344.4, "loss": -12345.6}
    assert " rollout_tokens_per_s=7344 " in step_line(slower, 6, 0.2)
    assert " loss=-12346 " in step_line(slower, 6, 0.2)


def test_an_async_steps_line_shows_the_importance_ratio_and_the_share_clipped():
    """--mode async trains on samples up to --max-staleness versions old through --clip-eps's clipped ratio, but
    its step line showed staleness_mean alone: ratio_mean and clip_frac (PPO's clipfrac, which OpenRLHF and verl
    print) were in metrics.jsonl only. A sync run's ratio is 1 by construction and its line stays as it was."""
    line = {"step": 2, "mode": "async", "reward_mean": 0.25, "loss": -0.01, "staleness_mean": 0.5,
            "staleness_max": 1, "ratio_mean": 1.0123, "clip_frac": 0.0625, "restarts": 0}  # fmt: skip
    assert step_line(line, 4, 3) == (
        "step=2/4 reward_mean=0.25 loss=-0.01 staleness_mean=0.5 staleness_max=1 ratio_mean=1.012 clip_frac=0.0625 "
        "eta=3s"
    )
    assert step_line(line | {"mode": "sync"}, 4, 3) == (
        "step=2/4 reward_mean=0.25 loss=-0.01 staleness_mean=0.5 eta=3s"
    )


def test_a_steps_line_shows_a_fault_counter_only_once_it_is_above_0():
    """Every step line ended `restarts=0 failures=0 stale_chunks=0`: noise in a healthy run, and a fault hid
    among them. A counter is shown once nonzero (cumulative: it stays on the line after); metrics.jsonl keeps all.
    dropped_samples and reward_errors were in metrics.jsonl only: they are counters as the others."""
    line = {"step": 4, "mode": "sync", "reward_mean": 0.5, "staleness_mean": 0.0, "restarts": 0, "failures": 0,
            "stale_chunks": 0, "dropped_samples": 0, "reward_errors": 0}  # fmt: skip
    assert step_line(line, 8, 5) == "step=4/8 reward_mean=0.5 staleness_mean=0 eta=5s"
    assert step_line(line | {"dropped_samples": 6, "reward_errors": 2, "failures": 1}, 8, 5) == (
        "step=4/8 reward_mean=0.5 staleness_mean=0 failures=1 dropped_samples=6 reward_errors=2 eta=5s"
    )
    assert (
        step_line(line | {"reward_errors": 1}, 8, 5)
        == "step=4/8 reward_mean=0.5 staleness_mean=0 reward_errors=1 eta=5s"
    )
    faulty = line | {"failures": 1, "stale_chunks": 2}
    assert (
        step_line(faulty, 8, 5)
        == "step=4/8 reward_mean=0.5 staleness_mean=0 failures=1 stale_chunks=2 eta=5s"
    )
    assert (
        step_line(line | {"restarts": 3}, 8, 5)
        == "step=4/8 reward_mean=0.5 staleness_mean=0 restarts=3 eta=5s"
    )


def test_a_flag_of_another_mode_is_refused_naming_the_mode_it_needs(tmp_path):
    """`--max-staleness 2` or `--clip-eps 0.1` (OpenRLHF's eps_clip) in the default sync mode, or `--constant-length`
    without `--normalization constant`, changed nothing without a word. Typed, each is refused naming the mode it
    needs; in that mode, or as a preset's value (the file below sets all three), it is accepted."""
    parser = build_parser("rl")

    def check(*flags):
        args = parser.parse_args(["rl", *flags])
        check_flags_used(args, config_for(args))

    with pytest.raises(ConfigError) as e:
        check("--max-staleness", "2")
    assert str(e.value) == (
        "--max-staleness 2: used only with --mode async; this run is --mode sync (on-policy: every sample comes "
        "from the current weights, its importance ratio 1, nothing to clip): add --mode async, or leave "
        "--max-staleness out"
    )
    with pytest.raises(
        ConfigError, match=r"^--clip-eps 0.1: used only with --mode async; this run is --mode sync"
    ):
        check("--clip-eps", "0.1")
    with pytest.raises(ConfigError) as e:
        check("--normalization", "sequence", "--constant-length", "32")
    assert str(e.value) == (
        "--constant-length 32: used only with --normalization constant; this run's is sequence: add "
        "--normalization constant, or leave --constant-length out"
    )
    check("--mode", "async", "--max-staleness", "2", "--clip-eps", "0.1")
    check("--normalization", "constant", "--constant-length", "32")
    (tmp_path / "p.yaml").write_text("rl:\n  max_staleness: 2\n  clip_eps: 0.1\n  constant_length: 32\n")
    check("--preset", str(tmp_path / "p.yaml"))


def test_more_prompts_a_step_than_the_tasks_train_split_has_are_refused(tmp_path, capsys):
    """RLConfig compares --prompts-per-step with --task-examples (10000 by default) only: a gsm8k train split of 3
    problems with the default 8 prompts a step passed --dry-run, and step 0's prompts were [2, 0, 1, 2, 0, 1, 2,
    0]. Once the split is read, the run is refused naming its size; 3 prompts a step fit it."""
    data = tmp_path / "task_data" / "gsm8k" / "main"
    data.mkdir(parents=True)
    for split in ("train", "test"):
        (data / f"{split}.jsonl").write_text(
            "".join(
                json.dumps(
                    {"question": f"What is {a}+2?", "answer": f"{a}+2=<<{a}+2={a + 2}>>{a + 2}\n#### {a + 2}"}
                )
                + "\n"
                for a in range(3)
            )
        )
    sft = str(write_tiny_checkpoint(tmp_path / "sft" / "checkpoint_000001", stage="sft"))
    argv = ["rl", "--init-from", sft, "--storage-path", str(tmp_path / "runs"), "--task", "gsm8k",
            "--task-data-dir", str(tmp_path / "task_data"), "--dry-run"]  # fmt: skip
    assert RLConfig().rollout.prompts_per_step == 8
    assert main(argv) == 2
    assert capsys.readouterr().err == (
        "raychat rl: error: --prompts-per-step 8 exceeds the 3 problems of --task gsm8k's train split: a step's "
        "prompts would repeat (one prompt in several groups); lower --prompts-per-step to at most 3\n"
    )
    assert main([*argv, "--prompts-per-step", "3", "--eval-examples", "3"]) == 0
    assert "plan: steps 1..50 of 3 prompts x " in capsys.readouterr().out
