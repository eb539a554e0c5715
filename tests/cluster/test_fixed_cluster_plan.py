"""A fixed `ray start` cluster (its head started without --autoscaling-config) is planned as its alive nodes: a
layout it can never hold is refused at once with the plan's message, not waited for until --schedule-timeout-s.

Such a head runs Ray's v1 monitor with the read-only provider, which writes an autoscaler status too (one node
type per alive node); the plan used to take that status for an autoscaler whose node types are unknown. The
session's multi-node fixture cluster (tests/support/cluster.py: a head of 0 CPUs, workers a and b of 2 CPUs) is
that cluster. A real autoscaler still counts as one: tests/cluster/test_autoscaling.py.
"""

from __future__ import annotations

import re
import time

import pytest

from raychat.capacity import autoscaler_running, monitor_status, read_capacity, read_only_monitor
from raychat.train.layout import start_or_connect

pytestmark = pytest.mark.ray


def test_an_impossible_layout_on_a_fixed_cluster_is_refused_at_once(multinode_driver):
    deadline = time.monotonic() + 60
    while not read_only_monitor(monitor_status() or {}):  # the monitor reports within seconds of the start
        assert time.monotonic() < deadline, f"no read-only monitor report: {monitor_status()}"
        time.sleep(0.5)
    assert not autoscaler_running()
    capacity = read_capacity()
    assert (capacity.source, capacity.known, capacity.total("CPU")) == ("alive nodes", True, 4.0)

    t0 = time.monotonic()
    with pytest.raises(ValueError) as too_many:
        start_or_connect(num_workers=8, cpus_per_worker=1.0, data_cpus=0.5)
    need, _, nodes = str(too_many.value).partition(" (alive nodes: ")
    assert (
        need
        == "--num-workers 8 x --cpus-per-worker 1: together they need 8 CPU; the cluster can hold at most 4"
    )
    assert sorted(re.sub(r"node [\d.]+", "node IP", nodes.removesuffix(")")).split(", ")) == [
        "alive node IP (head) {no CPU} x 1",
        "alive node IP {CPU: 2} x 1",
        "alive node IP {CPU: 2} x 1",
    ], str(too_many.value)  # sorted: ray.nodes() lists the nodes in no fixed order
    with pytest.raises(ValueError) as gpu:
        start_or_connect(num_workers=1, cpus_per_worker=1.0, data_cpus=0.5, use_gpu=True)
    assert re.fullmatch(
        r"--num-workers 1 x --cpus-per-worker 1 --use-gpu: one of them needs \{CPU: 1, GPU: 1\}; no node type "
        r"has room: GPU \(need 1, the most a node has is 0\); largest node type: alive node [\d.]+ \{CPU: 2\}",
        str(gpu.value),
    ), str(gpu.value)
    # at once, not after --schedule-timeout-s (600 s); the slack is a loaded machine's
    assert time.monotonic() - t0 < 60
