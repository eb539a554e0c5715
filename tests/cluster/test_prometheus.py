"""A real Prometheus (Debian's package) scrapes the fixture cluster through Ray's service discovery file and
answers every PromQL expression of raychat's shipped Grafana dashboard (raychat.ops.grafana) with data.

What produces the data, in ~60 s on top of the session's cluster:
- training and RL: a tiny job (an actor on worker node a) feeds 3 steps of stats through the very functions
  the Ray Train worker and the RL loop record with (raychat.train.worker.train_gauges,
  raychat.rl.loop.rl_gauges). A real pretraining job and a real RL job take 25-55 s each to reach their first
  step on this cluster (bench/results/cluster_chain.md), past this test's budget; that the Trainer itself
  records on a worker node's metrics port is tests/cluster/test_stage_jobs.py's
  test_training_metrics_were_scraped_from_a_worker_nodes_metrics_port.
- serving: the real chat app (`raychat serve`'s start(), one ChatServer replica of the tiny tool model on a
  worker node) answering 4 streamed chat requests (2 prompts, each asked twice: the second time its prefix
  is in the replica's prefix cache) through the official openai client.
Each expression is asked over the test's time range as Grafana's time-series panels ask (query_range, 1 s
step, the template variables at their "All" value `.*`); each must return at least one series, except
the one in CPU_ONLY_EMPTY, which must return none (a PromQL syntax error fails either way).
"""

from __future__ import annotations

import time
import uuid
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest
import ray
from ray import serve
from support.prometheus import start_prometheus

from raychat.config import ServeConfig, from_dict
from raychat.ops.grafana import build_dashboard
from raychat.ports import free_ports
from raychat.serve.cli import start

pytestmark = pytest.mark.ray
SD_FILE = "prom_metrics_service_discovery.json"
# MFU = achieved FLOP/s / the device's peak (raychat.train.trainer.Trainer.step_stats): the peak is known for
# GPUs of raychat.train.plan.PEAK_FLOPS or given with --peak-flops; on CPU it is unknown, the Trainer
# reports mfu None and the gauge is never set. Only bench/gpu_check.sh (a GPU) can show this panel's data.
CPU_ONLY_EMPTY = {"MFU"}
SYSTEM = "You are a careful assistant who answers arithmetic questions with the calculator. " * 4


def dashboard_queries() -> list[tuple[str, str]]:
    """(panel title, PromQL) of every target of the shipped dashboard, template variables at "All"."""
    panels = [p for p in build_dashboard()["panels"] if p.get("targets")]
    return [
        (p["title"], t["expr"].replace("$run", ".*").replace("$deployment", ".*"))
        for p in panels
        for t in p["targets"]
    ]


def template_variables() -> list[tuple[str, str, str]]:
    """(variable, metric, label) of every label_values(metric, label) query variable of the dashboard."""
    out = []
    for v in build_dashboard()["templating"]["list"]:
        if v["type"] == "query":
            metric, label = v["definition"][len("label_values(") : -1].split(", ")
            out.append((v["name"], metric, label))
    return out


@pytest.fixture(scope="module")
def prometheus(multinode_cluster, tmp_path_factory):
    sd = multinode_cluster.root / SD_FILE
    deadline = time.monotonic() + 30
    while not sd.exists():  # the head's dashboard writes it within seconds of starting
        assert time.monotonic() < deadline, f"{sd} never appeared"
        time.sleep(0.5)
    prom = start_prometheus(sd, tmp_path_factory.mktemp("prometheus"), free_ports(1)[0])
    try:
        yield prom
    finally:
        prom.stop()


@ray.remote(num_cpus=0, resources={"node_a": 0.01})
class TinyJob:
    """Three steps of training and RL stats, recorded as the Ray Train worker and the RL loop record them."""

    def run(self, run: str) -> None:
        from raychat.rl.loop import rl_gauges
        from raychat.train.worker import train_gauges

        train, rl = train_gauges(run, "pretrain"), rl_gauges(run)
        for step in range(1, 4):
            train({
                "step": step, "loss": 5.0 - step, "lr": 0.02, "tokens_per_s": 800.0 + step, "mfu": None,
                "grad_norm": 1.5, "data_wait_frac": 0.1, "val_bpb": 2.0 if step == 3 else None,
            })  # fmt: skip
            rl({
                "step": step, "reward_mean": 0.25 * step, "pass_at_1": 0.5, "staleness_mean": 1.0,
                "sync_time_s": 0.2, "rollout_tokens_per_s": 300.0, "learner_wait_frac": 0.4,
                "zero_advantage_frac": 0.25, "reward_std": 0.5, "advantage_std": 0.25, "entropy": 1.5,
                "response_len_mean": 12.0, "response_len_min": 4, "response_len_max": 24,
            })  # fmt: skip
            time.sleep(1.5)  # a scrape (1 s) between steps


def _chat(endpoint: str, n: int) -> list[str]:
    client = openai.OpenAI(base_url=endpoint + "v1", api_key="unused", timeout=120, max_retries=2)

    def ask(i: int) -> str:
        stream = client.chat.completions.create(
            model=client.models.list().data[0].id,
            # each prompt asked twice, 2 at a time: the second asking finds its prefix (over 100 tokens, more than
            # a prefix-cache block) in the replica's prefix cache
            messages=[
                {"role": "system", "content": SYSTEM},
                {"role": "user", "content": f"What is {i % 2} + 1?"},
            ],
            max_tokens=12,
            stream=True,
        )
        return "".join(c.choices[0].delta.content or "" for c in stream if c.choices)

    with ThreadPoolExecutor(2) as pool:
        return list(pool.map(ask, range(n)))


def _wait_series(prom, exprs: list[str], start: float, timeout_s: float) -> dict[str, int]:
    """{expr: number of series} once every expr returns a series, or at the timeout (whatever it has)."""
    deadline = time.monotonic() + timeout_s
    while True:
        counts = {e: len(prom.query_range(e, start, time.time())) for e in exprs}
        if all(counts.values()) or time.monotonic() > deadline:
            return counts
        time.sleep(2)


def test_every_dashboard_query_returns_series_from_a_real_prometheus(
    prometheus, multinode_driver, tool_checkpoint
):
    c = multinode_driver
    start_s = time.time()
    # every node's metrics port is a target and up: the service discovery file is what Ray wrote (it also
    # lists the dashboard's and the autoscaler's metrics ports, 44227 and 44217 by default)
    ports = {str(n.metrics_port) for n in c.nodes.values()}
    deadline = time.monotonic() + 30
    while not ports <= (up := {u.rsplit(":", 1)[1].split("/")[0] for u in prometheus.targets_up()}):
        assert time.monotonic() < deadline, (
            f"node ports {ports}, up: {up}; {prometheus.log.read_text()[-2000:]}"
        )
        time.sleep(1)

    job = TinyJob.remote()
    finished = job.run.remote(f"prom-{uuid.uuid4().hex[:6]}")
    port = free_ports(1)[0]
    config = from_dict(ServeConfig, {
        "checkpoint": str(tool_checkpoint), "num_cpus": 0.5, "min_replicas": 1, "max_replicas": 1,
        "ingress_num_cpus": 0.1, "allow_unauthenticated": True,
    })  # fmt: skip
    url = start(config, port=port, address=c.gcs_address, proxy_location="HeadOnly")
    try:
        replies = _chat(url, 4)
        assert len(replies) == 4 and all(isinstance(r, str) for r in replies)
        ray.get(finished, timeout=60)
        queries = dashboard_queries()
        # 7 training panels (8 queries), 9 RL (14), 6 serving (9) when this was written
        assert len(queries) >= 31, queries
        expected = [e for title, e in queries if title not in CPU_ONLY_EMPTY]
        counts = _wait_series(prometheus, expected, start_s, timeout_s=40)
        empty = [f"{title}: {e}" for title, e in queries if e in counts and not counts[e]]
        assert not empty, "dashboard queries with no series:\n" + "\n".join(empty)
        for title, e in queries:
            if title in CPU_ONLY_EMPTY:  # a valid query (a syntax error raises) with no data on CPU
                assert prometheus.query_range(e, start_s, time.time()) == [], title
        for name, metric, label in template_variables():  # Grafana's label_values(metric, label)
            values = prometheus.api(f"label/{label}/values", **{"match[]": metric, "start": f"{start_s:.3f}"})
            assert values, f"template variable ${name}: no {label} values of {metric}"
    finally:
        serve.shutdown()
        ray.kill(job)
