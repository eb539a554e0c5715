"""A Ray cluster with a real autoscaler on one machine: `ray start --head --autoscaling-config` with Ray's
fake_multinode node provider, which runs Ray's own autoscaler (monitor.py, StandardAutoscaler) and launches
real raylets on this machine as the cluster's "instances".

Shaped like the clusters raychat documents (shipped_node_types): the head type and worker types are read
from ray_cluster.yaml's `available_node_types` and from the KubeRay generator (raychat.ops.k8s.cluster_spec,
the cpu-dev overlay's CPU group), then scaled down to this machine (scaled_node_types): a head of 0 CPUs, a
CPU worker type (min 0) and a worker type that declares a GPU (min 0; the fake node has no CUDA, which is
enough for scheduling).

Why not `ray.cluster_utils.AutoscalingCluster`: the Ray 2.60 wheel lacks the example.yaml it reads, and its
start()/shutdown() run `ray stop --force`, which ends every Ray cluster on the machine (../shared/FACTS.md).
Here the head is one `ray start --head --block` in a process group of its own; the fake nodes run in the
autoscaler's process tree under this cluster's temp dir, so stop() ends the group and then every process
whose command line names the temp dir (support.cluster._kill_leftovers). The provider's `gcs_address` is
required: without it the fake nodes dial the machine's external address on port 6379 and never join.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from raychat.ops import k8s
from raychat.ports import free_ports
from support.cluster import (
    HEAD_PORTS,
    NODE_PORTS,
    RAY,
    VENV_BIN,
    LocalCluster,
    Node,
    _end_group,
    _kill_leftovers,
    start_with_retry,
)

REPO = Path(__file__).resolve().parents[2]
HEAD_TYPE = "ray.head.default"  # the head's type name the fake provider requires
CPU_TYPE, GPU_TYPE = "cpu_worker", "gpu_worker"
# This machine's budget for one fake node: 2 logical CPUs (the fixture cluster's worker size, see
# support.cluster.CLUSTER_WORKERS), at most 2 CPU nodes and 1 GPU node.
NODE_CPUS, MAX_CPU_NODES, MAX_GPU_NODES = 2, 2, 1
OBJECT_STORE_BYTES = 100 * 1024 * 1024
AUTOSCALER_ENV = {"RAY_FAKE_CLUSTER": "1", "AUTOSCALER_UPDATE_INTERVAL_S": "1"}


def shipped_node_types(repo: Path = REPO) -> dict[str, dict]:
    """{source: {node type: {"resources": {...}, "min_workers", "max_workers"}}} of the documented clusters:
    "ray_cluster.yaml" (its available_node_types), "k8s" (k8s/base's RayCluster: the head and the GPU group),
    "k8s-cpu-dev" (the cpu-dev overlay's CPU group: GPU group with its patches applied)."""
    launcher = yaml.safe_load((repo / "ray_cluster.yaml").read_text())
    out = {"ray_cluster.yaml": {}}
    for name, t in launcher["available_node_types"].items():
        out["ray_cluster.yaml"][name] = {
            "resources": dict(t["resources"]),
            "min_workers": t.get("min_workers", 0),
            "max_workers": t.get("max_workers", 0),
        }
    spec = k8s.cluster_spec()
    head_cpus = float(spec["headGroupSpec"]["rayStartParams"]["num-cpus"])
    out["k8s"] = {"head": {"resources": {"CPU": head_cpus}, "min_workers": 0, "max_workers": 0}}
    for g in spec["workerGroupSpecs"]:
        limits = g["template"]["spec"]["containers"][0]["resources"]["limits"]
        res = {"CPU": float(limits["cpu"])}
        if "nvidia.com/gpu" in limits:
            res["GPU"] = float(limits["nvidia.com/gpu"])
        out["k8s"][g["groupName"]] = {
            "resources": res,
            "min_workers": g["minReplicas"],
            "max_workers": g["maxReplicas"],
        }
    patch = yaml.safe_load((repo / "k8s/overlays/cpu-dev/cpu-workers-raycluster.yaml").read_text())
    ops = {op["path"]: op.get("value") for op in patch}
    gpu_group = spec["workerGroupSpecs"][0]
    cpu = ops["/spec/workerGroupSpecs/0/template/spec/containers/0/resources"]["limits"]["cpu"]
    out["k8s-cpu-dev"] = {
        ops["/spec/workerGroupSpecs/0/groupName"]: {
            "resources": {"CPU": float(cpu)},
            "min_workers": gpu_group["minReplicas"],
            "max_workers": ops["/spec/workerGroupSpecs/0/maxReplicas"],
        }
    }
    return out


def scaled_node_types(with_gpu: bool = True) -> dict[str, dict]:
    """The fake cluster's available_node_types: the shipped shapes (shipped_node_types) scaled to this
    machine. Asserts what it scales from, so a change of the shipped shapes fails here first: every shipped
    head has 0 CPUs, every worker type starts at min 0, the GPU types declare GPUs, the cpu-dev group is
    CPU only. Scaled: CPUs to NODE_CPUS per node, GPUs to 1, max nodes to MAX_CPU_NODES / MAX_GPU_NODES."""
    shipped = shipped_node_types()
    heads = [shipped["ray_cluster.yaml"]["head"], shipped["k8s"]["head"]]
    assert all(h["resources"]["CPU"] == 0 for h in heads), heads
    workers = [t for src in shipped.values() for name, t in src.items() if name != "head"]
    assert all(t["min_workers"] == 0 for t in workers), workers
    gpu_types = [t for t in workers if t["resources"].get("GPU", 0) > 0]
    cpu_types = [t for t in workers if not t["resources"].get("GPU", 0)]
    assert gpu_types and cpu_types, shipped

    def node(resources: dict, max_workers: int) -> dict:
        return {
            "resources": resources,
            "min_workers": 0,
            "max_workers": max_workers,
            "node_config": {},
        }

    types = {
        HEAD_TYPE: {**node({"CPU": 0}, 0), "max_workers": 0},
        CPU_TYPE: node({"CPU": NODE_CPUS, "object_store_memory": OBJECT_STORE_BYTES}, MAX_CPU_NODES),
    }
    if with_gpu:
        types[GPU_TYPE] = node(
            {"CPU": NODE_CPUS, "GPU": 1, "object_store_memory": OBJECT_STORE_BYTES}, MAX_GPU_NODES
        )
    return types


def cluster_config(gcs_port: int, node_types: dict, idle_timeout_minutes: float) -> dict:
    """The autoscaling config of the fake cluster (the recipe of ../shared/FACTS.md)."""
    return {
        "cluster_name": "raychat-fake",
        "max_workers": sum(t["max_workers"] for t in node_types.values()),
        "upscaling_speed": 1.0,
        "idle_timeout_minutes": idle_timeout_minutes,
        "provider": {
            "type": "fake_multinode",
            "use_node_id_as_ip": True,
            "disable_node_updaters": True,
            "disable_launch_config_check": True,
            "gcs_address": f"127.0.0.1:{gcs_port}",
        },
        "auth": {"ssh_user": "nobody"},
        "available_node_types": node_types,
        "head_node_type": HEAD_TYPE,
        "file_mounts": {},
        "cluster_synced_files": [],
        "file_mounts_sync_continuously": False,
        "rsync_exclude": [],
        "rsync_filter": [],
        "initialization_commands": [],
        "setup_commands": [],
        "head_setup_commands": [],
        "worker_setup_commands": [],
        "head_start_ray_commands": [],
        "worker_start_ray_commands": [],
    }


@dataclass
class AutoscalingCluster(LocalCluster):
    """A head of 0 CPUs whose autoscaler adds and removes worker nodes of `node_types` (scaled_node_types())
    on demand; nodes idle for idle_timeout_minutes go away. Same addresses, env() and list_nodes() as
    LocalCluster (token auth on); `config` is the autoscaling config it runs with."""

    node_types: dict = field(default_factory=scaled_node_types)
    idle_timeout_minutes: float = 0.1
    publish: bool = True  # publish the node types to the GCS as the launcher's head does (raychat.capacity)
    config: dict = field(default_factory=dict)

    def start(self, timeout_s: float = 90) -> AutoscalingCluster:  # type: ignore[override]
        """Start the head (with its autoscaler) on fresh free ports; a start that hit Ray's startup timeout
        is cleaned up and started again (support.cluster.start_with_retry)."""
        self.token_file.write_text(self.token + "\n")
        config = self.root / "autoscaling.yaml"
        start_with_retry(
            lambda: self._start_head(config, timeout_s), lambda: self._clean_failed("head"), "ray head"
        )
        self.config = yaml.safe_load(config.read_text())
        if self.publish:
            self.publish_node_types(self.config)
        return self

    def _start_head(self, config: Path, timeout_s: float) -> None:
        ports = dict(zip(HEAD_PORTS + NODE_PORTS, free_ports(len(HEAD_PORTS + NODE_PORTS))))
        config.write_text(
            yaml.safe_dump(cluster_config(ports["port"], self.node_types, self.idle_timeout_minutes))
        )
        log = self.root / "head.log"
        log_start = log.stat().st_size if log.exists() else 0
        cmd = [
            str(RAY), "start", "--head", "--block", f"--temp-dir={self.root}",
            "--node-ip-address=127.0.0.1", "--include-dashboard=true", "--dashboard-host=127.0.0.1",
            "--num-cpus=0", "--num-gpus=0", f"--object-store-memory={OBJECT_STORE_BYTES}",
            f"--autoscaling-config={config}", "--disable-usage-stats",
            *[f"--{flag}={port}" for flag, port in ports.items()],
        ]  # fmt: skip
        with open(log, "a") as out:
            proc = subprocess.Popen(
                cmd, env={**self.env(), **AUTOSCALER_ENV}, stdout=out, stderr=subprocess.STDOUT,
                start_new_session=True,
            )  # fmt: skip
        self.nodes["head"] = Node("head", 0, {}, ports, proc, log, log_start=log_start)
        self._wait_dashboard(timeout_s)

    def publish_node_types(self, config: dict) -> None:
        """What ray_cluster.yaml's head does after `ray start`: `python -m raychat.capacity CONFIG` (the
        launcher's ~/ray_bootstrap_config.yaml), here with this cluster's config and GCS address."""
        path = self.root / "published.yaml"
        path.write_text(yaml.safe_dump(config))
        subprocess.run(
            [str(VENV_BIN / "python"), "-m", "raychat.capacity", str(path), self.gcs_address],
            env=self.env(), check=True, capture_output=True, text=True, timeout=60,
        )  # fmt: skip

    def worker_nodes(self) -> list[dict]:
        """The ALIVE worker nodes (state API dicts; resources_total, labels...)."""
        return [n for n in self.list_nodes() if n["state"] == "ALIVE" and not n["is_head_node"]]

    def wait_workers(self, predicate, timeout_s: float, poll_s: float = 1.0) -> list[dict]:
        """Poll worker_nodes() until predicate(nodes) is true; returns them. Raises TimeoutError with the last
        list seen."""
        deadline, nodes = time.monotonic() + timeout_s, []
        while time.monotonic() < deadline:
            try:
                nodes = self.worker_nodes()
            except OSError:
                nodes = []
            if predicate(nodes):
                return nodes
            time.sleep(poll_s)
        raise TimeoutError(f"worker nodes after {timeout_s} s: {json.dumps(nodes)[:2000]}\n{self.status()}")

    def status(self) -> str:
        """`ray status -v` of this cluster (the autoscaler's view: node types, activity, demands)."""
        done = subprocess.run(
            [str(RAY), "status", "-v", f"--address={self.gcs_address}"],
            env=self.env(), capture_output=True, text=True, timeout=60,
        )  # fmt: skip
        actors = subprocess.run(
            [str(RAY), "list", "actors", "--filter", "state=ALIVE", "--detail", f"--address={self.dashboard_url}"],
            env=self.env(), capture_output=True, text=True, timeout=60,
        )  # fmt: skip
        return done.stdout[-6000:] + done.stderr[-2000:] + actors.stdout[-6000:] + actors.stderr[-1000:]

    def stop(self) -> None:
        head = self.nodes.pop("head", None)
        if head is not None:
            _end_group(head.proc)
        _kill_leftovers(str(self.root))
        shutil.rmtree(self.root, ignore_errors=True)
