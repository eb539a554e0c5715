"""The one configuration system: nested/flat/alias keys, type conversion, errors naming the flag, the flag
generator, presets as package data (found from any directory)."""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
from importlib.resources import files

import pytest
import yaml

from raychat.cli import build_parser
from raychat.config import (
    SFT_DEFAULTS,
    ChatConfig,
    ConfigError,
    EvalConfig,
    RLConfig,
    ServeConfig,
    SpeedrunConfig,
    TrainConfig,
    VLLMConfig,
    add_flags,
    from_args,
    from_dict,
    preset_names,
    preset_values,
    to_dict,
    to_flat,
)
from raychat.config.data import PrepareConfig, TokenizerConfig
from raychat.config.schema import flag_name, leaves, shown
from raychat.speedrun import run_speedrun
from raychat.storage import run_directory
from raychat.tokenizer import MIN_VOCAB_SIZE
from raychat.train.plan import make_plan, print_plan


def test_nested_flat_and_alias_keys_build_the_same_config():
    nested = from_dict(TrainConfig, {"model": {"depth": 2}, "train": {"batch": {"total_batch_size": 1024}}})
    flat = from_dict(TrainConfig, {"depth": 2, "total_batch_size": 1024})
    assert nested == flat and (flat.model.depth, flat.train.batch.total_batch_size) == (2, 1024)
    assert from_dict(TrainConfig, to_dict(flat)) == flat  # the dump reads back
    rl = from_dict(RLConfig, {"checkpoint": "ck", "out": "o"})  # RL's deprecated keys
    assert (rl.run.init_from, rl.run.storage_path) == ("ck", "o")
    assert from_dict(ServeConfig, {"checkpoint": "c", "max_rows": 3}).replica.max_slots == 3


def test_strings_are_converted_and_bad_values_name_the_flag():
    c = from_dict(
        ServeConfig, {"checkpoint": "c", "engine_process": "false", "max_len": "none", "num_cpus": "2"}
    )
    assert (c.replica.engine_process, c.replica.max_len, c.replica.num_cpus) == (False, None, 2.0)
    assert (
        from_dict(TrainConfig, {"target_param_data_ratio": 20}).train.horizon.target_param_data_ratio == 20.0
    )
    with pytest.raises(ConfigError, match=r"--depth must be a positive integer, got 0"):
        from_dict(TrainConfig, {"depth": 0})
    with pytest.raises(
        ConfigError, match=r"--fp8-recipe must be one of \['tensorwise', 'rowwise', 'rowwise_with_gw_hp'\]"
    ):
        from_dict(TrainConfig, {"fp8_recipe": "bogus"})
    with pytest.raises(ConfigError, match=r"--seq-len must be an integer, got 'long'"):
        from_dict(TrainConfig, {"seq_len": "long"})
    with pytest.raises(ConfigError) as e:  # the message named neither value
        from_dict(TrainConfig, {"warmup_ratio": 0.7, "warmdown_ratio": 0.4})
    assert str(e.value) == (
        "--warmup-ratio 0.7 + --warmdown-ratio 0.4 must lie in [0, 1]: both are fractions of the run's steps, and "
        "the warmup ends before the warmdown starts"
    )
    with pytest.raises(ConfigError) as e:  # a "warmdown" that rose to 2 x the peak, which the resume check's
        from_dict(TrainConfig, {"final_lr_frac": 2})  # rule (the lr rises only in the warmup) did not foresee
    assert str(e.value) == "--final-lr-frac must be <= 1, got 2"
    with pytest.raises(
        ConfigError, match=r"^unknown TrainConfig settings \['deph'\] \(did you mean depth\?\); allowed: "
    ):
        from_dict(TrainConfig, {"deph": 3})
    with pytest.raises(ConfigError, match="cannot feed --learner-workers 4"):
        from_dict(RLConfig, {"prompts_per_step": 1, "samples_per_prompt": 2, "learner_workers": 4})
    # NaN passes every bound (all comparisons are false), inf every lower bound: neither is a setting
    for cls, key, value in [
        (TrainConfig, "matrix_lr", "nan"), (TrainConfig, "grad_clip", float("nan")),
        (RLConfig, "temperature", "inf"), (RLConfig, "clip_eps", "NaN"),
        (ServeConfig, "num_cpus", float("inf")), (ServeConfig, "request_timeout_s", "-inf"),
    ]:  # fmt: skip
        flag = key if cls is ServeConfig else "--" + key.replace("_", "-")  # serve's are YAML keys
        with pytest.raises(ConfigError, match=f"^{flag} must be a finite number, got {value!r}$"):
            from_dict(cls, {"checkpoint": "c", key: value} if cls is ServeConfig else {key: value})
    for steps in (0, -2):  # -1 derives the steps; 0 is no run at all
        with pytest.raises(
            ConfigError, match=rf"^--num-iterations must be >= 1 or -1 \(derive\), got {steps}$"
        ):
            from_dict(TrainConfig, {"num_iterations": steps})
    with pytest.raises(ConfigError, match=r"^--num-iterations must be >= 1 or -1 \(derive\), got 0$"):
        SpeedrunConfig.from_preset("tiny", "runs", num_iterations=0)  # reads the preset, writes nothing
    with pytest.raises(ConfigError, match=r"^--matrix-lr must be a number, got 1000000000"):
        from_dict(TrainConfig, {"matrix_lr": 10**400})  # too large for a float


def test_a_blank_path_is_refused_where_blank_would_mean_the_current_directory(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(
        ConfigError, match=r"^--storage-path must not be blank, got '' \(default: 'runs/checkpoints'\)$"
    ):
        from_dict(TrainConfig, {"storage_path": ""})
    with pytest.raises(ConfigError, match=r"^--out must be a directory, got ' ' \(default: 'runs'\)$"):
        SpeedrunConfig.from_preset("tiny", " ")
    (tmp_path / "notes.txt").write_text("x")  # was "[Errno 17] File exists"
    with pytest.raises(
        ConfigError, match=r"^--out must be a directory, got 'notes.txt' \(default: 'runs'\)$"
    ):
        SpeedrunConfig.from_preset("tiny", "notes.txt")
    with pytest.raises(ConfigError) as e:  # was the local folder ./s3:/bucket/runs, data and all
        SpeedrunConfig.from_preset("tiny", "s3://bucket/runs")
    assert str(e.value) == (
        "--out must be a local or NFS directory (every node reads the data and the tokenizer under it as files), "
        "got 's3://bucket/runs'"
    )
    assert (
        from_dict(ChatConfig, {"checkpoint": ""}).checkpoint == ""
    )  # default "": its command says "required"
    assert [p.name for p in tmp_path.iterdir()] == ["notes.txt"]


def test_limits_that_once_ended_in_a_traceback(tmp_path):
    """A seed beyond int64 (torch: "Overflow when unpacking long long"), a vocabulary the BPE trainer cannot
    index, a model whose tensor sizes overflow, a blank --preset (silently no preset), a preset path that is
    not a regular file ("does not exist")."""
    with pytest.raises(
        ConfigError, match=r"^--seed must be <= 9223372036854775807, got 99999999999999999999$"
    ):
        from_dict(TrainConfig, {"seed": 10**20 - 1})
    with pytest.raises(ConfigError, match=r"^--vocab-size must be <= 1048576, got 99999999999$"):
        from_dict(TokenizerConfig, {"vocab_size": 99_999_999_999})
    tokenizer_floor = leaves(TokenizerConfig)["vocab_size"][1].metadata["ge"]
    assert tokenizer_floor == MIN_VOCAB_SIZE == 265  # 256 bytes + the special tokens: one bound, not two
    with pytest.raises(
        ConfigError, match=r"^--depth 99999999999, --aspect-ratio 64: a model 6399999999936 wide"
    ):
        make_plan(from_dict(TrainConfig, {"depth": 99_999_999_999}), 512)
    with pytest.raises(ConfigError, match=r"^--preset must not be blank: preset name"):
        from_args(argparse.Namespace(preset=" "), TrainConfig, "pretrain")
    with pytest.raises(ValueError, match=r"^--preset: /dev/null is not a regular file; shipped presets"):
        from_args(argparse.Namespace(preset="/dev/null"), TrainConfig, "pretrain")
    with pytest.raises(ConfigError, match=r"^--tasks: 'calculator' given twice; name each task once$"):
        from_dict(EvalConfig, {"tasks": "calculator:2,spelling,calculator:3"})  # the 2 was silently dropped


def test_flat_names_are_unique_and_every_flag_keeps_its_name():
    for cls in (TrainConfig, RLConfig, ServeConfig):
        assert len(leaves(cls)) == len(to_flat(cls()))
    parser = argparse.ArgumentParser()
    add_flags(parser, TrainConfig, preset="cpu")
    flags = {s for a in parser._actions for s in a.option_strings}
    for name in ("--depth", "--matrix-lr", "--num-workers", "--storage-path", "--sft-tasks", "--stop-after",
                 "--eval-every", "--keep-checkpoints", "--fp8", "--no-fp8", "--tracker", "--preset"):  # fmt: skip
        assert name in flags
    assert "--stage" not in flags  # set by the command


def test_precedence_flags_over_preset_over_command_defaults(tmp_path):
    (tmp_path / "p.yaml").write_text(
        "train:\n  depth: 3\n  seq_len: 64\n  num_iterations: 7\nsft:\n  seq_len: 32\n"
    )
    args = build_parser("sft").parse_args(
        ["sft", "--preset", str(tmp_path / "p.yaml"), "--num-iterations", "5"]
    )
    base = from_dict(TrainConfig, {"run_name": "sft", "stage": "sft", "document_masking": True})
    cfg = from_args(args, TrainConfig, "sft", base=base)
    assert (
        cfg.train.horizon.num_iterations,
        cfg.model.seq_len,
        cfg.run.run_name,
        cfg.model.document_masking,
    ) == (
        5,
        32,
        "sft",
        True,
    )
    assert from_dict(TrainConfig, preset_values("cpu", "sft")).train.horizon.num_iterations == 120


def test_a_flag_mends_a_preset_value_that_is_invalid_on_its_own(tmp_path):
    """The preset was checked before the flags were applied: a preset whose kv_group 3 does not divide its 4
    heads was refused with --kv-group 1 or --depth 6 (6 heads) on the same line. The merged config (defaults
    <- preset <- flags) is checked once; an error still names a preset's value as the config names its keys
    (ServeConfig: by key) and a flag's by its --flag."""
    mine = tmp_path / "mine.yaml"
    mine.write_text("train:\n  depth: 4\n  kv_group: 3\nserve:\n  min_replicas: 3\n")

    def config(command, cls, *flags):
        args = build_parser(command).parse_args([command, "--preset", str(mine), *flags])
        return from_args(args, cls, command, where=f"{command} settings")

    assert config("pretrain", TrainConfig, "--kv-group", "1").model.kv_group == 1
    assert config("pretrain", TrainConfig, "--depth", "6").model.kv_group == 3  # width 6 x 64: 6 heads
    with pytest.raises(ConfigError) as e:
        config("pretrain", TrainConfig, "--depth", "8")  # width 8 x 64 = 512: 8 heads
    assert str(e.value) == (
        "--kv-group 3 does not divide the 8 query heads (width 512: --depth 8 x --aspect-ratio 64 = 512 rounded "
        "up to a multiple of --head-dim 64; 512 / 64 = 8); allowed: 1, 2, 4, 8"
    )
    serve = config("serve", ServeConfig, "--checkpoint", "c", "--max-replicas", "4").autoscaling
    assert (serve.min_replicas, serve.max_replicas) == (3, 4)
    with pytest.raises(ConfigError) as e:
        config("serve", ServeConfig, "--checkpoint", "c", "--max-replicas", "2")
    assert str(e.value) == "min_replicas 3 exceeds --max-replicas 2; need min_replicas <= --max-replicas"
    args = build_parser("serve").parse_args(
        ["serve", "--preset", "none", "--checkpoint", "c", "--min-replicas", "2"]
    )
    with pytest.raises(ConfigError) as e:  # a default on the command line: named by its flag
        from_args(args, ServeConfig, "serve")
    assert str(e.value) == "--min-replicas 2 exceeds --max-replicas 1; need --min-replicas <= --max-replicas"


def test_presets_are_package_data_found_from_any_directory(tmp_path):
    assert preset_names() == ["cluster", "cpu", "gpu8", "tiny"]
    env = {**os.environ, "PYTHONPATH": ""}
    out = subprocess.run(
        [sys.executable, "-m", "raychat.cli", "pretrain", "--preset", "cluster", "--dry-run"],
        cwd=tmp_path, env=env, capture_output=True, text=True, check=True,
    ).stdout  # fmt: skip
    # depth 26, head_dim 128: width 26 * 64 = 1664 (a multiple of 128), 13 heads; 32 x 16 x 2048 tokens a step
    assert "model: depth 26 width 1664 heads 13" in out
    assert "batch: 1,048,576 tokens/step = 32 workers x 16 rows x 2,048 tokens x 1 accumulation step" in out


def test_a_preset_file_that_is_not_yaml_is_one_line_naming_the_line(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("train:\n  depth: [1\n")  # an unclosed list
    with pytest.raises(
        ValueError, match=rf"^--preset: {bad} is not valid YAML at line 3, column 1: expected ','"
    ):
        preset_values(str(bad), "pretrain")
    out = subprocess.run(
        [sys.executable, "-m", "raychat.cli", "pretrain", "--preset", str(bad), "--dry-run"],
        capture_output=True, text=True,
    )  # fmt: skip
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert out.stderr.startswith(f"raychat pretrain: error: --preset: {bad} is not valid YAML at line 3")


@pytest.mark.parametrize(
    "text, message",
    [
        ("train: 5\n", "--preset {f}: section 'train' must be a mapping of options, got int 5"),
        ("train: [1, 2]\n", "--preset {f}: section 'train' must be a mapping of options, got list [1, 2]"),
        ("train:\n  depth: 1\n  depth: 2\n", "--preset: {f} is not valid YAML at line 3, column 3: duplicate key 'depth'"),
        ("train:\n  model: 5\n", "pretrain settings: section 'model' must be a mapping of its options, got int 5"),
        (b"\xff\xfe", "--preset: {f} is not a UTF-8 text file (byte 0: invalid start byte)"),
    ],
)  # fmt: skip
def test_a_preset_of_the_wrong_shape_is_one_line_naming_it(tmp_path, text, message):
    """Each was a TypeError / UnicodeDecodeError traceback, or (a duplicate key) the last value silently."""
    bad = tmp_path / "bad.yaml"
    bad.write_bytes(text if isinstance(text, bytes) else text.encode())
    with pytest.raises((ValueError, ConfigError)) as e:
        from_args(argparse.Namespace(preset=str(bad)), TrainConfig, "pretrain", where="pretrain settings")
    assert str(e.value) == message.format(f=bad)


def test_a_mistyped_preset_key_names_the_one_meant(tmp_path):
    """The line listed 60 allowed names and said nothing of which one was meant; each unknown key close to one
    (difflib's ratio >= 0.75, as a mistyped flag) gets it, one close to none (`lr`: there are four) none."""
    mine = tmp_path / "mine.yaml"
    mine.write_text("train:\n  num_iters: 10\n  grad_clip_norm: 1.0\n  lr: 0.001\n")
    with pytest.raises(ConfigError) as e:
        from_args(argparse.Namespace(preset=str(mine)), TrainConfig, "pretrain", where="pretrain settings")
    head, _, allowed = str(e.value).partition("; allowed: ")
    assert head == (
        "unknown pretrain settings ['grad_clip_norm', 'lr', 'num_iters'] (did you mean grad_clip for "
        "grad_clip_norm, num_iterations for num_iters?)"
    )
    assert "'matrix_lr'" in allowed and "'warmup_ratio'" in allowed
    mine.write_text("train:\n  lr: 0.001\n")
    with pytest.raises(ConfigError, match=r"^unknown pretrain settings \['lr'\]; allowed: "):
        from_args(argparse.Namespace(preset=str(mine)), TrainConfig, "pretrain", where="pretrain settings")


def test_speedrun_config_composes_the_stage_configs_on_one_root(tmp_path):
    """SpeedrunConfig: each stage's typed config from the preset, on the layout under --out (README)."""
    c = SpeedrunConfig.from_preset("tiny", str(tmp_path), num_iterations=5)
    root = str(tmp_path.resolve())
    assert (c.data.output_dir(), c.tokenizer.output_dir(), c.tokenizer.data_dir) == (
        f"{root}/data",
        f"{root}/tokenizer",
        f"{root}/data",
    )
    assert (
        c.pretrain.run.storage_path,
        c.pretrain.run.run_name,
        c.pretrain.train.horizon.num_iterations,
    ) == (
        f"{root}/checkpoints",
        "base",
        5,
    )
    assert (c.pretrain.data.data_dir, c.pretrain.data.tokenizer_path) == (f"{root}/data", f"{root}/tokenizer")
    assert (c.sft.run.storage_path, c.sft.run.run_name, c.sft.run.stage) == (
        f"{root}/checkpoints",
        "sft",
        "sft",
    )
    assert c.sft.model.depth == c.pretrain.model.depth and c.sft.model.document_masking
    assert (c.rl.run.storage_path, c.rl.run.run_name, c.rl.run.init_from) == (f"{root}/rl", "rl", "")
    assert c.rl.rollout.steps == preset_values("tiny", "rl")["steps"]


@pytest.mark.parametrize(
    "argv, section",
    [(["tokenizer", "train"], "tokenizer"), (["pretrain"], "pretrain"), (["eval"], "eval")],
)
def test_data_inputs_are_the_storage_roots_runs_even_beside_a_local_data_dir(
    argv, section, tmp_path, monkeypatch
):
    """`tokenizer train` read ./data (its default was the bare name 'data', and a bare name that exists in the
    working directory is a path), and `--storage-path S` read ./data, not S/data, for every stage."""
    cls = {"tokenizer": TokenizerConfig, "pretrain": TrainConfig, "eval": EvalConfig}[section]
    monkeypatch.chdir(tmp_path)
    (tmp_path / "data").mkdir()  # the user's own raw texts
    (tmp_path / "tokenizer").mkdir()
    flat = lambda config: {k: v for k, v in to_flat(config).items() if k in ("data_dir", "tokenizer_path")}  # noqa: E731

    defaults = flat(from_args(build_parser(argv[0]).parse_args(argv), cls, section))
    assert run_directory(defaults["data_dir"], None, "--data-dir") == str(tmp_path / "runs" / "data")
    elsewhere = flat(
        from_args(build_parser(argv[0]).parse_args([*argv, "--storage-path", "/mnt/r/"]), cls, section)
    )
    assert elsewhere == {k: f"/mnt/r/{v}" for k, v in {"data_dir": "data", "tokenizer_path": "tokenizer"}.items()
                         if k in defaults}  # fmt: skip
    given = ["--storage-path", "/mnt/r", "--data-dir", "data"]  # a name given: a local ./data wins, as before
    assert (
        flat(from_args(build_parser(argv[0]).parse_args([*argv, *given]), cls, section))["data_dir"] == "data"
    )


def test_floats_are_shown_as_typed_in_help_and_messages(capsys):
    """A float option printed "4470000000.0", "-1.0" and "20.0" (--target-flops 4.47e9, -1, 20) in --help and in
    the messages that quote it; every shown value parses back to the same float."""
    values = [4470000000.0, 20.0, -1.0, 0.0, 0.02, 1e-05, 1234567.5, 1e16, 2e6, 123456789.0]
    assert [shown(v) for v in values] == [
        "4.47e9", "20", "-1", "0", "0.02", "1e-05", "1234567.5", "1e16", "2e6", "1.23456789e8"
    ]  # fmt: skip
    assert [float(shown(v)) for v in values] == values
    assert [shown(v) for v in (7, 10**20, "runs", None, True)] == ["7", str(10**20), "'runs'", "None", "True"]
    with pytest.raises(SystemExit):
        build_parser("pretrain").parse_args(["pretrain", "--help"])
    text = " ".join(capsys.readouterr().out.split())  # unwrapped
    assert "training FLOPs budget (used when num_iterations is -1) (default: -1)" in text
    assert "tokens per parameter (Chinchilla 20) when no other horizon (default: 20)" in text
    assert ".0)" not in text


@pytest.mark.parametrize(
    "flags, message",
    [  # each was accepted: a 1-step horizon from a ratio of -3 or 0, MFU against 0 or negative FLOP/s
        (["--target-param-data-ratio", "-3"], "--target-param-data-ratio must be > 0, got -3"),
        (["--target-param-data-ratio", "0"], "--target-param-data-ratio must be > 0, got 0"),
        (["--peak-flops", "0"], "--peak-flops must be > 0 (FLOP/s) or -1 (known GPUs only), got 0"),
        (["--peak-flops", "-7"], "--peak-flops must be > 0 (FLOP/s) or -1 (known GPUs only), got -7"),
        (["--target-flops", "0"], "--target-flops must be > 0 or -1 (not used), got 0"),
        (["--target-flops=-4.47e9"], "--target-flops must be > 0 or -1 (not used), got -4.47e9"),
        (["--stop-after", "0"], "--stop-after must be >= 1 (a step) or -1 (run to the end), got 0"),
        (
            ["--num-iterations", "10", "--stop-after", "20"],
            "--stop-after 20 is beyond the run's last step (--num-iterations 10): the run would end at 10 "
            "without stopping early",
        ),
    ],
)
def test_meaningless_horizons_and_peak_flops_are_refused(flags, message):
    args = build_parser("pretrain").parse_args(["pretrain", *flags])
    with pytest.raises(ConfigError) as e:
        from_args(args, TrainConfig, "pretrain")
    assert str(e.value) == message
    assert from_args(build_parser("pretrain").parse_args(["pretrain", "--stop-after", "10", "--num-iterations",
                     "10", "--peak-flops", "1e12"]), TrainConfig, "pretrain").train.horizon.stop_after == 10  # fmt: skip


@pytest.mark.parametrize("steps, horizon", [(1, "1 step, "), (1000, "1,000 steps, ")])
def test_the_plans_horizon_counts_its_steps(steps, horizon, capsys):
    """The plan printed "horizon (num_iterations): 1 steps"."""
    cfg = from_dict(TrainConfig, {"depth": 1, "num_iterations": steps})
    print_plan(cfg, make_plan(cfg, 512))
    out = capsys.readouterr().out.splitlines()
    line = next(ln for ln in out if ln.startswith("horizon"))
    assert line.startswith(f"horizon (num_iterations): {horizon}"), line
    # "tokens/param" was per parameter of the count printed "without the embedding", not of the total before it
    params = next(ln for ln in out if ln.startswith("parameters: "))
    scaling = int(re.search(r"\(([\d,]+) without the embedding\)", params).group(1).replace(",", ""))
    tokens = int(re.search(r"steps?, ([\d,]+) tokens, ", line).group(1).replace(",", ""))
    assert f", {tokens / scaling:.2f} tokens per parameter (without the embedding), " in line, line


def test_the_speedrun_names_its_preset_keys_in_configuration_errors(tmp_path):
    """The speedrun's stage configs are built from its preset, but their errors said `--min-workers`, a flag
    `raychat speedrun` does not have. They name the preset's keys, as its layout errors do (speedrun_flags),
    whether found as the preset is read or as a stage would plan (the total batch of pretraining): both before
    anything is written under --out."""
    tiny = yaml.safe_load((files("raychat") / "presets" / "tiny.yaml").read_text())

    def preset(section: str, **values) -> str:
        path = tmp_path / f"{section}-{'-'.join(values)}.yaml"
        path.write_text(yaml.safe_dump({**tiny, section: {**tiny[section], **values}}))
        return str(path)

    out = tmp_path / "out"
    for path, line in [
        (
            preset("train", min_workers=5),
            "train.min_workers must be 0 (fixed at train.num_workers) or 1..2 (elastic, at most train.num_workers "
            "2), got 5",
        ),
        (
            preset("sft", min_workers=3),
            "sft.min_workers must be 0 (fixed at train.num_workers) or 1..2 (elastic, at most train.num_workers 2), "
            "got 3",
        ),
        (preset("rl", prompts_per_step=0), "rl.prompts_per_step must be >= 1, got 0"),
        (  # found as pretraining plans, checked before the first stage (tests/unit/test_speedrun_checks.py)
            preset("train", total_batch_size=500),
            "train.total_batch_size 500 is not a multiple of train.device_batch_size x train.seq_len x "
            "train.num_workers = 4 x 64 x 2 = 512; allowed: a multiple of 512, e.g. 512",
        ),
    ]:
        with pytest.raises(ConfigError) as e:
            run_speedrun(path, str(out))
        assert str(e.value) == line
        assert not out.exists()


def test_rl_max_operand_keeps_every_calculator_call_computable():
    """rl.max_operand is capped at 10**9: the largest product, 10**9 * 10**9 = 10**18, is the calculator's bound
    (raychat.calculator.MAX_MAGNITUDE), so every call of a calculator prompt gets its result; one more and a
    product the engine answers with nothing could be drawn."""
    from raychat.calculator import MAX_MAGNITUDE, calculate

    assert from_dict(RLConfig, {"max_operand": 10**9}).task.max_operand == 10**9
    assert calculate(f"{10**9} * {10**9}") == str(MAX_MAGNITUDE) == "1000000000000000000"
    assert calculate(f"{10**9 + 1} * {10**9 + 1}") is None
    with pytest.raises(ConfigError) as e:
        from_dict(RLConfig, {"max_operand": 10**9 + 1})
    assert str(e.value) == "--max-operand must be <= 1000000000, got 1000000001"


def test_a_nested_preset_section_chooses_the_inputs_it_nests(tmp_path):
    """The storage-root rule took a preset section's top-level keys for the options it sets: nested by
    --help's sections (README), `data: {data_dir: ...}` was replaced by <root>/data, and `run: {storage_path:
    ...}` pointed no input under its root."""
    mine = tmp_path / "mine.yaml"

    def inputs(text: str) -> tuple:
        mine.write_text(text)
        args = build_parser("pretrain").parse_args(["pretrain", "--preset", str(mine)])
        cfg = from_args(args, TrainConfig, "pretrain", where="pretrain settings")
        return cfg.run.storage_path, cfg.data.data_dir, cfg.data.tokenizer_path

    nested_data = "train:\n  storage_path: /mnt/root\n  data:\n    data_dir: /data/mine\n"
    assert inputs(nested_data) == ("/mnt/root", "/data/mine", "/mnt/root/tokenizer")
    nested_root = "train:\n  run:\n    storage_path: /mnt/root\n"
    assert inputs(nested_root) == ("/mnt/root", "/mnt/root/data", "/mnt/root/tokenizer")


@pytest.mark.parametrize(
    "words, cls, section, attr, preset_value",
    [
        (["eval", "--preset", "tiny"], EvalConfig, "eval", "max_tokens", 8),
        (["data", "prepare", "--preset", "tiny"], PrepareConfig, "data", "num_shards", 5),
    ],
)
def test_a_flag_given_none_replaces_the_presets_value(words, cls, section, attr, preset_value):
    """`--max-tokens none` ("no value") was dropped as not given, so the preset's value stayed."""
    parse = build_parser(words[0]).parse_args
    assert getattr(from_args(parse(words), cls, section), attr) == preset_value
    assert getattr(from_args(parse([*words, flag_name(attr), "none"]), cls, section), attr) is None


def test_a_storage_path_of_none_points_no_input_under_a_root(tmp_path):
    """An eval preset's `storage_path: none` (or `--storage-path none`) ended in an AttributeError traceback."""
    mine = tmp_path / "eval.yaml"
    mine.write_text("eval:\n  storage_path: none\n  tasks: calculator:4\n")
    for extra in ([], ["--storage-path", "none"]):
        argv = ["eval", "--preset", str(mine), "--checkpoint", "/tmp/x", *extra]
        cfg = from_args(build_parser("eval").parse_args(argv), EvalConfig, "eval", where="eval settings")
        assert (cfg.storage_path, cfg.data_dir) == (None, "runs/data")


def test_sft_layers_a_nested_sft_section_on_the_train_sections_options(tmp_path):
    """`raychat sft --preset` put the sft section on the train section with a shallow dict update: an sft
    `optim: {matrix_lr: 0.01}` dropped the train section's embedding_lr and grad_clip; and an option the sft
    section nests wins over the train section's flat one, whatever the order of the keys."""
    mine = tmp_path / "mine.yaml"
    mine.write_text(
        "train:\n  optim:\n    embedding_lr: 0.3\n    grad_clip: 0.5\n  matrix_lr: 0.02\n"
        "sft:\n  optim:\n    matrix_lr: 0.01\n"
    )
    args = build_parser("sft").parse_args(["sft", "--preset", str(mine)])
    optim = from_args(args, TrainConfig, "sft", base=from_dict(TrainConfig, SFT_DEFAULTS)).optim
    assert (optim.matrix_lr, optim.embedding_lr, optim.grad_clip) == (0.01, 0.3, 0.5)
    assert preset_values(str(mine), "sft") == {
        "optim": {"embedding_lr": 0.3, "grad_clip": 0.5, "matrix_lr": 0.01}
    }
    pretrain = from_args(
        build_parser("pretrain").parse_args(["pretrain", "--preset", str(mine)]), TrainConfig, "pretrain"
    )
    assert (pretrain.optim.matrix_lr, pretrain.optim.embedding_lr) == (0.02, 0.3)


def test_the_vllm_port_is_a_tcp_port():
    assert from_dict(VLLMConfig, {"port": 65535, "hf_dir": "/x"}).port == 65535
    with pytest.raises(ConfigError) as e:
        from_dict(VLLMConfig, {"port": 70000, "hf_dir": "/x"})
    assert str(e.value) == "port must be <= 65535, got 70000"


def _tiny_with(tmp_path, name: str, **sections) -> str:
    """The tiny preset with `sections` in place of its own (None: without it), as a file."""
    tiny = yaml.safe_load((files("raychat") / "presets" / "tiny.yaml").read_text())
    path = tmp_path / f"{name}.yaml"
    text = {k: v for k, v in {**tiny, **sections}.items() if v is not None}
    path.write_text(yaml.safe_dump(text, sort_keys=False))
    return str(path)


def test_the_speedrun_runs_sft_and_rl_as_their_commands_read_the_preset(tmp_path):
    """Whether SFT and RL ran was read off the raw flat keys: a nested num_iterations or steps skipped them
    silently, an sft section without num_iterations skipped SFT (`raychat sft` takes the train section's, 4
    in tiny), and "2" or null ended in a TypeError traceback."""
    out = str(tmp_path / "out")
    rl = {"rollout": {"steps": 1, "prompts_per_step": 2, "samples_per_prompt": 2, "max_tokens": 8}}
    nested = {"train": {"horizon": {"num_iterations": 2}}, "sft_tasks": "calculator:200"}
    c = SpeedrunConfig.from_preset(_tiny_with(tmp_path, "nested", sft=nested, rl=rl), out)
    assert (c.sft.train.horizon.num_iterations, c.rl.rollout.steps) == (2, 1)
    inherit = _tiny_with(tmp_path, "inherit", sft={"sft_tasks": "calculator:200"})
    c = SpeedrunConfig.from_preset(inherit, out, num_iterations=7)  # --num-iterations: pretraining's alone
    assert (c.pretrain.train.horizon.num_iterations, c.sft.train.horizon.num_iterations) == (7, 4)
    quoted = _tiny_with(tmp_path, "quoted", sft={"num_iterations": "2", "sft_tasks": "calculator:200"})
    assert SpeedrunConfig.from_preset(quoted, out).sft.train.horizon.num_iterations == 2
    off = _tiny_with(tmp_path, "off", sft={"num_iterations": 0}, rl={"steps": 0})
    c = SpeedrunConfig.from_preset(off, out)
    assert (c.sft, c.rl) == (None, None)
    assert SpeedrunConfig.from_preset(_tiny_with(tmp_path, "none", sft=None), out).sft is None
    for value, shown_value in ((None, "None"), ("two", "'two'")):
        bad = _tiny_with(tmp_path, "bad", sft={"num_iterations": value})
        with pytest.raises(ConfigError) as e:
            SpeedrunConfig.from_preset(bad, out)
        assert str(e.value) == f"sft.num_iterations must be an integer, got {shown_value}"
    bad = _tiny_with(tmp_path, "bad_rl", rl={"rollout": {"steps": "many"}})
    with pytest.raises(ConfigError) as e:
        SpeedrunConfig.from_preset(bad, out)
    assert str(e.value) == "rl.steps must be an integer, got 'many'"
