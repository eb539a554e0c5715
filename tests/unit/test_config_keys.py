"""Keys a configuration file may not get wrong silently: a preset's misspelled section, one option under both its
name and an alias, and a Serve config option set both in `args` and in `deployments:` (where a
ray_actor_options sets every key of it, Serve's default for one left out)."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from raychat.config import ConfigError, ServeConfig, from_dict
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
