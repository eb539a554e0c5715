"""ray_cluster.yaml validates against the installed ray's autoscaler schema, the way `ray up` checks it."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import jsonschema
import pytest
import ray
import yaml

REPO = Path(__file__).resolve().parents[2]
SCHEMA = Path(ray.__file__).parent / "autoscaler" / "ray-schema.json"


@pytest.fixture(scope="module")
def config() -> dict:
    return yaml.safe_load((REPO / "ray_cluster.yaml").read_text())


def test_schema_validates_and_rejects(config):
    schema = json.loads(SCHEMA.read_text())
    jsonschema.validate(config, schema)
    broken = copy.deepcopy(config)
    broken["available_node_types"]["gpu_worker"]["min_wokers"] = 1  # typo: additionalProperties is false
    with pytest.raises(jsonschema.ValidationError, match="min_wokers"):
        jsonschema.validate(broken, schema)


def test_ray_up_preparation_accepts_it(config):
    # `ray up` runs prepare_config (fills provider defaults) and then validate_config.
    from ray.autoscaler._private.util import prepare_config, validate_config

    prepared = prepare_config(copy.deepcopy(config))
    validate_config(prepared)
    assert prepared["head_node_type"] == "head"
    assert prepared["available_node_types"]["head"]["max_workers"] == 0


def test_gpu_cluster_shape(config):
    gpu = config["available_node_types"]["gpu_worker"]
    assert (gpu["min_workers"], gpu["max_workers"]) == (0, 8) and gpu["resources"]["GPU"] == 8
    assert config["available_node_types"]["head"]["resources"] == {"CPU": 0}  # no work on the head
    assert config["docker"]["image"] == f"rayproject/ray:{ray.__version__}-py311-gpu"  # same Ray as ours
    assert "-v /mnt/shared:/mnt/shared" in config["docker"]["run_options"]  # checkpoints on shared storage
    setup = "\n".join(config["setup_commands"])
    assert 'pip install -q -c /home/ray/raychat/constraints.txt -e "/home/ray/raychat"' in setup
    assert config["file_mounts"]["/home/ray/raychat"] == "."
    assert all("RAY_AUTH_MODE=token ray start" in cmd for cmd in (
        config["head_start_ray_commands"][-1], config["worker_start_ray_commands"][-1]
    ))  # fmt: skip
