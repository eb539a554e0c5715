"""The multi-node fixture cluster (tests/support/cluster.py) does what a real cluster does: tasks and Ray Train workers
land on the nodes their resources name, metrics are scraped from the node that recorded them, Ray Train
checkpoints go to S3 (moto) and resume from there, and a node whose raylet dies is DEAD.

Plain Ray and Ray Train code on purpose: this is about the cluster, not raychat's trainer. The node-loss test
is last: it kills worker "b" and starts it again, so the session's cluster is whole for later tests.
"""

from __future__ import annotations

import json
import sys
import tempfile
import time
import urllib.request
import uuid

import pytest
import ray
import ray.train
import torch
import torch.distributed as dist
from prometheus_client.parser import text_string_to_metric_families
from ray.train import RunConfig, ScalingConfig
from ray.train.torch import TorchTrainer
from safetensors.torch import load_file, save_file

from raychat.checkpoint_manager import CheckpointManager, resolve_checkpoint
from raychat.metrics import TrainMetrics
from raychat.storage import open_storage
from raychat.train.checkpointer import commit_ranks

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


def _two_steps(config):
    """Resume from the run's newest committed checkpoint if there is one, then two steps, each committing a
    checkpoint the way raychat's Trainer does (every rank uploads its part, rank 0 commits: model.safetensors
    and meta.json with the step from rank 0, a state file per rank) and reporting what the ranks saw: every
    rank's node id (all-gathered over gloo) and the sum of the ranks (all-reduced)."""
    ctx = ray.train.get_context()
    rank, world = ctx.get_world_rank(), ctx.get_world_size()
    manager = config["checkpoints"]
    newest = manager.newest()
    start = newest.step if newest else 0
    ids = [None] * world
    dist.all_gather_object(ids, ray.get_runtime_context().get_node_id())
    rank_sum = torch.tensor([float(rank)])
    dist.all_reduce(rank_sum)
    for step in range(start + 1, start + 3):
        with tempfile.TemporaryDirectory() as d:
            if rank == 0:
                save_file({"w": torch.full((4,), float(step))}, f"{d}/model.safetensors")
                open(f"{d}/meta.json", "w").write(json.dumps({"step": step}))
            open(f"{d}/state_rank{rank}.npz", "w").write(f"rank {rank} step {step}")
            commit_ranks(manager, d, step, rank, world, "pretrain")
        metrics = {"step": step, "resumed_from": start, "node_ids": ids, "rank_sum": rank_sum.item()}
        ray.train.report(metrics)
    return metrics  # Ray Train V2 keeps metrics only beside a checkpoint; rank 0's return value reaches the driver


@pytest.mark.slow
def test_train_runs_on_two_nodes_checkpoints_to_s3_and_resumes_from_it(multinode_driver, s3_env, tmp_path):
    """Ray Train on the cluster commits checkpoints to moto's S3 through raychat's CheckpointManager (the
    endpoint comes from AWS_ENDPOINT_URL here and travels with the pickled filesystem; the nodes have their own
    credentials), both ranks' files under one commit marker, resumes from the bucket, and the resolver finds
    the newest committed checkpoint."""
    c = multinode_driver
    bucket = s3_env.make_bucket()
    root = open_storage(f"s3://{bucket}/runs")

    def fit():
        return TorchTrainer(
            _two_steps,
            train_loop_config={"checkpoints": CheckpointManager(root, "resume")},
            scaling_config=ScalingConfig(
                num_workers=2, resources_per_worker={"CPU": 1}, placement_strategy="STRICT_SPREAD"
            ),
            run_config=RunConfig(name="resume", **root.ray_train_storage()),
        ).fit()

    first = fit().return_value
    assert (first["step"], first["resumed_from"]) == (2, 0)
    # STRICT_SPREAD and no CPU on the head: the two ranks must be on a and b
    assert sorted(first["node_ids"]) == sorted([c.nodes["a"].node_id, c.nodes["b"].node_id])
    assert first["rank_sum"] == 0 + 1
    second = fit().return_value
    assert (second["step"], second["resumed_from"]) == (4, 2)

    assert [ck.step for ck in CheckpointManager(root, "resume").committed()] == [1, 2, 3, 4]
    latest = resolve_checkpoint(f"s3://{bucket}/runs/resume/latest", cache_dir=tmp_path)
    assert json.loads((latest / "meta.json").read_text()) == {"step": 4}
    assert load_file(str(latest / "model.safetensors"))["w"].tolist() == [4.0] * 4
    commit = json.loads((latest / "commit.json").read_text())
    assert sorted(commit["files"]) == ["meta.json", "model.safetensors", "state_rank0.npz", "state_rank1.npz"]
    assert (latest / "state_rank1.npz").read_text() == "rank 1 step 4"


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
