"""`raychat serve --checkpoint DIR`: run the chat app (raychat.serve.app) on a local Ray cluster (or the
one at --address / RAY_ADDRESS) and print what it serves (the --checkpoint reference, the checkpoint it
resolved to with its stage and step, the model id: --model-id, else the reference as given) and the chat
page's URL. Blocks until Ctrl-C unless --no-block.

A --host beyond loopback (0.0.0.0, a LAN address, a host name) needs an API key (--api-key or
RAYCHAT_API_KEY) or an explicit --allow-unauthenticated; the refusal comes before Ray starts, and so do the
refusals of a checkpoint no replica could load (check_checkpoint) and of a --port something listens on
(check_port_free; once connected where a `ray start` cluster of this machine is joined). Where it serves
without a key (a loopback --host, or --allow-unauthenticated), the app is built with allow_unauthenticated:
build_app refuses an app without a key otherwise. A cluster with
token authentication gets the token of --token-file (else $RAY_AUTH_TOKEN, $RAY_AUTH_TOKEN_PATH,
~/.ray/auth_token), as `raychat submit` does.
"""

from __future__ import annotations

import argparse
import errno
import ipaddress
import logging
import os
import signal
import socket
import time
from collections import Counter

import ray
from ray import serve

from raychat.capacity import (
    Capacity,
    check_bundles,
    fmt_bundle,
    local_cluster_running,
    read_capacity,
    start_local_cluster,
    started_here,
)
from raychat.checkpoint import check_model
from raychat.checkpoint_manager import described, find_checkpoint
from raychat.config import ConfigError, ServeConfig, from_args, from_dict
from raychat.config.schema import shown
from raychat.log import plural
from raychat.ray_token import check_gcs_address, token_for
from raychat.serve import vllm
from raychat.serve.app import build_app, serve_config
from raychat.serve.deployments import SERVER_DEPLOYMENT
from raychat.serve.server import default_model_id
from raychat.sigterm import Terminated, init_keeping_handler, raise_terminated

APP_NAME = "raychat"
SERVE_LOGGER = "ray.serve"  # Ray Serve's own logger (ray.serve._private.constants.SERVE_LOGGER_NAME)
VLLM_MODEL_ID = "raychat"  # --backend vllm without --model-id, as VLLMConfig's default (serve/vllm.yaml)


def start(
    config: ServeConfig,
    host: str = "127.0.0.1",
    port: int = 8000,
    address: str | None = None,
    proxy_location: str = "EveryNode",
) -> str:
    """Start Ray (if needed) and Serve, deploy the app of `config` (which needs an api_key or
    allow_unauthenticated: build_app refuses one with neither); returns the page URL.

    host, port, proxy_location: Serve's HTTP proxies, set when Serve starts on the cluster. Serve is one per
    cluster: when it already runs there, its proxies stay as they are and the app is added to them.
    Raises: ValueError / FileNotFoundError from check_checkpoint or build_app, before Ray starts, for bad args
        or a checkpoint no replica could load; ValueError when Serve already runs on the cluster with its
        proxies on another host:port (the URL would be wrong); OSError naming --port when, on a local
        cluster, host:port has a listener of its own (check_port_free: before Ray starts, unless a `ray start`
        cluster of this machine is joined, whose Serve may hold that port), or Serve cannot bind it;
        ValueError naming the flags when the cluster can never hold the first replicas (check_capacity).
    """
    config = serve_config(config)
    check_checkpoint(config)
    application = build_app(config)
    local = connect(address, host, port, proxy_location, include_dashboard=False)
    try:
        check_capacity(config, read_capacity(), started_here())
    except ValueError:
        ray.shutdown()
        raise
    return run_app(application, APP_NAME, host, port, proxy_location, local)


def check_capacity(config: ServeConfig, capacity: Capacity, one_machine: bool) -> None:
    """Refuse an app whose first max(1, --min-replicas) engine replicas `capacity` (raychat.capacity.read_capacity)
    can never hold, which serve.run would wait for forever. one_machine: the cluster is one this process
    started (raychat.capacity.started_here: this machine, which never grows), checked by its CPUs and GPUs;
    else raychat.capacity.check_bundles of replica_bundles (what the cluster can become: its node types where
    known). On either, with --max-replicas-per-node, the replicas must fit that many a node.

    Raises:
        ValueError: one line naming the flags that ask for too much.
    """
    r, replicas = config.replica, max(1, config.autoscaling.min_replicas)
    cpus, gpus = r.num_cpus, r.num_gpus
    if one_machine:
        need, have = replicas * cpus + config.ingress_num_cpus, capacity.total("CPU")
        if replicas * gpus > capacity.total("GPU"):
            raise ValueError(
                f"{plural(replicas, 'engine replica')} x --num-gpus {shown(gpus)} = "
                f"{plural(replicas * gpus, 'GPU')}, but this machine's Ray cluster has {capacity.total('GPU'):g}; "
                "lower --num-gpus (0 = CPU) or --min-replicas"
            )
        if need > have:
            raise ValueError(
                f"{plural(replicas, 'engine replica')} x --num-cpus {shown(cpus)} + the ingress' "
                f"{plural(config.ingress_num_cpus, 'CPU')} = {plural(need, 'CPU')}, but this machine's Ray cluster "
                f"has {have:g}; lower --min-replicas or --num-cpus"
            )
    else:  # a connected cluster: planned against what it can become (its node types), not what is alive
        check_bundles(replica_bundles(config), capacity, "--num-cpus, --num-gpus, --min-replicas")
    per_node = r.max_replicas_per_node
    replica = replica_bundles(config)[0]
    if per_node and capacity.known and replicas > (most := capacity.fits(replica, per_node)):
        raise ValueError(
            f"--min-replicas {config.autoscaling.min_replicas} with --max-replicas-per-node {per_node}: "
            f"{plural(replicas, 'engine replica')} of {fmt_bundle(replica)}, at most {per_node} a node; the "
            f"cluster's nodes can hold at most {most:g} that way ({capacity.describe()}); lower --min-replicas or "
            "raise --max-replicas-per-node"
        )


def connect(address: str | None, host: str, port: int, proxy_location: str, **init) -> bool:
    """Connect this process to Ray (both backends): the cluster at `address` (else RAY_ADDRESS), else Ray's own
    choice, a `ray start` cluster of this machine or a new one (start_local_cluster), unless it is connected
    already; `init`: more ray.init arguments. Returns whether the cluster is this machine's (local).

    Raises OSError (check_port_free) before Ray starts when a local cluster has no Serve yet and something
    listens on host:port: another server's."""
    local = not ray.is_initialized() and not (address or os.environ.get("RAY_ADDRESS"))
    if local and proxy_location != "Disabled" and not local_cluster_running():
        check_port_free(host, port)
    if local:
        init_keeping_handler(start_local_cluster, address=None, log_to_driver=False, **init)
    elif not ray.is_initialized():
        init_keeping_handler(ray.init, address=address, log_to_driver=False, **init)
    return local


def run_app(application, name: str, host: str, port: int, proxy_location: str, local: bool) -> str:
    """Deploy `application` as Serve application `name` at route "/" on the connected cluster (both backends:
    the one place they start Serve), Serve started with its HTTP proxies on host:port unless it runs there
    already; Serve's reconnect line dropped (drop_reconnect_line). `local`: connect()'s. Returns the page URL,
    "http://host:port/" (a wildcard host as 127.0.0.1).

    Raises ValueError when Serve already runs with its proxies on another host:port (the URL would be wrong);
    OSError naming --port when this machine's proxy cannot bind host:port (check_port_free, port_in_use)."""
    running = _running_http_address()
    if running is not None and running != (host, port):
        ray.shutdown()
        raise ValueError(
            f"Serve already runs on this Ray cluster with its HTTP proxies on {running[0]}:{running[1]}, and "
            f"--host/--port apply only when Serve starts: pass --host {running[0]} --port {running[1]} to deploy "
            f"into it (this replaces its application {name!r}, if it serves one), or stop it first "
            "(`serve shutdown`)"
        )
    # this machine's proxy is about to bind: checked (again) as another server may have bound it meanwhile
    if local and running is None and proxy_location != "Disabled":
        try:
            check_port_free(host, port)
        except OSError:
            ray.shutdown()
            raise
    if running is None:  # a running Serve's proxies are on host:port (checked above): nothing to start
        try:
            serve.start(http_options={"host": host, "port": port}, proxy_location=proxy_location)
        except RuntimeError as e:
            if "Failed to bind" not in str(e):
                raise
            ray.shutdown()
            raise OSError(port_in_use(host, port)) from None
    serve_logger = logging.getLogger(SERVE_LOGGER)
    serve_logger.addFilter(drop_reconnect_line)
    try:  # serve.run takes no HTTP options: it reconnects to the Serve on host:port
        serve.run(application, name=name, route_prefix="/", blocking=False)
    finally:
        serve_logger.removeFilter(drop_reconnect_line)
    page_host = "127.0.0.1" if host in ("0.0.0.0", "::") else host
    return f"http://{page_host}:{port}/"


def drop_reconnect_line(record: logging.LogRecord) -> bool:
    """A filter of Ray Serve's logger (SERVE_LOGGER) that drops its line 'Connecting to existing Serve app in
    namespace "serve". New http_options/controller_options will not be applied.', which serve.run logs each
    time, reconnecting to the Serve whose proxies start() checked are on --host/--port; keeps every other."""
    message = record.getMessage()
    return not (message.startswith("Connecting to existing Serve app") and "will not be applied" in message)


def check_port_free(host: str, port: int) -> None:
    """Raises OSError (port_in_use) when something listens on host:port, another Serve's HTTP proxy included:
    Serve's proxies bind with SO_REUSEPORT, so a second `raychat serve` on a port the first holds started, the
    kernel splitting its connections between the two apps, and printed a URL the other one answered. This
    socket binds without SO_REUSEPORT, which no listener's port admits. Other bind errors (an address not on
    this machine, a port below 1024 without the privilege) are left to Serve's own bind."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        # SO_REUSEADDR, as Serve's proxy sets it: a port in TIME_WAIT is free
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind((host, port))
        except OSError as e:
            if e.errno == errno.EADDRINUSE:
                raise OSError(port_in_use(host, port)) from None


def port_in_use(host: str, port: int) -> str:
    return (
        f"--port {port}: {host}:{port} is in use (another raychat serve, or another program, listens there); "
        "pick another --port"
    )


def check_checkpoint(config: ServeConfig) -> None:
    """Refuse, before Ray starts, what every replica would fail on: a --checkpoint that names no committed
    checkpoint, a file that differs from its commit marker (sizes), an unreadable meta.json or (local) weights
    header (raychat.checkpoint.check_model, no tensor read; a remote one's weights are not fetched here, but
    checked file by file where a replica fetches them) and a --max-len beyond the model's max_seq_len.

    Raises:
        ValueError (one line): naming --checkpoint, or the checkpoint and its file (CheckpointError), or
            --max-len.
    """
    checkpoint = find_checkpoint(config.checkpoint)
    max_seq_len = check_model(checkpoint)["model_config"]["max_seq_len"]
    max_len = config.replica.max_len
    if max_len is not None and not 2 <= max_len <= max_seq_len:
        raise ConfigError(f"--max-len must be in 2..{max_seq_len} (the model's max_seq_len), got {max_len}")


def replica_bundles(config: ServeConfig) -> list[dict]:
    """The resources the app asks for when it starts: --min-replicas (at least 1) engine replicas of
    {CPU: --num-cpus, GPU: --num-gpus} and the ingress' {CPU: ingress_num_cpus}."""
    r = config.replica
    replica = {"CPU": r.num_cpus, **({"GPU": r.num_gpus} if r.num_gpus else {})}
    return [replica] * max(1, config.autoscaling.min_replicas) + [{"CPU": config.ingress_num_cpus}]


def exposed(host: str) -> bool:
    """Whether HTTP proxies bound to `host` answer beyond this machine: anything but "localhost" or a
    loopback address (a host name other than localhost counts as exposed)."""
    if host.lower() == "localhost":
        return False
    try:
        return not ipaddress.ip_address(host).is_loopback
    except ValueError:
        return True


def check_exposure(host: str, api_key: str | None, allow_unauthenticated: bool) -> None:
    """Raises ValueError (one line naming the flags) when `host` is exposed without an API key and
    --allow-unauthenticated was not given."""
    if exposed(host) and not api_key and not allow_unauthenticated:
        raise ValueError(
            f"--host {host} serves beyond this machine but no API key is set: pass --api-key KEY (or set "
            "RAYCHAT_API_KEY), or --allow-unauthenticated to serve every route without a key"
        )


def check_vllm_exposure(host: str, api_key: str | None, allow_unauthenticated: bool) -> None:
    """`--backend vllm`: Ray Serve LLM's OpenAI app (build_openai_app) checks no API key, so a key is refused
    (it would not be checked), and `host` beyond loopback needs --allow-unauthenticated. Raises ValueError (one
    line naming the flags)."""
    if api_key:
        raise ValueError(
            "--api-key: the vLLM backend checks no API key (Ray Serve LLM's build_openai_app has no key "
            "option); serve it on a loopback --host behind a proxy that checks one, or drop --api-key"
        )
    if exposed(host) and not allow_unauthenticated:
        raise ValueError(
            f"--host {host} serves beyond this machine and the vLLM backend checks no API key (Ray Serve LLM's "
            "build_openai_app has no key option): pass --allow-unauthenticated to serve every route without a "
            "key, or serve on a loopback --host behind a proxy that checks one"
        )


def _running_http_address() -> tuple[str, int] | None:
    """(host, port) of the HTTP proxies of the Serve already running on the connected cluster, or None."""
    # Ray has no public getter of a running Serve's HTTP options; serve.start only logs that they differ.
    client = serve.context._get_global_client(raise_if_no_controller_running=False)
    return None if client is None else (client.http_config.host, client.http_config.port)


def start_vllm(args: argparse.Namespace) -> str:
    """`--backend vllm`: the exported --hf-dir served by vLLM through Ray Serve LLM (raychat.serve.vllm), with
    --model-id, --min/--max-replicas, --max-ongoing-requests and --num-gpus (tensor-parallel size, >= 1) of
    this command; returns the OpenAI base URL. Raises ValueError naming the flag, before Ray starts, without
    --hf-dir or vLLM."""
    if not args.hf_dir:
        raise ValueError("--backend vllm needs --hf-dir DIR (the directory `raychat export` wrote)")
    vllm.require_vllm()
    options = {
        "model_id": args.model_id or VLLM_MODEL_ID, "accelerator_type": "", "min_replicas": args.min_replicas,
        "max_replicas": args.max_replicas, "max_ongoing_requests": args.max_ongoing_requests,
        "tensor_parallel_size": max(1, int(args.num_gpus or 1)),
    }  # fmt: skip
    config = vllm.llm_config(args.hf_dir, **{k: v for k, v in options.items() if v is not None})
    application = vllm.application(config)
    local = connect(args.address, args.host, args.port, args.proxy_location)
    return run_app(application, vllm.APP_NAME, args.host, args.port, args.proxy_location, local) + "v1"


def main(args: argparse.Namespace) -> int:
    """`raychat serve`. The Ray auth token (--token-file, else where Ray looks: raychat.ray_token) is handed to
    Ray before it connects; a cluster that refuses it raises ConnectionError naming where it came from.

    SIGTERM from here on stops the command in one line and returns 0: while it starts (Ray, Serve, the app;
    "raychat serve: stopped (SIGTERM) while starting; Serve shut down", after shutting down what started:
    init_keeping_handler keeps Ray's own handlers out of the way) as once it serves (_block). The handler this process
    had before is back when main returns."""
    if args.no_block and not (args.address or os.environ.get("RAY_ADDRESS")):
        raise ValueError(
            "--no-block needs --address (or RAY_ADDRESS): a local cluster ends with this process"
        )
    check_gcs_address(args.address)
    previous = signal.signal(signal.SIGTERM, raise_terminated)
    try:
        with token_for(args.address, args.token_file):
            return _serve(args)
    except Terminated:
        return _stop("SIGTERM", " while starting")
    finally:
        signal.signal(signal.SIGTERM, previous)


def _serve(args: argparse.Namespace) -> int:
    if getattr(args, "backend", "raychat") == "vllm":
        check_vllm_exposure(args.host, args.api_key, args.allow_unauthenticated)
        url = start_vllm(args)
        print(f"vLLM is serving {args.hf_dir}")
        print(
            f'model id:     {args.model_id or VLLM_MODEL_ID}  (what /v1/models lists and requests\' "model" names)'
        )
        print(f"OpenAI API:   {url}  (model list: {url}/models)", flush=True)
        return 0 if args.no_block else _block()
    if args.hf_dir:
        raise ConfigError("--hf-dir goes with --backend vllm; the raychat backend serves --checkpoint")
    config = from_args(args, ServeConfig, "serve", where="serve settings")
    if not config.checkpoint:
        raise ConfigError("--checkpoint: required: a checkpoint dir, a run dir or <run dir>/latest")
    config = serve_config(config)
    check_exposure(args.host, config.api_key, config.allow_unauthenticated)  # the flag, else the preset's
    if not config.api_key:  # check_exposure let no key through (a loopback --host, --allow-unauthenticated)
        config = from_dict(ServeConfig, {"allow_unauthenticated": True}, base=config)
    reference, model_id = config.checkpoint, config.model_id or default_model_id(config.checkpoint)
    served = find_checkpoint(reference)  # checked, described and served: one resolve, so all three agree
    about = described(served)
    config = from_dict(ServeConfig, {"checkpoint": served, "model_id": model_id}, base=config)
    url = start(
        config, host=args.host, port=args.port, address=args.address, proxy_location=args.proxy_location
    )
    print(f"raychat is serving {reference}")
    print(f"checkpoint:   {about}")
    print(f'model id:     {model_id}  (what /v1/models lists and OpenAI requests\' "model" names)')
    print(f"chat page:    {url}")
    print(f"OpenAI API:   {url}v1  (model list: {url}v1/models, health: {url}health)")
    for metrics, where in metrics_endpoints():
        print(f"metrics:      {metrics}  (Prometheus, {where}: ray_raychat_serve_ttft_seconds, ...)")
    print(end="", flush=True)
    if args.no_block:
        return 0
    return _block()


def metrics_endpoints() -> list[tuple[str, str]]:
    """Where the served app's metrics are: (Prometheus endpoint, what runs there) for each Ray node that runs a
    ChatServer replica of it, e.g. [("http://10.0.0.5:51234/metrics", "the Ray node of 1 ChatServer replica")],
    ordered by endpoint. A node exports only what its own processes record (TTFT, tokens, prefix cache hits are
    the replicas'; docs/deployment.md section 5), so on a multi-node cluster the endpoints are the replicas'
    nodes, not this process' node. Without a replica found, this process' node ("this node's Ray"); [] without
    Ray or through a ray:// client (no node of its own)."""
    if not ray.is_initialized() or ray.util.client.ray.is_connected():
        return []
    replicas = ray._private.state.actors(actor_state_name="ALIVE").values()
    return replica_endpoints(replicas, ray.nodes(), ray.get_runtime_context().get_node_id())


def replica_endpoints(actors, nodes: list[dict], this_node: str) -> list[tuple[str, str]]:
    """metrics_endpoints from Ray's actor table entries (`ActorClassName`, `Address.NodeID`) and `ray.nodes()`:
    the endpoint of each node holding a ChatServer replica of APP_NAME, else `this_node`'s."""
    endpoint = {
        node["NodeID"]: f"http://{node['NodeManagerAddress']}:{node['MetricsExportPort']}/metrics"
        for node in nodes
        if node.get("Alive", True) and node.get("MetricsExportPort")
    }
    replica_class = f"ServeReplica:{APP_NAME}:{SERVER_DEPLOYMENT}"
    on_node = Counter(a["Address"]["NodeID"] for a in actors if a["ActorClassName"] == replica_class)
    found = sorted(
        (endpoint[node], f"the Ray node of {plural(n, f'{SERVER_DEPLOYMENT} replica')}")
        for node, n in on_node.items()
        if node in endpoint
    )
    if found:
        return found
    return [(endpoint[this_node], "this node's Ray")] if this_node in endpoint else []


def _block() -> int:
    """Wait until Ctrl-C (SIGINT) or SIGTERM (`kill`, `docker stop`, Kubernetes), then shut Serve and this
    process' Ray down and print one line, "raychat serve: stopped (SIGTERM); Serve shut down"; returns 0.
    SIGTERM gets a handler of its own here: Ray's (installed by ray.init) prints a native stack trace and exits
    without shutting Serve down. A second SIGTERM during the shutdown ends the process at once."""
    signal.signal(signal.SIGTERM, raise_terminated)
    try:
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        name = "SIGINT"
    except Terminated:
        name = "SIGTERM"
    return _stop(name)


def _stop(name: str, when: str = "") -> int:
    """Shut down Serve (when Ray is up) and this process' Ray (a local cluster with it), then print
    "raychat serve: stopped (<name>)<when>; Serve shut down"; returns 0. A second SIGTERM meanwhile ends the
    process at once."""
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    if ray.is_initialized():
        serve.shutdown()
    ray.shutdown()  # before the line: nothing of Ray's (its shutdown warnings) prints after it
    print(f"raychat serve: stopped ({name}){when}; Serve shut down", flush=True)
    return 0
