"""Every stage as a Ray job on the multi-node fixture cluster, chained through one storage root.

The chain is the KubeRay cpu-dev overlay's RayJobs (tests/support/stage_chain.py): their entrypoints, the PVC mount
mapped to a temp dir, each command submitted with `raychat submit <stage> ARGS` (working_dir + py_modules)
to the fixture cluster (a head with no CPUs, workers a and b with 2 logical CPUs each): data prepare, tokenizer
train, pretrain, sft --init-from latest, rl --checkpoint latest, eval, export, each to SUCCEEDED. Asserted:
each stage's output in storage and what it was made from, the ranks of pretraining and SFT on two nodes (the
node ids the workers print), every job in the Jobs API with its status and entrypoint, and a training
metric scraped from a worker node's metrics port while the chain ran.
"""

from __future__ import annotations

import json
import math
import re
import subprocess
import threading
import time
import urllib.request
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import SimpleNamespace

import openai
import pyarrow.fs as pafs
import pytest
import requests
import yaml
from prometheus_client.parser import text_string_to_metric_families
from ray.util.state import list_actors
from safetensors.torch import load_file
from support.cluster import VENV_BIN
from support.stage_chain import RAYCHAT, REPO, run_chain, submit

from raychat.checkpoint import load_rank_states
from raychat.checkpoint_manager import find_checkpoint, resolve_checkpoint
from raychat.ops import k8s
from raychat.ports import free_ports
from raychat.storage import open_storage, read_bytes
from raychat.tokenizer import Tokenizer

pytestmark = pytest.mark.ray
RANK_LINE = re.compile(r"rank (\d+)/(\d+) on node ([0-9a-f]+)")
TRAIN_METRIC = "ray_raychat_train_step"


class MetricsWatcher(threading.Thread):
    """Scrapes each worker node's metrics port every second; keeps the last value of TRAIN_METRIC per (node,
    run label) it saw."""

    def __init__(self, ports: dict[str, int]):
        super().__init__(daemon=True)
        self.ports, self.seen, self.done = ports, {}, threading.Event()

    def run(self) -> None:
        while not self.done.wait(1.0):
            for node, port in self.ports.items():
                try:
                    body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read()
                except OSError:
                    continue
                for family in text_string_to_metric_families(body.decode()):
                    for s in family.samples:
                        if s.name == TRAIN_METRIC:
                            self.seen[(node, s.labels.get("run"))] = s.value


@pytest.fixture(scope="module")
def chain(multinode_cluster, tmp_path_factory):
    c = multinode_cluster
    mount = tmp_path_factory.mktemp("pvc")  # stands for the PVC mounted at /mnt/checkpoints
    watcher = MetricsWatcher({name: c.nodes[name].metrics_port for name in ("a", "b")})
    watcher.start()
    t0 = time.monotonic()
    try:
        runs = run_chain(mount, c.dashboard_url, c.token_file)
    finally:
        watcher.done.set()
        watcher.join()
    return SimpleNamespace(
        cluster=c, root=mount / "runs", runs={r.rayjob + ":" + r.job_id.rsplit("-", 1)[1]: r for r in runs},
        wall_s=time.monotonic() - t0, metrics=watcher.seen,
    )  # fmt: skip


def _meta(ckpt: str) -> dict:
    return json.loads((Path(ckpt) / "meta.json").read_text())


@pytest.mark.slow
def test_every_stage_succeeds_as_a_ray_job_chained_through_storage(chain):
    assert list(chain.runs) == [
        "raychat-data:data", "raychat-tokenizer:tokenizer", "raychat-pretrain:pretrain", "raychat-sft:sft",
        "raychat-rl:rl", "raychat-eval:eval", "raychat-export:export",
    ]  # fmt: skip
    for run in chain.runs.values():
        assert run.returncode == 0, f"{run.job_id} ended {run.returncode}:\n{run.output[-4000:]}"
        assert run.submitted == run.command  # `raychat submit` ran exactly the manifest's command
        assert f"job {run.job_id} SUCCEEDED" in run.output
    root = chain.root
    manifest = json.loads((root / "data" / "manifest.json").read_text())
    assert [s["split"] for s in manifest["shards"]] == ["train"] * 5 + ["val"]  # tiny: 5 train shards
    assert Tokenizer.load(root / "tokenizer").vocab_size == 512  # BPE + specials

    pretrain = find_checkpoint("pretrain", str(root))
    sft = find_checkpoint("sft", str(root))
    rl = find_checkpoint("rl", str(root))
    # tiny preset: pretrain 4 steps, SFT 2, RL 1; each stage starts from the one before (`latest`)
    assert (_meta(pretrain)["stage"], _meta(pretrain)["step"]) == ("pretrain", 4)
    assert (_meta(sft)["stage"], _meta(sft)["step"]) == ("sft", 2)
    assert _meta(sft)["config"]["run"]["init_from"] == pretrain
    assert (_meta(rl)["stage"], _meta(rl)["step"]) == ("rl", 1)
    assert _meta(rl)["config"]["run"]["init_from"] == sft

    result = json.loads((root / "eval" / "eval.json").read_text())
    assert (result["checkpoint"], result["stage"], result["step"]) == (rl, "rl", 1)
    assert math.isfinite(result["val_bpb"]) and result["val_bpb"] > 0
    assert result["tasks"]["calculator"]["examples"] == 4
    assert f'"val_bpb": {result["val_bpb"]!r}' in chain.runs["raychat-eval:eval"].output  # the job printed it

    exported = load_file(str(root / "hf" / "model.safetensors"))
    weights = load_file(str(Path(rl) / "model.safetensors"))
    assert len(exported) == len(weights)
    config = json.loads((root / "hf" / "config.json").read_text())
    assert config["num_hidden_layers"] == 1 and config["vocab_size"] >= 512


def test_ranks_of_pretraining_and_sft_ran_on_the_two_worker_nodes(chain):
    workers = {chain.cluster.nodes["a"].node_id, chain.cluster.nodes["b"].node_id}
    for key in ("raychat-pretrain:pretrain", "raychat-sft:sft"):
        found = [
            (int(r), node) for r, world, node in RANK_LINE.findall(chain.runs[key].output) if world == "2"
        ]
        ranks = dict(found)
        assert sorted(ranks) == [0, 1], chain.runs[key].output[-3000:]
        assert (
            len(found) == 2
        )  # rank 0's one line, shown once (it was shown once per node sharing a temp dir)
        assert set(ranks.values()) == workers  # one rank on a, one on b: the head has no CPUs


def test_every_job_is_in_the_jobs_api_with_its_status(chain):
    c = chain.cluster
    req = urllib.request.Request(
        c.dashboard_url + "/api/jobs/", headers={"Authorization": f"Bearer {c.token}"}
    )
    with urllib.request.urlopen(req, timeout=30) as r:
        jobs = {j["submission_id"]: j for j in json.load(r)}
    for run in chain.runs.values():
        assert (jobs[run.job_id]["status"], jobs[run.job_id]["entrypoint"]) == ("SUCCEEDED", run.command)


def test_training_metrics_were_scraped_from_a_worker_nodes_metrics_port(chain):
    """Rank 0 records raychat_train_* on its node; the head has no CPUs, so it is a worker node's port."""
    for run in ("pretrain", "sft"):
        seen = {node: v for (node, label), v in chain.metrics.items() if label == run}
        assert seen, f"no {TRAIN_METRIC}{{run={run!r}}} on the metrics ports of a or b: {chain.metrics}"
        assert all(1 <= v <= 4 for v in seen.values()), seen


@pytest.mark.slow
def test_pretraining_on_s3_checkpoints_to_the_bucket_and_resumes_from_it(chain, s3_env, tmp_path):
    """A pretraining job whose --storage-path is a bucket of the moto server (Ray Train's storage_path +
    storage_filesystem; the job gets the endpoint through --env, the nodes have credentials), stopped after
    2 steps, then run again: it resumes from the bucket's checkpoint and finishes its 4 steps. Its two ranks
    (one on node a, one on b) commit their files under one commit marker in the bucket, and the resolver
    fetches the newest committed checkpoint whole."""
    c, root = chain.cluster, chain.root
    bucket = s3_env.make_bucket()
    storage = f"s3://{bucket}/runs"
    stage = [
        "pretrain", "--preset", "tiny", "--storage-path", storage, "--run-name", "s3-pretrain",
        "--data-dir", str(root / "data"), "--tokenizer-path", str(root / "tokenizer"),
    ]  # fmt: skip
    env = ("--env", f"AWS_ENDPOINT_URL={s3_env.endpoint}")
    first = submit([*stage, "--stop-after", "2"], "s3-first", c.dashboard_url, c.token_file, env)
    assert first.returncode == 0, first.output[-4000:]
    assert _meta_of(find_checkpoint(f"{storage}/s3-pretrain/latest"))["step"] == 2
    second = submit(stage, "s3-resume", c.dashboard_url, c.token_file, env)
    assert second.returncode == 0, second.output[-4000:]
    assert (
        f"resumed from s3://{bucket}/runs/s3-pretrain/checkpoint_000002 (step 2, written by 2 workers): goes on at "
        "step 3 on 2 workers"
    ) in second.output
    assert "step     3/4" in second.output and "step     1/4" not in second.output
    newest = find_checkpoint(f"{storage}/s3-pretrain/latest")
    assert newest == f"s3://{bucket}/runs/s3-pretrain/checkpoint_000004"
    assert _meta_of(newest)["step"] == 4
    names = [i.path.rsplit("/", 1)[-1] for i in s3_env.filesystem().get_file_info(
        pafs.FileSelector(f"{bucket}/runs/s3-pretrain"))]  # fmt: skip
    # keep_checkpoints 2: steps 2 and 4, both committed
    assert sorted(n for n in names if n.startswith("checkpoint_")) == [
        "checkpoint_000002",
        "checkpoint_000004",
    ]
    for run in (first, second):  # the head has no CPUs: one rank on a, one on b
        ranks = {int(r): node for r, world, node in RANK_LINE.findall(run.output) if world == "2"}
        assert sorted(ranks) == [0, 1] and set(ranks.values()) == {c.nodes["a"].node_id, c.nodes["b"].node_id}
    local = resolve_checkpoint(newest, cache_dir=tmp_path)
    commit = json.loads((local / "commit.json").read_text())
    rank_files = {f"{kind}_rank{r}.{ext}" for r in (0, 1) for kind, ext in (("state", "npz"), ("rng", "pt"))}
    assert rank_files <= set(commit["files"]) and "model.safetensors" in commit["files"]  # both ranks' parts
    assert all((local / name).is_file() for name in commit["files"])  # fetched whole
    assert load_rank_states(local)[1]["step"] == 4  # rank 1's own state, uploaded from node b


def _meta_of(uri: str) -> dict:
    storage = open_storage(uri)
    return json.loads(read_bytes(storage, f"{storage.path}/meta.json"))


# ---------------------------------------------------------------- serving from the storage root


def _serve_requests(
    endpoint: str, deployment_port: dict[str, int], rounds: int = 6, api_key: str = "unused"
) -> dict[str, float]:
    """Chat completions through the official openai client (sending `api_key`), 4 at a time, until each worker
    node's ChatServer replica has answered one (Serve's request counter on that node's metrics port), at most
    `rounds` times; returns {node: requests its replica answered}."""
    client = openai.OpenAI(base_url=endpoint + "v1", api_key=api_key, timeout=120, max_retries=2)
    model = client.models.list().data[0].id

    def ask(i: int) -> str:
        reply = client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": f"What is {i} + 1?"}], max_tokens=4
        )
        return reply.choices[0].finish_reason

    answered: dict[str, float] = {}
    with ThreadPoolExecutor(4) as pool:
        for _ in range(rounds):
            assert set(pool.map(ask, range(4))) <= {"stop", "length"}
            answered = {node: _request_count(port) for node, port in deployment_port.items()}
            if all(answered.values()):
                break
            time.sleep(2)  # the counters reach the metrics port within a report interval (1 s here)
    return answered


def _request_count(port: int) -> float:
    body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    return sum(
        s.value
        for family in text_string_to_metric_families(body)
        for s in family.samples
        if s.name == "ray_serve_deployment_request_counter_total"
        and s.labels.get("deployment") == "ChatServer"
    )


def _replica_nodes(dashboard_url: str) -> list[str]:
    """The node ids of the running ChatServer replicas (Ray's state API of the cluster at dashboard_url)."""
    actors = list_actors(address=dashboard_url, filters=[("state", "=", "ALIVE")], detail=True, limit=1000)
    return sorted(a.node_id for a in actors if a.class_name.endswith(":ChatServer"))


def _serve_cli(c, *args: str) -> subprocess.CompletedProcess:
    """The `serve` CLI against the fixture cluster's dashboard (a fresh process each time: the driver's own
    Serve client would keep a handle of a controller that `serve shutdown` stopped)."""
    cmd = [str(VENV_BIN / "serve"), *args, "--address", c.dashboard_url]
    return subprocess.run(cmd, env=c.env(), capture_output=True, text=True, timeout=120)


def _wait_running(c, app: str, timeout_s: float = 300) -> None:
    """Until Serve's REST API (what `serve status` reads) lists `app` RUNNING."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            details = c.serve_applications().get(app, {})
        except OSError as e:  # the dashboard of a loaded machine drops a request now and then: ask again
            details = {"error": repr(e)}
        if details.get("status") == "RUNNING":
            return
        assert time.monotonic() < deadline, f"app {app} not RUNNING after {timeout_s} s: {details}"
        time.sleep(1)


def test_serve_deploy_of_chat_yaml_serves_the_rl_checkpoint_from_storage_on_two_nodes(
    chain, multinode_driver, tmp_path
):
    """serve/chat.yaml as the RayService runs it (checkpoint <root>/rl/latest on the PVC, mount mapped, and
    RAYCHAT_API_KEY in its environment: here the app's runtime env), with what one machine needs: the proxy on
    the head only (every node's proxy would bind the same port here), a free port, and replicas that fit 1-CPU
    nodes: 2 of them, one a node (max_replicas_per_node: 1)."""
    c = multinode_driver
    config = yaml.safe_load((REPO / "serve" / "chat.yaml").read_text())
    args = config["applications"][0]["args"]
    (server,) = [d for d in config["applications"][0]["deployments"] if d["name"] == "ChatServer"]
    assert args["checkpoint"] == f"{k8s.STORAGE_ROOT}/rl/latest"
    assert server["max_replicas_per_node"] == 1
    port = free_ports(1)[0]
    args.update(checkpoint=args["checkpoint"].replace(k8s.CHECKPOINTS_MOUNT, str(chain.root.parent)))
    server["ray_actor_options"]["num_cpus"] = 0.5
    server["autoscaling_config"].update(min_replicas=2, max_replicas=2)
    key = uuid.uuid4().hex
    config["applications"][0]["runtime_env"] = {"env_vars": {"RAYCHAT_API_KEY": key}}
    config.update(proxy_location="HeadOnly", http_options={"host": "127.0.0.1", "port": port})
    path = tmp_path / "chat.yaml"
    path.write_text(yaml.safe_dump(config))
    r = _serve_cli(c, "deploy", str(path))
    assert r.returncode == 0, r.stdout + r.stderr
    try:
        _wait_running(c, "raychat")
        assert _replica_nodes(c.dashboard_url) == sorted([c.nodes["a"].node_id, c.nodes["b"].node_id])
        health = requests.get(f"http://127.0.0.1:{port}/health", timeout=30).json()
        assert health["status"] == "ok"
        assert requests.get(f"http://127.0.0.1:{port}/v1/models", timeout=30).status_code == 401  # no key
        answered = _serve_requests(
            f"http://127.0.0.1:{port}/", {n: c.nodes[n].metrics_port for n in "ab"}, api_key=key
        )
        assert all(answered.values()), f"requests answered per node: {answered}"
    finally:  # as the docs stop Serve between the two (its proxies keep their port until Serve stops)
        _serve_cli(c, "shutdown", "-y")


def test_raychat_serve_of_a_run_latest_on_two_nodes(chain, multinode_driver):
    """`raychat serve --checkpoint <storage>/rl/latest --address <cluster> --no-block`: the app stays up after
    the command returns, 2 replicas on 2 nodes, each answers; a second `raychat serve` asking for another port
    while Serve runs is refused with the port Serve listens on (Serve keeps its proxies' first port)."""
    c = multinode_driver
    port, other = free_ports(2)
    cmd = [
        *RAYCHAT, "serve", "--checkpoint", f"{chain.root}/rl/latest", "--address", c.gcs_address, "--no-block",
        "--port", str(port), "--num-cpus", "0.5", "--min-replicas", "2", "--max-replicas", "2",
        "--max-replicas-per-node", "1", "--proxy-location", "HeadOnly",
    ]  # fmt: skip
    r = subprocess.run(cmd, env=c.env(), capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr
    rl = find_checkpoint("rl", str(chain.root))
    assert f"raychat is serving {chain.root}/rl/latest" in r.stdout
    assert f"chat page:    http://127.0.0.1:{port}/" in r.stdout
    # the replicas' nodes export their TTFT and tokens, not the head this command ran on
    metrics = re.findall(
        r"^metrics: +http://[^:]+:(\d+)/metrics  \(Prometheus, the Ray node of 1 ChatServer", r.stdout, re.M
    )
    assert sorted(map(int, metrics)) == sorted(c.nodes[n].metrics_port for n in "ab"), r.stdout
    try:
        again = [*cmd[: cmd.index("--port") + 1], str(other), *cmd[cmd.index("--port") + 2 :]]
        r = subprocess.run(again, env=c.env(), capture_output=True, text=True, timeout=600)
        assert r.returncode == 2, r.stdout + r.stderr
        assert f"Serve already runs on this Ray cluster with its HTTP proxies on 127.0.0.1:{port}" in r.stderr
        _wait_running(c, "raychat")
        assert _replica_nodes(c.dashboard_url) == sorted([c.nodes["a"].node_id, c.nodes["b"].node_id])
        info = requests.get(f"http://127.0.0.1:{port}/health", timeout=30).json()
        assert info["status"] == "ok", info
        assert rl
        answered = _serve_requests(f"http://127.0.0.1:{port}/", {n: c.nodes[n].metrics_port for n in "ab"})
        assert all(answered.values()), f"requests answered per node: {answered}"
    finally:
        _serve_cli(c, "shutdown", "-y")


def test_a_wrong_token_is_refused_in_one_line_before_any_job(multinode_cluster, tmp_path):
    c = multinode_cluster
    (tmp_path / "token").write_text("not-the-token\n")
    r = subprocess.run(
        [*RAYCHAT, "submit", "--address", c.dashboard_url, "--token-file", str(tmp_path / "token"),
         "pretrain", "--preset", "tiny", "--storage-path", str(tmp_path / "runs")],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert r.returncode == 4, r.stdout + r.stderr
    assert r.stderr.strip() == (
        f"raychat submit: error: --token-file: the Ray cluster at {c.dashboard_url} refused the token in "
        f"{tmp_path / 'token'} (Authentication failed: Forbidden: Invalid authentication token)"
    )
