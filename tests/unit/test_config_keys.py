"""Keys a configuration file may not get wrong silently: a preset's misspelled section, one option under both its
name and an alias, and a Serve config option set both in `args` and in `deployments:` (where a
ray_actor_options sets every key of it, Serve's default for one left out)."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from raychat.cli import build_parser
from raychat.config import ConfigError, RLConfig, ServeConfig, TrainConfig, from_args, from_dict
from raychat.config.presets import read_preset
from raychat.serve.deployments import read_serve_app

REPO = Path(__file__).resolve().parents[2]
AUTOSCALING = {"min_replicas": 1, "max_replicas": 4, "target_ongoing_requests": 8, "upscale_delay_s": 1,
               "downscale_delay_s": 1, "look_back_period_s": 11}  # fmt: skip


def test_a_preset_section_misspelled_beside_a_stage_section_is_refused(tmp_path):
    preset = tmp_path / "typo.yaml"
    preset.write_text("train:\n  depth: 6\nsevre:\n  num_gpus: 1\n  max_slots: 32\n")
    with pytest.raises(ValueError) as e:
        read_preset(str(preset))
    assert str(e.value) == (
        f"--preset {preset}: unknown sections ['sevre'] (did you mean serve?); allowed: ['data', 'tokenizer', "
        "'train', 'sft', 'rl', 'serve', 'eval']"
    )
    alone = tmp_path / "rl_options.yaml"  # no stage section: the file is one section of options
    alone.write_text("sevre: 1\n")
    assert read_preset(str(alone)) == {"sevre": 1}


@pytest.mark.parametrize(
    "values, message",
    [
        ({"replicas": 2, "max_replicas": 4}, "build_app args: 'replicas' and 'max_replicas' both set max_replicas; give one"),
        ({"max_slots": 16, "max_rows": 4}, "build_app args: 'max_slots' and 'max_rows' both set max_slots; give one"),
        ({"replica": {"max_slots": 16}, "max_rows": 4}, "build_app args: 'replica.max_slots' and 'max_rows' both set max_slots; give one"),
    ],
)  # fmt: skip
def test_an_option_under_its_name_and_its_alias_is_refused(values, message):
    with pytest.raises(ConfigError) as e:
        from_dict(ServeConfig, {"checkpoint": "x", **values}, where="build_app args")
    assert str(e.value) == message


def test_an_alias_in_args_and_its_option_in_deployments_is_set_both():
    app = {"args": {"checkpoint": "x", "replicas": 2},
           "deployments": [{"name": "ChatServer", "autoscaling_config": AUTOSCALING}]}  # fmt: skip
    with pytest.raises(ConfigError) as e:
        read_serve_app(app)
    assert str(e.value) == "['max_replicas'] set both in args and in deployments: (one place each)"


def test_num_gpus_in_args_beside_a_ray_actor_options_without_it_is_set_both():
    # Serve replaces ray_actor_options whole: chat.yaml's {num_cpus: 2} runs its replicas on 0 GPUs
    app = yaml.safe_load((REPO / "serve" / "chat.yaml").read_text())["applications"][0]
    assert read_serve_app(app).replica.num_gpus == 0
    app["args"]["num_gpus"] = 1
    with pytest.raises(ConfigError) as e:
        read_serve_app(app)
    assert str(e.value) == "['num_gpus'] set both in args and in deployments: (one place each)"


def test_a_yaml_merge_key_reads_as_safe_load_reads_it(tmp_path):
    """`<<: *base` was refused ("could not determine a constructor for the tag ...merge"); the mapping's own
    keys replace the merged ones (not a key given twice), and an unhashable key is a one-line YAML error, not a
    TypeError traceback."""
    merge = tmp_path / "merge.yaml"
    merge.write_text(
        "train: &base\n  depth: 2\n  seq_len: 64\nsft:\n  <<: *base\n  seq_len: 32\n  num_iterations: 5\n"
    )
    assert read_preset(str(merge)) == {
        "train": {"depth": 2, "seq_len": 64},
        "sft": {"depth": 2, "seq_len": 32, "num_iterations": 5},
    }
    unhashable = tmp_path / "unhashable.yaml"
    unhashable.write_text("train:\n  ? [depth]\n  : 2\n")
    with pytest.raises(ValueError) as e:
        read_preset(str(unhashable))
    assert (
        str(e.value) == f"--preset: {unhashable} is not valid YAML at line 2, column 5: found unhashable key"
    )


@pytest.mark.parametrize(
    "command, text, layers",
    [
        (
            "rl",
            "eval:\n  eval_every: 2\n  eval_examples: 8\n",
            "'rl'",
        ),  # RLConfig's eval section, or raychat eval's?
        ("pretrain", "data:\n  data_dir: /data/mine\n", "'train'"),  # TrainConfig's data, or data prepare's?
        ("sft", "data:\n  buffer_size: 64\n", "'train' or 'sft'"),
    ],
)
def test_a_file_of_only_another_commands_sections_is_refused(tmp_path, command, text, layers):
    """A file whose keys are all stage sections that are also sections of the command's config was read as a
    staged preset without the command's section: every option silently ignored."""
    mine = tmp_path / "mine.yaml"
    mine.write_text(text)
    cls = RLConfig if command == "rl" else TrainConfig
    args = build_parser(command).parse_args([command, "--preset", str(mine)])
    with pytest.raises(ConfigError) as e:
        from_args(args, cls, command, where=f"{command} settings")
    section = text.split(":")[0]
    assert str(e.value) == (
        f"--preset {mine}: no {layers} section; its sections ['{section}'] are other commands' (stage sections: "
        f"['data', 'tokenizer', 'train', 'sft', 'rl', 'serve', 'eval']): put this command's options under "
        f"{layers.split()[-1].strip(chr(39))}:"
    )
