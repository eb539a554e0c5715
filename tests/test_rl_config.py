"""RLConfig: validation messages, YAML round trip, the `raychat rl` flags."""

import argparse

import pytest

from raychat.rl.config import RLConfig, add_config_flags, config_from_args
from raychat.rl.loop import split_even


def test_yaml_round_trip(tmp_path):
    cfg = RLConfig(
        checkpoint="ck", mode="async", max_staleness=2, normalization="constant", constant_length=64
    )
    (tmp_path / "rl.yaml").write_text(cfg.to_yaml())
    assert RLConfig.from_yaml(tmp_path / "rl.yaml") == cfg
    assert cfg.denominator_length == 64 and RLConfig(max_tokens=40).denominator_length == 40


@pytest.mark.parametrize(
    "kw, match",
    [
        ({"normalization": "mean"}, r"--normalization must be one of \['token', 'sequence', 'constant'\]"),
        ({"mode": "fast"}, r"--mode must be one of \['sync', 'async'\]"),
        ({"weight_sync": "rpc"}, r"--weight-sync must be one of"),
        ({"samples_per_prompt": 0}, "--samples-per-prompt must be >= 1"),
        ({"temperature": 0.0}, "--temperature must be > 0"),
        ({"constant_length": 0}, "--constant-length"),
    ],
)
def test_validation_names_the_flag(kw, match):
    with pytest.raises(ValueError, match=match):
        RLConfig(**kw).validate()


def test_flags_override_yaml(tmp_path):
    (tmp_path / "c.yaml").write_text("rl:\n  steps: 7\n  mode: async\n")
    parser = argparse.ArgumentParser()
    add_config_flags(parser)
    cfg = config_from_args(
        parser.parse_args(["--config", str(tmp_path / "c.yaml"), "--steps", "9", "--scale-by-std"])
    )
    assert (cfg.steps, cfg.mode, cfg.scale_by_std) == (9, "async", True)
    (tmp_path / "bad.yaml").write_text("rl:\n  stepz: 7\n")
    with pytest.raises(ValueError, match="unknown rl settings"):
        config_from_args(parser.parse_args(["--config", str(tmp_path / "bad.yaml")]))


def test_cli_help_lists_the_rl_command(capsys):
    from raychat.cli import main

    with pytest.raises(SystemExit):
        main(["rl", "--help"])
    out = capsys.readouterr().out
    assert (
        "--checkpoint" in out
        and "--normalization {token,sequence,constant}" in out
        and "--max-staleness" in out
    )
    assert main(["rl", "--steps", "3"]) == 2  # no --checkpoint


def test_split_even():
    assert split_even(list(range(5)), 2) == [[0, 1, 2], [3, 4]]
    assert split_even([1], 3) == [[1]]
