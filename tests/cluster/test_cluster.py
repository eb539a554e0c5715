"""The multi-node fixture cluster (tests/support/cluster.py) does what a real cluster does: tasks land on the nodes
their resources name, metrics are scraped from the node that recorded them, and a node whose raylet dies is
DEAD. (Ray Train ranks on two nodes committing checkpoints to S3 and resuming from them: the pretraining job of
tests/cluster/test_stage_jobs.py, through raychat's own trainer.)

Plain Ray code on purpose: this is about the cluster, not raychat. The node-loss test
is last: it kills worker "b" and starts it again, so the session's cluster is whole for later tests.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
import urllib.request
import uuid

import pytest
import ray
from prometheus_client.parser import text_string_to_metric_families

from raychat.metrics import TrainMetrics

pytestmark = pytest.mark.ray
# The cluster's workers cannot import this test module: ship its functions and classes by value.
ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])


@ray.remote(num_cpus=0)
def node_id() -> str:
    return ray.get_runtime_context().get_node_id()


def test_three_nodes_and_tasks_pinned_by_custom_resource(multinode_driver):
    c = multinode_driver
    alive = {n["NodeID"]: n for n in ray.nodes() if n["Alive"]}
    assert set(alive) == {c.nodes[k].node_id for k in ("head", "a", "b")}
    assert [alive[c.nodes[k].node_id]["Resources"].get("CPU", 0) for k in ("head", "a", "b")] == [0, 2, 2]
    assert alive[c.nodes["a"].node_id]["Resources"]["node_a"] == 1
    assert ray.cluster_resources()["CPU"] == 4

    on_a = ray.get([node_id.options(resources={"node_a": 1}).remote() for _ in range(3)])
    on_b = ray.get([node_id.options(resources={"node_b": 1}).remote() for _ in range(3)])
    assert on_a == [c.nodes["a"].node_id] * 3
    assert on_b == [c.nodes["b"].node_id] * 3


@ray.remote(num_cpus=0, resources={"node_a": 0.01})
class Recorder:
    def record(self, run: str) -> str:
        TrainMetrics(run, "pretrain").record(
            step=3, loss=2.5, lr=1e-3, tokens_per_s=812.0, mfu=None, grad_norm=0.5, data_wait_frac=0.25
        )
        return ray.get_runtime_context().get_node_id()


def _scrape(port: int, run: str) -> dict[str, float]:
    body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    return {
        s.name: s.value
        for family in text_string_to_metric_families(body)
        for s in family.samples
        if s.name.startswith("ray_raychat_train") and s.labels.get("run") == run
    }


def test_metrics_scraped_from_the_worker_node_that_recorded_them(multinode_driver):
    c = multinode_driver
    run = f"m-{uuid.uuid4().hex[:6]}"
    recorder = Recorder.remote()
    assert ray.get(recorder.record.remote(run)) == c.nodes["a"].node_id
    want = {
        "ray_raychat_train_step": 3.0,
        "ray_raychat_train_loss": 2.5,
        "ray_raychat_train_tokens_per_s": 812.0,
        "ray_raychat_train_data_wait_frac": 0.25,
    }
    deadline = time.monotonic() + 60
    while (got := _scrape(c.nodes["a"].metrics_port, run)).keys() < want.keys():
        assert time.monotonic() < deadline, f"node a's metrics port never showed {run}: {got}"
        time.sleep(1)
    assert {k: got[k] for k in want} == want
    # each node exports its own processes' metrics: the head and node b never saw this run
    assert _scrape(c.head.metrics_port, run) == {}
    assert _scrape(c.nodes["b"].metrics_port, run) == {}
    ray.kill(recorder)


# a job whose tasks print one line on node a and one on node b
PRINTING_JOB = """import ray
@ray.remote(num_cpus=0)
def say(n):
    print(f"printed-on-{n}")
ray.get([say.options(resources={f"node_{n}": 0.01}).remote(n) for n in "ab"])
"""


def test_a_line_a_worker_node_prints_reaches_the_jobs_logs_once(multinode_cluster, tmp_path):
    """Nodes on one machine that share a temp dir (docs/deployment.md section 1's commands did) each run a log
    monitor over the same worker log files: `raychat submit` showed each such line once per node, 3 times."""
    c = multinode_cluster
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    env["HOME"] = str(tmp_path)
    r = subprocess.run(
        [sys.executable, "-m", "raychat.cli", "submit", "--address", c.dashboard_url, "--token-file",
         str(c.token_file), "command", "python", "-c", PRINTING_JOB],
        env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert r.returncode == 0, r.stdout + r.stderr
    assert sorted(re.findall(r"printed-on-[ab]", r.stdout)) == ["printed-on-a", "printed-on-b"], r.stdout


def test_killing_a_raylet_makes_its_node_dead_and_it_can_rejoin(multinode_driver):
    c = multinode_driver
    lost = c.kill_raylet("b")
    try:
        deadline = time.monotonic() + 60
        while any(n["NodeID"] == lost and n["Alive"] for n in ray.nodes()):
            assert time.monotonic() < deadline, "node b still ALIVE 60 s after its raylet was killed"
            time.sleep(0.5)
        states = {n["node_id"]: n["state"] for n in c.list_nodes()}  # the state API says the same
        assert states[lost] == "DEAD"
        assert {n["NodeID"] for n in ray.nodes() if n["Alive"]} == {c.head.node_id, c.nodes["a"].node_id}
    finally:
        cpus, resources = c.nodes["b"].num_cpus, c.nodes["b"].resources
        back = c.add_worker("b", cpus, resources)
    assert back.node_id != lost
    assert ray.get(node_id.options(resources={"node_b": 1}).remote()) == back.node_id
