"""raychat.capacity's check of a layout against what the cluster can become, per node: how many copies of one
bundle its nodes hold one by one (not only the cluster's totals), under the launcher's cap on worker nodes
shared by every worker type; and the CPU layout's refusal when no CPU is left for a worker."""

from __future__ import annotations

import json

import pytest

import raychat.capacity as capacity
from raychat.capacity import Capacity, NodeType, check_bundles
from raychat.train.layout import check_cpu_layout, layout_flags, worker_bundle

# ray_cluster.yaml's node types as published: a 0-CPU head and up to 8 GPU nodes of 48 CPUs and 8 GPUs
RAY_CLUSTER_YAML = Capacity(
    "node types", (NodeType("head", {"CPU": 0.0}, 1), NodeType("gpu_worker", {"CPU": 48.0, "GPU": 8.0}, 8))
)
# a launcher config whose cluster max_workers (3) caps its two worker types of max_workers 3 each together
SHARED_CAP_TYPES = (
    NodeType("head", {"CPU": 0.0}, 1),
    NodeType("small", {"CPU": 1.0}, 3),
    NodeType("gpu", {"CPU": 4.0, "GPU": 1.0}, 3),
)


def test_workers_that_fit_the_totals_but_not_the_nodes_one_by_one_are_refused():
    # {CPU: 48, GPU: 8} holds floor(48 / 9) = 5 workers of {CPU: 9, GPU: 1}: 8 nodes hold 40, though the
    # totals (378 of 384 CPUs, 42 of 64 GPUs) fit 42
    bundle = worker_bundle(9, True)
    with pytest.raises(ValueError) as e:
        check_bundles([bundle] * 42, RAY_CLUSTER_YAML, layout_flags(42, 9, True))
    assert str(e.value) == (
        "--num-workers 42 x --cpus-per-worker 9 --use-gpu: 42 of them need {CPU: 9, GPU: 1} each; the cluster's "
        "nodes can hold at most 40 of those (node types: head {CPU: 0} x 1, gpu_worker {CPU: 48, GPU: 8} x 8)"
    )
    check_bundles([bundle] * 40, RAY_CLUSTER_YAML, layout_flags(40, 9, True))  # 5 on each of the 8


def test_a_node_holds_a_bundle_as_often_as_its_scarcest_needed_resource_allows():
    node = NodeType("n", {"CPU": 0.3, "GPU": 2.0}, 1)
    assert node.fits({"CPU": 0.1}) == 3  # 0.3 / 0.1 is 2.9999999999999996 in floats: still 3
    assert node.fits({"CPU": 0.1, "GPU": 1.0}) == 2  # GPU is the scarcer
    assert node.fits({"CPU": 0.1, "GPU": 0.0}) == 3  # a resource the bundle does not need does not limit it
    assert node.fits({"CPU": 0.5}) == 0


def test_the_worker_types_share_the_clusters_cap_on_worker_nodes():
    shared_cap = Capacity("node types", SHARED_CAP_TYPES, max_workers=3, head_type="head")
    # 3 worker nodes in all, not 3 of each type: at best 3 gpu nodes, 12 CPUs (not 3 + 12 = 15)
    assert shared_cap.total("CPU") == 12 and shared_cap.total("GPU") == 3
    assert shared_cap.fits({"CPU": 1.0}, per_node=1) == 3  # nodes with room for one: 3, not 6
    assert shared_cap.fits({"CPU": 1.0}) == 12
    with pytest.raises(ValueError) as e:
        check_bundles([{"CPU": 1.0}] * 13, shared_cap, "--rollout-workers 13")
    assert str(e.value) == (
        "--rollout-workers 13: together they need 13 CPU; the cluster can hold at most 12 (node types: head "
        "{CPU: 0} x 1, small {CPU: 1} x 3, gpu {CPU: 4, GPU: 1} x 3; at most 3 worker nodes in all)"
    )
    check_bundles([{"CPU": 1.0}] * 12, shared_cap, "--rollout-workers 12")


def test_publish_node_types_publishes_the_cap_on_worker_nodes(monkeypatch):
    written = {}

    class Gcs:  # the GCS's two records, as publish_node_types writes them
        def __init__(self, address):
            pass

        def report_cluster_config(self, serialized):
            written["cluster config"] = serialized

        def internal_kv_put(self, key, value, overwrite, namespace):
            written[key] = value

    monkeypatch.setattr(capacity, "GcsClient", Gcs)
    config = {
        "max_workers": 3,
        "head_node_type": "head",
        "available_node_types": {
            "head": {"resources": {"CPU": 0}},
            "small": {"resources": {"CPU": 1}, "max_workers": 10},
            "gpu": {"resources": {"CPU": 4, "GPU": 1}},
        },
    }
    msg = capacity.publish_node_types(config, "127.0.0.1:6379")
    assert [(g.name, g.max_count) for g in msg.node_group_configs] == [("head", 1), ("small", 3), ("gpu", 3)]
    assert json.loads(written[capacity.WORKER_CAP_KEY.encode()]) == {
        "max_workers": 3,
        "head_node_type": "head",
    }


def test_a_cluster_with_no_cpu_beside_ray_datas_asks_for_more_cpus_not_a_zero_share():
    with pytest.raises(ValueError) as e:
        check_cpu_layout(1, 0.5, 1.0, 1.0, 1.0)
    assert str(e.value) == (
        "--num-workers 1 x --cpus-per-worker 0.5 plus 1 CPU for Ray Data (its read_parquet lists files in 1-CPU "
        "tasks) needs 1.5 CPUs; the cluster has 1: it needs more than the 1 CPU Ray Data reserves (a larger "
        "node, or more nodes), or the data tasks would never be scheduled and the run would wait forever"
    )
