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
    # the raychat image (the Dockerfile, on rayproject/ray of our Ray: tests/unit/test_image.py), by the name
    # k8s/overlays/gpu gives it
    gpu_overlay = yaml.safe_load((REPO / "k8s/overlays/gpu/kustomization.yaml").read_text())
    (image,) = [i for i in gpu_overlay["images"] if i["name"] == "raychat"]
    assert config["docker"]["image"] == f"{image['newName']}:{image['newTag']}"
    # shared storage at the k8s PVC's path, the storage root of the GPU presets
    assert "-v /mnt/shared:/mnt/checkpoints" in config["docker"]["run_options"]
    setup = "\n".join(config["setup_commands"])
    assert 'pip install -q -c /home/ray/raychat/constraints.txt -e "/home/ray/raychat"' in setup
    assert config["file_mounts"]["/home/ray/raychat"] == "."
    assert all("RAY_AUTH_MODE=token ray start" in cmd for cmd in (
        config["head_start_ray_commands"][-1], config["worker_start_ray_commands"][-1]
    ))  # fmt: skip


def test_gpu_presets_use_the_shared_mount_and_fit_a_gpu_node(config):
    """gpu8 and cluster read and write every stage under the storage root that both the launcher's shared mount
    and the k8s/ PVC put at /mnt/checkpoints/runs; a GPU node of ray_cluster.yaml is a GPU pod of k8s/."""
    from raychat.config import preset_section
    from raychat.ops import k8s

    mounts = [o.split()[1] for o in config["docker"]["run_options"] if o.startswith("-v ")]
    assert [m.split(":")[1] for m in mounts] == [k8s.CHECKPOINTS_MOUNT]
    assert "mkdir -p /mnt/checkpoints/runs" in config["setup_commands"]
    assert k8s.STORAGE_ROOT == "/mnt/checkpoints/runs"
    for preset in ("gpu8", "cluster"):
        for section in ("data", "tokenizer", "train", "rl", "eval"):
            assert preset_section(preset, section)["storage_path"] == k8s.STORAGE_ROOT, (preset, section)
        train = preset_section(preset, "train")
        # a node's ranks and Ray Data's read + tokenize tasks (8 CPUs) fit its CPUs; ranks fill whole nodes
        assert min(8, train["num_workers"]) * train["cpus_per_worker"] + 8 <= k8s.GPU_POD_CPUS, preset
        assert train["num_workers"] % k8s.GPUS_PER_POD == 0, preset
    gpu = config["available_node_types"]["gpu_worker"]["resources"]
    assert gpu == {"CPU": k8s.GPU_POD_CPUS, "GPU": k8s.GPUS_PER_POD}
    assert preset_section("cluster", "train")["num_workers"] == k8s.GPU_PODS * k8s.GPUS_PER_POD
