"""A real multi-node Ray cluster on one machine, for the Ray-tier tests: `ray start --head` plus worker nodes
from `ray start --address`, each its own raylet with its own CPUs and a custom resource.

Every node runs `ray start --block` in a process group of its own, on free loopback ports (worker ports
chosen by the OS), with token authentication on and a small object store (100 MB: Ray's minimum is 75 MB;
the default, 30% of RAM per node, is not needed for tests). `stop()` ends each group (SIGTERM, then SIGKILL)
and then kills any process left whose command line names the cluster's temp dir, so nothing outlives the
cluster, also when a test failed. A node is lost the way a machine is lost: `kill_raylet(name)`. A node start
that hits Ray's startup timeout is cleaned up and tried again (start_with_retry), and every node gets a longer
start-up wait than Ray's 30 s (RAY_STARTUP_WAIT).

The temp dir is short on purpose: Ray puts AF_UNIX sockets under <temp>/session_<date>_<pid>/sockets/ and a
socket path may hold at most 107 bytes on Linux.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeVar

import ray

from raychat.ports import free_ports

T = TypeVar("T")
VENV_BIN = Path(sys.executable).parent
RAY = VENV_BIN / "ray"
# The fixture cluster: a head with no CPUs (like the KubeRay head) and two workers with 2 logical CPUs each
# and a custom resource each, so a task or a Ray Train worker shows which node it ran on. 2 (`ray start
# --num-cpus` takes whole CPUs): a train rank of up to 1 CPU leaves a whole CPU on its node for Ray Data's
# 1-CPU ListFiles task (raychat.train.layout); without it the chain's pretraining waited forever.
CLUSTER_WORKERS = {"a": (2, {"node_a": 1}), "b": (2, {"node_b": 1})}
# Budget of the temp dir's length: Ray appends ~70 bytes (session_2026-12-01_08-01-16_123456_12345/sockets/
# plasma_store.1) to it, and sun_path holds 107; a worker node's dir, <temp dir>/<name>, adds 2 and drops ".1".
MAX_TEMP_DIR_LEN = 36
OBJECT_STORE_BYTES = 100 * 1024 * 1024
# What a Ray node start (`ray start`, a local `ray.init()`) raises when its raylet did not register with the
# GCS in time (ray/_private/node.py); a loaded 2-core machine makes it happen now and then.
STARTUP_TIMEOUT = "The current node timed out during startup"
# That time: each lookup of the new node waits RAY_raylet_start_wait_time_s (Ray's default 30 s; the knob its
# own "GCS cannot find the node" message names). Measured: with a worker's raylet stopped for 45 s, `ray
# start` exits at 30 s by default and comes up at 48 s with 60. Set for every Ray process the tests start.
RAY_STARTUP_WAIT = {"RAY_raylet_start_wait_time_s": "60"}
# Ray's log monitor (one a node, log_monitor.py) globs the node's log directory for new files in each 0.1 s loop
# while it knows fewer than RAY_LOG_MONITOR_MANY_FILES_THRESHOLD (1000) files, else every 0.5 s; at 0 it looks
# every 0.5 s (a new worker's lines reach the driver within 0.5 s, then as they come). Measured (2026-12-07, a
# local Ray with 20 idle actors): 0.81 -> 0.46 CPU-s a minute per node; the suite's 41 log monitors took 122
# CPU-s (bench/results/suite_cpu.md). Set for every Ray process the tests start, as RAY_STARTUP_WAIT.
RAY_LOG_MONITOR = {"RAY_LOG_MONITOR_MANY_FILES_THRESHOLD": "0"}
# A node start that still hit STARTUP_TIMEOUT is tried again: at most this many attempts in all.
START_ATTEMPTS = 3
# Ray system config through the environment (RAY_<name>), read by every Ray process of the nodes:
NODE_RAY_CONFIG = {
    **RAY_STARTUP_WAIT,
    # report metrics every second instead of every 10 s, so a scrape sees a value within seconds
    "RAY_metrics_report_interval_ms": "1000",
    # a lost node is DEAD after 5 missed 1 s health checks instead of 5 x 3 s
    "RAY_health_check_period_ms": "1000",
    "RAY_health_check_failure_threshold": "5",
}
HEAD_PORTS = ("port", "dashboard-port", "ray-client-server-port")
NODE_PORTS = (
    "node-manager-port",
    "object-manager-port",
    "metrics-export-port",
    "dashboard-agent-listen-port",
    "dashboard-agent-grpc-port",
    "runtime-env-agent-port",
)


class NodeStartError(RuntimeError):
    """A node did not come up: `ray start` exited or the node was not ALIVE in time (its log follows)."""


def start_with_retry(
    start: Callable[[], T], clean: Callable[[], None], what: str, attempts: int = START_ATTEMPTS
) -> T:
    """start() once more, after clean(), each time it raised an error whose message holds Ray's STARTUP_TIMEOUT
    (a RuntimeError from `ray start`'s helpers, a bare Exception from a local ray.init()), at most `attempts` calls in all; prints one line on stderr per retry. Returns start()'s
    result. Raises the error of the last attempt, and at once any other error (clean() is not called then:
    the caller's stop() ends what is left)."""
    for attempt in range(1, attempts + 1):
        try:
            return start()
        except Exception as e:  # noqa: BLE001 - ray.init raises a bare Exception; the message decides
            if STARTUP_TIMEOUT not in str(e) or attempt == attempts:
                raise
            clean()
            print(
                f"{what}: Ray's node start-up timed out (attempt {attempt} of {attempts}); starting it again",
                file=sys.stderr,
                flush=True,
            )
    raise ValueError(f"attempts must be >= 1, got {attempts}")


def init_local_ray(**kwargs) -> None:
    """ray.init(**kwargs) of a new local instance, started again (ray.shutdown first) when its node start-up
    timed out (start_with_retry), as the tests' `ray start` nodes are."""
    start_with_retry(lambda: ray.init(**kwargs), ray.shutdown, "local ray.init")


def short_temp_dir(prefix: str) -> Path:
    """A new directory under $RAY_TMPDIR (else the system temp dir), or under /tmp when that path is too long
    for Ray's sockets."""
    base = os.environ.get("RAY_TMPDIR") or tempfile.gettempdir()
    if len(base) + len(prefix) + 10 > MAX_TEMP_DIR_LEN:
        base = "/tmp"
    os.makedirs(base, exist_ok=True)
    return Path(tempfile.mkdtemp(prefix=prefix, dir=base))


@dataclass
class Node:
    """One `ray start --block` process (a Ray node) and what it was started with."""

    name: str
    num_cpus: float
    resources: dict[str, float]
    ports: dict[str, int]
    proc: subprocess.Popen
    log: Path
    node_id: str = ""
    log_start: int = 0  # where this start's output begins in `log` (an earlier attempt's stays above it)

    @property
    def metrics_port(self) -> int:
        return self.ports["metrics-export-port"]

    def raylet_pid(self) -> int:
        """The pid of this node's raylet (a child of its `ray start --block`)."""
        for pid in _children(self.proc.pid):
            if Path(next(iter(_cmdline(pid)), "")).name == "raylet":
                return pid
        raise RuntimeError(f"node {self.name}: no raylet among the children of pid {self.proc.pid}")


@dataclass
class LocalCluster:
    """A head (no CPUs by default, like a KubeRay head: work lands on the workers) plus worker nodes.

    path_prefix: directories put first on the nodes' PATH (default: this venv's bin, as a `source
    .venv/bin/activate` would); pass [] to start the nodes with the caller's PATH without the venv (the
    situation of a `.venv/bin/ray start` run from a plain shell), or another list to choose what `python`
    the nodes' shells find. extra_env: more variables for every node (e.g. cloud credentials, which a real
    node gets from its instance role).
    """

    root: Path
    head_cpus: float = 0
    path_prefix: list[str] | None = None
    extra_env: dict[str, str] = field(default_factory=dict)
    token: str = field(default_factory=lambda: secrets.token_hex(16))
    nodes: dict[str, Node] = field(default_factory=dict)

    # ------------------------------------------------------------------------------------------ addresses
    @property
    def head(self) -> Node:
        return self.nodes["head"]

    @property
    def gcs_address(self) -> str:
        return f"127.0.0.1:{self.head.ports['port']}"

    @property
    def dashboard_url(self) -> str:
        return f"http://127.0.0.1:{self.head.ports['dashboard-port']}"

    @property
    def token_file(self) -> Path:
        return self.root / "token"

    def env(self) -> dict[str, str]:
        """The environment the nodes run with (and a driver or CLI needs: the auth mode and token)."""
        env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "RAY_API_SERVER_ADDRESS")}
        prefix = [str(VENV_BIN)] if self.path_prefix is None else list(self.path_prefix)
        env["PATH"] = os.pathsep.join([*prefix, env.get("PATH", "")])
        env.update(
            self.extra_env,
            **NODE_RAY_CONFIG,
            RAY_AUTH_MODE="token",
            RAY_AUTH_TOKEN=self.token,
            RAY_TMPDIR=str(self.root),
            RAY_USAGE_STATS_ENABLED="0",
        )
        return env

    # ------------------------------------------------------------------------------------------ lifecycle
    def start(
        self, workers: dict[str, tuple[float, dict[str, float]]], timeout_s: float = 90
    ) -> LocalCluster:
        """Start the head, then each worker {name: (num_cpus, custom resources)}; wait until all are ALIVE."""
        self.token_file.write_text(self.token + "\n")
        head_flags = [
            "--head",
            f"--temp-dir={self.root}",
            "--include-dashboard=true",
            "--dashboard-host=127.0.0.1",
        ]
        self._start_node("head", self.head_cpus, {}, HEAD_PORTS + NODE_PORTS, head_flags, timeout_s)
        for name, (cpus, resources) in workers.items():
            self.add_worker(name, cpus, resources, timeout_s)
        return self

    def add_worker(
        self, name: str, num_cpus: float, resources: dict[str, float], timeout_s: float = 90
    ) -> Node:
        """Start a worker node `name` (replacing a dead one of that name); returns it once ALIVE."""
        if not resources:
            raise ValueError(
                f"worker {name}: give it a custom resource of its own, e.g. {{'node_{name}': 1}}"
            )
        old = self.nodes.pop(name, None)
        if old is not None:
            _end_group(old.proc)
        # a temp dir of its own: nodes sharing one read each other's worker logs, and a job's logs showed every
        # line a worker printed once per node (docs/deployment.md section 1)
        flags = [f"--address={self.gcs_address}", f"--temp-dir={self.root / name}"]
        not_id = old.node_id if old else ""
        return self._start_node(name, num_cpus, resources, NODE_PORTS, flags, timeout_s, not_id)

    def kill_raylet(self, name: str) -> str:
        """SIGKILL the raylet of worker node `name` (a lost machine, as far as the cluster can tell); returns
        that node's id. The node's other processes end with it (its `ray start --block` notices)."""
        node = self.nodes[name]
        os.kill(node.raylet_pid(), signal.SIGKILL)
        return node.node_id

    def stop(self) -> None:
        """End every node (workers first), then any process still naming the temp dir; remove the dir."""
        for name in [n for n in self.nodes if n != "head"] + ["head"] * ("head" in self.nodes):
            _end_group(self.nodes.pop(name).proc)
        _kill_leftovers(str(self.root))
        shutil.rmtree(self.root, ignore_errors=True)

    # ------------------------------------------------------------------------------------------ helpers
    def _start_node(self, name, num_cpus, resources, port_names, flags, timeout_s, not_id="") -> Node:
        """Launch a node on fresh free ports and wait until it is ALIVE; a start that hit Ray's startup timeout
        is cleaned up and started again (start_with_retry)."""

        def attempt() -> Node:
            ports = dict(zip(port_names, free_ports(len(port_names))))
            node = self._launch(name, num_cpus, resources, ports, flags)
            if name == "head":
                self._wait_dashboard(timeout_s)
            node.node_id = self._wait_alive(node, timeout_s, not_id)
            return node

        return start_with_retry(attempt, lambda: self._clean_failed(name), f"ray node {name}")

    def _clean_failed(self, name: str) -> None:
        """End node `name`'s process group (every process of a node that did not come up); for the head, with
        nothing else running yet, also any process naming the temp dir and Ray's session dirs in it."""
        _end_group(self.nodes.pop(name).proc)
        if name == "head":
            _kill_leftovers(str(self.root))
            remove_sessions(self.root)

    def _launch(self, name, num_cpus, resources, ports, flags) -> Node:
        log = self.root / f"{name}.log"
        log_start = log.stat().st_size if log.exists() else 0
        cmd = [
            str(RAY), "start", "--block", *flags,
            f"--num-cpus={num_cpus}", "--num-gpus=0",
            f"--resources={json.dumps(resources)}",
            f"--object-store-memory={OBJECT_STORE_BYTES}",
            "--min-worker-port=0", "--max-worker-port=0",  # the OS picks: nodes on one machine never clash
            "--disable-usage-stats",
            *[f"--{flag}={port}" for flag, port in ports.items()],
        ]  # fmt: skip
        with open(log, "a") as out:  # "a": a failed first attempt stays in the log
            proc = subprocess.Popen(
                cmd, env=self.env(), stdout=out, stderr=subprocess.STDOUT, start_new_session=True
            )
        node = Node(name, num_cpus, dict(resources), dict(ports), proc, log, log_start=log_start)
        self.nodes[name] = node
        return node

    def _fail(self, node: Node, why: str):
        output = node.log.read_bytes()[node.log_start :].decode(errors="replace")
        raise NodeStartError(f"ray node {node.name}: {why}\n{output[-3000:]}")

    def _wait_dashboard(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                urllib.request.urlopen(self.dashboard_url + "/api/version", timeout=2)
                self._fail(self.head, "the dashboard answered without a token: token auth is not on")
            except urllib.error.HTTPError as e:
                if e.code == 401:
                    return
                self._fail(self.head, f"the dashboard answered {e.code}")
            except OSError:
                if self.head.proc.poll() is not None:
                    self._fail(self.head, "ray start exited")
                if time.monotonic() > deadline:
                    self._fail(self.head, f"no dashboard within {timeout_s} s")
                time.sleep(0.5)

    def list_nodes(self) -> list[dict]:
        """Ray's state API (GET /api/v0/nodes): one dict per node ever seen (node_id, state, resources_total,
        ...)."""
        req = urllib.request.Request(
            self.dashboard_url + "/api/v0/nodes?limit=1000&detail=1",
            headers={"Authorization": f"Bearer {self.token}"},
        )
        with urllib.request.urlopen(req, timeout=10) as r:
            return json.load(r)["data"]["result"]["result"]

    def serve_applications(self) -> dict[str, dict]:
        """Serve's REST API (GET /api/serve/applications/, what `serve status` reads): {app name: its details
        (status, deployments: {name: {replicas: [{state, node_id, ...}]}})}; {} while Serve is not running.
        Asked in this process, so polling it costs no CPU-heavy CLI start each time."""
        req = urllib.request.Request(
            self.dashboard_url + "/api/serve/applications/",
            headers={"Authorization": f"Bearer {self.token}"},
        )
        with urllib.request.urlopen(req, timeout=30) as r:
            return json.load(r).get("applications") or {}

    def _wait_alive(self, node: Node, timeout_s: float, not_id: str = "") -> str:
        """The node id of `node` once the GCS lists it ALIVE: the head node, or the node holding the worker's
        custom resources (so each worker needs a resource of its own), other than `not_id`."""
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                nodes = self.list_nodes()
            except OSError:  # the dashboard of a loaded machine drops a request now and then: ask again
                nodes = []
            for n in nodes:
                if n["state"] != "ALIVE" or n["node_id"] == not_id:
                    continue
                if (
                    n["is_head_node"]
                    if node.name == "head"
                    else node.resources.items() <= n["resources_total"].items()
                ):
                    return n["node_id"]
            if node.proc.poll() is not None:
                self._fail(node, f"ray start exited with {node.proc.returncode}")
            if time.monotonic() > deadline:
                self._fail(node, f"not ALIVE within {timeout_s} s")
            time.sleep(0.5)


# ---------------------------------------------------------------------------------------- processes (Linux)
def _cmdline(pid: int) -> list[str]:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0")[:-1]
    except OSError:
        return []


def _children(pid: int) -> list[int]:
    out = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            out += [int(c) for c in (task / "children").read_text().split()]
        except OSError:
            pass
    return out


def _end_group(proc: subprocess.Popen, grace_s: float = 5.0) -> None:
    """SIGTERM the process group of a `ray start --block`, SIGKILL it after grace_s, reap it."""
    for sig, wait_s in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 10.0)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            break
        try:
            proc.wait(wait_s)
            break
        except subprocess.TimeoutExpired:
            continue
    try:
        os.killpg(proc.pid, signal.SIGKILL)  # what is left of the group once its leader is gone
    except ProcessLookupError:
        pass
    if proc.poll() is None:
        proc.wait(10)


def remove_sessions(root: Path) -> None:
    """Remove Ray's session directories (and its session_latest link) under the temp dir `root`."""
    for path in root.glob("session_*"):
        if path.is_symlink():
            path.unlink()
        else:
            shutil.rmtree(path, ignore_errors=True)


def _kill_leftovers(marker: str) -> None:
    """SIGKILL every process whose command line contains `marker` (this cluster's temp dir): Ray starts
    workers in process groups of their own, so ending the nodes' groups does not reach a busy one."""
    me = os.getpid()
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and int(entry.name) != me and marker in " ".join(_cmdline(int(entry.name))):
            try:
                os.kill(int(entry.name), signal.SIGKILL)
            except ProcessLookupError:
                pass
