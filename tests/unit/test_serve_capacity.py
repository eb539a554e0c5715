"""`raychat serve`'s check of its first replicas against the cluster (raychat.serve.cli.check_capacity): a
cluster this process did not start is checked node by node against what it can become, and
--max-replicas-per-node limits how many replicas each node holds."""

from __future__ import annotations

import pytest

from raychat.capacity import Capacity, NodeType
from raychat.config import ServeConfig, from_dict
from raychat.serve.cli import check_capacity

# `ray start --head --num-cpus=0` and two `ray start` nodes of 2 CPUs (docs/deployment.md section 1)
JOINED = Capacity(
    "alive nodes",
    (
        NodeType("alive node 10.0.0.1 (head)", {"CPU": 0.0}, 1),
        NodeType("alive node 10.0.0.2", {"CPU": 2.0}, 1),
        NodeType("alive node 10.0.0.3", {"CPU": 2.0}, 1),
    ),
)
ONE_NODE = Capacity("alive nodes", (NodeType("alive node 10.0.0.1 (head)", {"CPU": 8.0}, 1),))


def serve(**values) -> ServeConfig:
    return from_dict(ServeConfig, {"checkpoint": "/x", "allow_unauthenticated": True, **values})


def test_a_joined_cluster_is_checked_node_by_node_not_by_its_total():
    # 4 CPUs in all, but no node has 3: serve.run would wait forever
    with pytest.raises(ValueError) as e:
        check_capacity(serve(num_cpus=3), JOINED, one_machine=False)
    assert str(e.value) == (
        "--num-cpus, --num-gpus, --min-replicas: one of them needs {CPU: 3}; no node type has room: CPU (need 3, "
        "the most a node has is 2); largest node type: alive node 10.0.0.3 {CPU: 2}"
    )
    check_capacity(serve(num_cpus=2), JOINED, one_machine=False)


def test_an_autoscaling_cluster_may_add_the_gpu_nodes_a_replica_needs():
    head = Capacity("autoscaler", (NodeType("alive node 10.0.0.1 (head)", {"CPU": 0.0}, 1),))
    check_capacity(serve(num_gpus=1), head, one_machine=False)  # accepted: the autoscaler adds GPU nodes
    with pytest.raises(ValueError) as e:  # a cluster this process started never grows
        check_capacity(serve(num_gpus=1), ONE_NODE, one_machine=True)
    assert str(e.value) == (
        "1 engine replica x --num-gpus 1 = 1 GPU, but this machine's Ray cluster has 0; lower --num-gpus (0 = "
        "CPU) or --min-replicas"
    )


@pytest.mark.parametrize("one_machine", [True, False])
def test_min_replicas_beyond_max_replicas_per_node_times_the_nodes_are_refused(one_machine):
    config = serve(min_replicas=2, max_replicas=2, max_replicas_per_node=1)
    with pytest.raises(ValueError) as e:
        check_capacity(config, ONE_NODE, one_machine)
    assert str(e.value) == (
        "--min-replicas 2 with --max-replicas-per-node 1: 2 engine replicas of {CPU: 1}, at most 1 a node; the "
        "cluster's nodes can hold at most 1 that way (alive nodes: alive node 10.0.0.1 (head) {CPU: 8} x 1); "
        "lower --min-replicas or raise --max-replicas-per-node"
    )
    check_capacity(config, JOINED, one_machine=False)  # one on each 2-CPU node
    check_capacity(serve(min_replicas=2, max_replicas=2, max_replicas_per_node=2), ONE_NODE, one_machine)
