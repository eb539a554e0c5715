"""What the connected Ray cluster can become, not only what is alive: the node types its autoscaler may add.

The clusters raychat documents (ray_cluster.yaml, k8s/) start with a head of 0 CPUs and worker types of 0
nodes; checking a layout against the alive nodes would refuse every run before the autoscaler had a chance.
read_capacity() looks in three places, first found wins:

1. Ray's record of the cluster's node types in the GCS (`ray._private.state.state.get_cluster_config()`:
   autoscaler_pb2.ClusterConfig, node_group_configs with resources and min/max counts; the record Ray Data's
   autoscaler also reads). The launcher's head publishes it from its autoscaling config
   (`python -m raychat.capacity ~/ray_bootstrap_config.yaml`, ray_cluster.yaml's head_start_ray_commands;
   publish_node_types). -> source "node types": a layout no node type can hold is refused at once.
2. An autoscaler that runs without a published record (Ray's v1 monitor writes its status under the GCS
   key `__autoscaling_status`; the v2 autoscaler of KubeRay reports an autoscaling state): the node types
   are unknown -> source "autoscaler": every layout is accepted and its wait is bounded by
   --schedule-timeout-s instead. Not for a fixed cluster: every head started without --autoscaling-config
   (`ray start --head`, and `ray.init()` without an address) runs the v1 monitor too, with Ray's read-only
   provider, which never adds a node; its status names one node type per alive node, `node_<node id>`
   (read_only_monitor).
3. Neither: the alive nodes are all the cluster will ever be -> source "alive nodes" (checked at once).

A layout's bundles ({resource: amount} each, e.g. a Ray Train worker {"CPU": 7, "GPU": 1}) are checked with
check_bundles; what is missing after a timeout is named by missing_resources.
"""

from __future__ import annotations

import json
import math
import os
import sys
import threading
import time
from collections import Counter
from contextlib import contextmanager
from dataclasses import dataclass

import ray
import yaml
from ray._private.services import find_bootstrap_address
from ray._raylet import GcsClient
from ray.autoscaler._private.util import format_readonly_node_type
from ray.core.generated import autoscaler_pb2
from ray.experimental.internal_kv import _internal_kv_get

from raychat.log import plural
from raychat.ports import free_ports

AUTOSCALER_STATUS_KEY = "__autoscaling_status"  # ray._private.ray_constants.DEBUG_AUTOSCALING_STATUS
WAIT_REPORT_EVERY_S = 10.0  # how often a run that waits for nodes says so
SCHEDULED_RESOURCES = ("CPU", "GPU")  # what a layout asks for; memory and node:<ip> labels are not planned
# the GCS key (default namespace) of the launcher config's cap on worker nodes, which Ray's cluster config record
# has no field for: JSON {"max_workers": N, "head_node_type": NAME} (publish_node_types, read_capacity)
WORKER_CAP_KEY = "raychat_max_workers"


@dataclass(frozen=True)
class NodeType:
    """One kind of node the cluster has or can add: its name, its resources ({"CPU": 2.0, "GPU": 1.0}) and how
    many of it may exist at most (-1 = no limit; an alive node counts as a type of max_count 1)."""

    name: str
    resources: dict
    max_count: int

    def holds(self, bundle: dict) -> bool:
        """Whether one node of this type has room for `bundle` ({resource: amount})."""
        return all(self.resources.get(k, 0.0) + 1e-9 >= v for k, v in bundle.items() if v > 0)

    def fits(self, bundle: dict) -> float:
        """How many of `bundle` one node of this type holds at once: the least over the resources the bundle
        needs of floor(node's / bundle's), e.g. {CPU: 48, GPU: 8} holds 5 of {CPU: 9, GPU: 1}; math.inf for a
        bundle that needs nothing."""
        return min(
            (math.floor(self.resources.get(k, 0.0) / v + 1e-9) for k, v in bundle.items() if v > 0),
            default=math.inf,
        )

    def describe(self) -> str:
        res = ", ".join(f"{k}: {v:g}" for k, v in sorted(self.resources.items()) if k in SCHEDULED_RESOURCES)
        return f"{self.name} {{{res or 'no CPU'}}}"


@dataclass(frozen=True)
class Capacity:
    """What the cluster can become. source: "node types" (the published node types, the head's included), "autoscaler" (an autoscaler runs, its node types unknown; node_types are
    the alive nodes) or "alive nodes" (nothing scales). max_workers: the most nodes of every type but
    head_type there may be together (the launcher config's max_workers; -1 = no such cap)."""

    source: str
    node_types: tuple
    max_workers: int = -1
    head_type: str = ""

    @property
    def known(self) -> bool:
        """Whether node_types is everything the cluster can ever hold (False: an autoscaler may add more)."""
        return self.source != "autoscaler"

    def largest(self, bundle: dict | None = None) -> NodeType | None:
        """The node type with the most CPUs among those holding the non-CPU part of `bundle` (e.g. its GPU);
        None when there is none."""
        need = {k: v for k, v in (bundle or {}).items() if k != "CPU"}
        fit = [t for t in self.node_types if t.holds(need)]
        return max(fit, key=lambda t: (t.resources.get("CPU", 0.0), t.name), default=None)

    def total(self, resource: str) -> float:
        """The most of `resource` the cluster can hold at once (math.inf when a type has no node limit)."""
        return self._most(lambda t: t.resources.get(resource, 0.0))

    def fits(self, bundle: dict, per_node: float = math.inf) -> float:
        """The most of `bundle` the cluster's nodes can hold at once, at most `per_node` on each (NodeType.fits
        summed over the nodes; math.inf when a type that holds one has no node limit)."""
        return self._most(lambda t: min(t.fits(bundle), per_node))

    def _most(self, each) -> float:
        """The most of each(node type) summed over the nodes the cluster can have at once: every type up to its
        max_count, the worker types together up to max_workers, filled with the types of the most first."""
        out, room = 0.0, math.inf if self.max_workers < 0 else self.max_workers
        for t in sorted(self.node_types, key=each, reverse=True):
            n = math.inf if t.max_count < 0 else t.max_count
            if t.name != self.head_type and room < math.inf:
                n = min(n, room)
                room -= n
            if n and each(t):
                out += each(t) * n
        return out

    def _cap_binds(self) -> bool:
        counts = [t.max_count for t in self.node_types if t.name != self.head_type]
        return self.max_workers >= 0 and (any(c < 0 for c in counts) or sum(counts) > self.max_workers)

    def describe(self) -> str:
        types = ", ".join(
            f"{t.describe()} x {'any' if t.max_count < 0 else t.max_count}" for t in self.node_types
        )
        if self.source == "autoscaler":
            return f"an autoscaling cluster (node types not published; alive: {types or 'none'})"
        cap = f"; at most {plural(self.max_workers, 'worker node')} in all" if self._cap_binds() else ""
        return f"{self.source}: {types or 'none'}{cap}"


def _worker_cap() -> dict:
    """The published cap on worker nodes ({"max_workers": N, "head_node_type": NAME}; WORKER_CAP_KEY), {} when
    none was published."""
    cap = _internal_kv_get(WORKER_CAP_KEY)
    return json.loads(cap) if cap else {}


def _published_node_types() -> list[NodeType]:
    config = ray._private.state.state.get_cluster_config()
    if config is None:
        return []
    return [
        NodeType(g.name, {k: float(v) for k, v in g.resources.items()}, g.max_count)
        for g in config.node_group_configs
        if g.max_count != 0
    ]


def _alive_nodes() -> list[NodeType]:
    return [
        NodeType(
            f"alive node {n['NodeManagerAddress']}" + (" (head)" if "node:__internal_head__" in n["Resources"]
                                                         else ""),
            {k: v for k, v in n["Resources"].items() if k in SCHEDULED_RESOURCES},
            1,
        )
        for n in ray.nodes()
        if n["Alive"]
    ]  # fmt: skip


def autoscaler_running() -> bool:
    """Whether an autoscaler that may add nodes serves this cluster: Ray's v1 monitor has written its status to
    the GCS and it is not the read-only mirror of a fixed cluster (read_only_monitor), or a v2 autoscaler
    (KubeRay's) has reported an autoscaling state."""
    status = monitor_status()
    if status is not None:
        return not read_only_monitor(status)
    reply = autoscaler_pb2.GetClusterStatusReply()
    try:
        reply.ParseFromString(GcsClient(ray.get_runtime_context().gcs_address).get_cluster_status())
    except Exception:  # an older GCS without the v2 service: no v2 autoscaler
        return False
    return reply.autoscaling_state.autoscaler_state_version > 0


def monitor_status() -> dict | None:
    """The status Ray's v1 monitor last wrote to the GCS (AUTOSCALER_STATUS_KEY; what `ray status` prints), or
    None before its first one, or without a v1 monitor."""
    status = _internal_kv_get(AUTOSCALER_STATUS_KEY)
    return json.loads(status) if status else None


def read_only_monitor(status: dict) -> bool:
    """Whether a v1 autoscaler status (the JSON under AUTOSCALER_STATUS_KEY, what `ray status` prints) comes
    from Ray's read-only provider: its report maps every node (node id, its "ip" there) to a type of its own
    named by ray.autoscaler._private.util.format_readonly_node_type. False while the status has no report yet
    (the monitor's first seconds): the caller cannot tell then."""
    mapping = (status.get("autoscaler_report") or {}).get("node_type_mapping") or {}
    return bool(mapping) and all(t == format_readonly_node_type(node) for node, t in mapping.items())


def started_here() -> bool:
    """Whether this process started the Ray cluster it is connected to (ray.init() without an address: a
    head on this machine that nothing else joins)."""
    node = ray._private.worker._global_node
    return node is not None and node.head


def read_capacity() -> Capacity:
    """The Capacity of the cluster this process is connected to (ray.init done); see the module doc."""
    alive = _alive_nodes()
    published = _published_node_types()
    if published:
        cap = _worker_cap()
        return Capacity(
            "node types", tuple(published), cap.get("max_workers", -1), cap.get("head_node_type", "")
        )
    if autoscaler_running() and not started_here():
        return Capacity("autoscaler", tuple(alive))
    return Capacity("alive nodes", tuple(alive))


def free_capacity() -> Capacity:
    """What the alive nodes have free now (Ray's available resources per node; a snapshot that grows stale as
    work starts and ends): which part of a request that waits has no room yet."""
    nodes = ray._private.state.available_resources_per_node()
    return Capacity(
        "free now",
        tuple(
            NodeType(f"node {node_id[:8]}", {k: v for k, v in res.items() if k in SCHEDULED_RESOURCES}, 1)
            for node_id, res in nodes.items()
        ),
    )


class ClusterStartError(OSError):
    """The local Ray cluster a command starts did not come up (start_local_cluster); the message is one line."""


# Ray 2.60's raylet must register with the GCS in time; on an overloaded machine it does not. Each lookup of
# the new node (ray/_private/node.py) waits RAY_raylet_start_wait_time_s, 30 s by default: raising it waits longer.
STARTUP_TIMEOUT = "timed out during startup"


def start_local_cluster(address: str | None = "local", **init_kwargs) -> None:
    """ray.init(address=address, **init_kwargs) for a Ray cluster of this machine: "local" (the default) starts
    one for this process, whose processes all know its address (own_address); None (with no RAY_ADDRESS) joins
    the cluster `ray start` runs on this machine (Ray's ray_current_cluster file under its temp dir) when there
    is one, else starts one too.

    Raises:
        ClusterStartError: Ray did not start (its node timed out during startup, a temp dir it cannot create,
            ...): one line, start_failure's; the original is its __cause__ (RAYCHAT_DEBUG=1 shows it).
    """
    try:
        if address == "local":
            with own_address():
                ray.init(address=address, **init_kwargs)
        else:
            ray.init(address=address, **init_kwargs)
    except Exception as e:
        # what Ray's start-up raises: a bare Exception (STARTUP_TIMEOUT), OSError (ConnectionError), RuntimeError
        if type(e) is not Exception and not isinstance(e, (OSError, RuntimeError)):
            raise
        raise ClusterStartError(start_failure(e)) from e


# Ray 2.60 reads the GCS port of a head it starts from this variable (ray/_private/node.py; 0 or unset: any port)
GCS_PORT_ENV = "RAY_GCS_SERVER_PORT"
# what Ray's state API (ray.util.state with no address) reads before RAY_ADDRESS (ray.dashboard.utils
# get_address_for_submission_client): a dashboard URL, such as one a user sets for `raychat submit`
API_SERVER_ENV = "RAY_API_SERVER_ADDRESS"


@contextmanager
def own_address():
    """Within: RAY_ADDRESS=127.0.0.1:<port> and RAY_GCS_SERVER_PORT=<port> in this process's environment (the
    user's RAY_GCS_SERVER_PORT if set, else a free one below the ephemeral range: raychat.ports.free_ports) and
    no RAY_API_SERVER_ADDRESS, all three as they were again on the way out. A local ray.init(address="local") within binds its GCS to that port, and every
    process of that cluster (the raylet, and from it each worker and actor) inherits that environment for its
    life. Ray code that looks the address up instead of using its connection then finds this cluster even with
    others on the machine; Ray Train's PlacementGroupCleaner actor (ray.util.state.get_actor(address=None))
    otherwise died on "Found multiple active Ray instances" and left the run's placement group unwatched. The
    state API reads RAY_API_SERVER_ADDRESS first: a user's (another cluster's dashboard, set for `raychat
    submit`) sent the cleaner's lookups of the run's controller to that cluster, where it is not (no such
    actor: "dead", so the running run's placement group removed; or an error, so never removed). Ray resolves
    127.0.0.1 to the node's IP. This process keeps no RAY_ADDRESS: its next run, after ray.shutdown, starts a
    cluster again."""
    port = int(os.environ.get(GCS_PORT_ENV) or 0) or free_ports(1)[0]
    saved = {name: os.environ.get(name) for name in ("RAY_ADDRESS", GCS_PORT_ENV, API_SERVER_ENV)}
    os.environ.pop(API_SERVER_ENV, None)
    os.environ.update(RAY_ADDRESS=f"127.0.0.1:{port}", **{GCS_PORT_ENV: str(port)})
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def local_cluster_running() -> bool:
    """Whether start_local_cluster(address=None) would join the cluster `ray start` runs on this machine (Ray's
    ray_current_cluster file under its temp dir: $RAY_TMPDIR, else $TMPDIR, else /tmp, then ray/) rather than
    start one; read before Ray starts, with no connection made."""
    return find_bootstrap_address(None) is not None


def start_failure(error: BaseException) -> str:
    """The one line for a failed local Ray start: Ray's first line, and a hint (for STARTUP_TIMEOUT: the
    machine is likely overloaded; else where Ray's logs are)."""
    first = next((ln.strip() for ln in str(error).splitlines() if ln.strip()), type(error).__name__)
    if STARTUP_TIMEOUT in str(error):
        hint = (
            "this machine is likely overloaded: Ray gives its raylet RAY_raylet_start_wait_time_s (default "
            "30) seconds to register; set it higher (e.g. RAY_raylet_start_wait_time_s=120), retry when the "
            "load is lower, or start a cluster with `ray start --head` and run with RAY_ADDRESS=auto"
        )
    else:
        hint = "see Ray's logs under its temp dir, /tmp/ray by default"
    return f"the local Ray cluster did not start: {first} ({hint})"


def local_capacity(cpus: float) -> Capacity:
    """The local Ray cluster a command starts on this machine: one node of `cpus` CPUs, never more (known
    before Ray starts, so a layout can be checked against it first)."""
    return Capacity("a local Ray cluster", (NodeType("this machine", {"CPU": float(cpus)}, 1),))


def check_bundles(bundles: list[dict], capacity: Capacity, flags: str) -> None:
    """Refuse a request no node type can ever hold: one bundle no type has room for, more of a resource than
    the whole cluster can hold, or more copies of one bundle than its nodes have room for one by one
    (Capacity.fits: 42 x {CPU: 9, GPU: 1} on 8 nodes of {CPU: 48, GPU: 8} hold at most 5 each, 40 in all).
    Accepts everything on a cluster whose node types are unknown.

    Raises:
        ValueError: one line naming `flags` (the flags that size the bundles), the need and the largest node
            type, or the most the cluster can hold.
    """
    if not capacity.known:
        return
    for bundle in bundles:
        if not any(t.holds(bundle) for t in capacity.node_types):
            raise ValueError(f"{flags}: one of them needs {fmt_bundle(bundle)}; {_no_room(bundle, capacity)}")
    for resource in SCHEDULED_RESOURCES:
        need = sum(b.get(resource, 0.0) for b in bundles)
        have = capacity.total(resource)
        if need > have + 1e-9:
            raise ValueError(
                f"{flags}: together they need {need:g} {resource}; the cluster can hold at most {have:g} "
                f"({capacity.describe()})"
            )
    alike = Counter(fmt_bundle(b) for b in bundles)
    for bundle in {fmt_bundle(b): b for b in bundles}.values():
        need, most = alike[fmt_bundle(bundle)], capacity.fits(bundle)
        if need > most:
            raise ValueError(
                f"{flags}: {need} of them need {fmt_bundle(bundle)} each; the cluster's nodes can hold at most "
                f"{most:g} of those ({capacity.describe()})"
            )


def missing_resources(bundle: dict, capacity: Capacity) -> str:
    """The resources of `bundle` no node has enough of, named with the most any has: e.g. "GPU (need 1, the
    most a node has is 0)"; "" when some node could hold it."""
    if any(t.holds(bundle) for t in capacity.node_types):
        return ""
    parts = []
    for k, v in sorted(bundle.items()):
        most = max((t.resources.get(k, 0.0) for t in capacity.node_types), default=0.0)
        if v > most + 1e-9:
            parts.append(f"{k} (need {v:g}, the most a node has is {most:g})")
    return ", ".join(parts) or fmt_bundle(bundle)


def _no_room(bundle: dict, capacity: Capacity) -> str:
    largest = capacity.largest(bundle) or capacity.largest()
    what = missing_resources(bundle, capacity)
    return f"no node type has room: {what}; largest node type: {largest.describe() if largest else 'none'}"


def fmt_bundle(bundle: dict) -> str:
    """A bundle (or any {resource: amount}) as messages show it: "{CPU: 1, GPU: 0.5}"."""
    return "{" + ", ".join(f"{k}: {v:g}" for k, v in sorted(bundle.items())) + "}"


class WaitReporter:
    """Says, every `every_s` while `state()` is "pending", what a run waits for and for how long, e.g.
    "waiting 20 s for 2 workers x CPU 0.5: 1 alive node; the autoscaler may add more"; when the state
    turns "placed" after a wait, how long it waited, and ends. state() returns "pending", "placed" or "none"
    (nothing requested yet, or the request gone). Runs in a daemon thread between start() and stop();
    stop(placed=True) says the "placed" line itself when the caller saw the placement first."""

    def __init__(self, what: str, state, every_s: float = WAIT_REPORT_EVERY_S, out=None):
        self.what, self.state, self.every_s, self.out = what, state, every_s, out or sys.stdout
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name="raychat-wait-reporter")
        self.t0 = time.monotonic()
        self._said: float | None = None  # when the last "waiting" line was printed
        self._placed_said = False

    def start(self) -> WaitReporter:
        self._thread.start()
        return self

    def stop(self, placed: bool = False) -> None:
        self._done.set()
        self._thread.join(5)
        if placed and self._said is not None and not self._placed_said:
            self._say(f"placed {self.what} after {time.monotonic() - self.t0:.0f} s")

    def _say(self, line: str) -> None:
        print(line, file=self.out, flush=True)

    def _run(self) -> None:
        while not self._done.wait(1.0):
            try:
                state = self.state()
            except Exception:  # the cluster's state API did not answer this time: ask again
                continue
            now = time.monotonic()
            if state == "placed" and self._said is not None:
                self._say(f"placed {self.what} after {now - self.t0:.0f} s")
                self._placed_said = True
                return
            if state == "pending" and (self._said is None or now - self._said >= self.every_s):
                alive = sum(1 for n in ray.nodes() if n["Alive"])
                self._say(
                    f"waiting {now - self.t0:.0f} s for {self.what}: {plural(alive, 'alive node')}; the autoscaler "
                    "may add more"
                )
                self._said = now


def placement_state() -> str:
    """ "pending" when the cluster has a placement group not placed yet, else "placed" when one is placed,
    else "none" (Ray's placement group table, which names no job: Ray Train's controller creates a run's
    group from an actor of its own, so a driver running one training at a time reads the whole table)."""
    states = {pg.get("state") for pg in ray.util.placement_group_table().values()}
    if states & {"PENDING", "RESCHEDULING"}:
        return "pending"
    return "placed" if "CREATED" in states else "none"


def publish_node_types(config: dict, gcs_address: str) -> autoscaler_pb2.ClusterConfig:
    """Publish the node types of a Ray autoscaling config (the cluster launcher's YAML:
    available_node_types with resources and min_workers / max_workers; cluster max_workers caps worker
    nodes) as Ray's cluster config record in the GCS, the record read_capacity reads, and the cap on all
    worker nodes together, which that record has no field for, under WORKER_CAP_KEY. Returns the record.

    Raises KeyError naming the missing key when the config has no available_node_types."""
    msg = autoscaler_pb2.ClusterConfig()
    cap = config.get("max_workers")
    head = config.get("head_node_type")
    for name, t in config["available_node_types"].items():
        g = msg.node_group_configs.add()
        g.name = name
        for k, v in t.get("resources", {}).items():
            if k not in ("memory", "object_store_memory"):
                g.resources[k] = int(math.ceil(v))
        g.min_count = 1 if name == head else int(t.get("min_workers", 0))
        most = 1 if name == head else int(t.get("max_workers", cap if cap is not None else -1))
        g.max_count = min(most, cap) if (cap is not None and name != head and most >= 0) else most
    gcs = GcsClient(gcs_address)
    gcs.report_cluster_config(msg.SerializeToString())
    cap_record = {"max_workers": -1 if cap is None else int(cap), "head_node_type": head or ""}
    gcs.internal_kv_put(
        WORKER_CAP_KEY.encode(), json.dumps(cap_record).encode(), overwrite=True, namespace=None
    )
    return msg


def main(argv: list[str] | None = None) -> int:
    """`python -m raychat.capacity CONFIG.yaml [GCS_ADDRESS]`: publish_node_types of CONFIG (run on the head
    after `ray start`; the GCS address defaults to 127.0.0.1:6379)."""
    argv = sys.argv[1:] if argv is None else argv
    if not 1 <= len(argv) <= 2:
        print("usage: python -m raychat.capacity CONFIG.yaml [GCS_ADDRESS]", file=sys.stderr)
        return 2
    with open(argv[0]) as f:
        msg = publish_node_types(yaml.safe_load(f), argv[1] if len(argv) > 1 else "127.0.0.1:6379")
    print(f"published {plural(len(msg.node_group_configs), 'node type')} to the GCS")
    return 0


if __name__ == "__main__":
    sys.exit(main())
