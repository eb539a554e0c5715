"""raychat.metrics: validation and no-op without Ray (fast tier); a real scrape of a Ray node (ray tier)."""

from __future__ import annotations

import time
import urllib.request

import pytest
from support.cluster import init_local_ray

from raychat import metrics
from raychat.metrics import RLMetrics, ServeMetrics, TrainMetrics
from raychat.ports import free_ports
from raychat.rl.loop import rl_gauges


def test_names_are_prefixed_and_unique():
    assert len(metrics.METRIC_NAMES) == len(set(metrics.METRIC_NAMES)) == 30
    assert all(name.startswith("raychat_") for name in metrics.METRIC_NAMES)


def test_no_op_without_ray(monkeypatch):
    monkeypatch.setattr(metrics.ray, "is_initialized", lambda: False)
    created = []
    monkeypatch.setattr(metrics, "_metric", lambda name: created.append(name))
    TrainMetrics("r", "pretrain").record(1, 2.0, 1e-3, 100.0, None, 0.5, 0.0)
    ServeMetrics("chat").add_tokens(3)
    assert created == []


def test_bad_values_name_the_field():
    t = TrainMetrics("r", "sft")
    ok = dict(step=1, loss=2.0, lr=1e-3, tokens_per_s=10.0, mfu=0.3, grad_norm=1.0, data_wait_frac=0.2)
    t.record(**ok)
    t.record(**{**ok, "loss": float("nan")})  # a diverged run is shown, not hidden
    for field, bad in [
        ("step", -1),
        ("step", 1.5),
        ("data_wait_frac", 1.5),
        ("tokens_per_s", -3.0),
        ("lr", "0.1"),
        ("mfu", float("inf")),
    ]:
        with pytest.raises(ValueError, match=field):
            t.record(**{**ok, field: bad})
    with pytest.raises(ValueError, match="pass_at_1"):
        RLMetrics("r").record(1, 0.5, pass_at_1=2.0)
    with pytest.raises(ValueError, match="zero_advantage_frac"):
        RLMetrics("r").record(1, 0.5, zero_advantage_frac=1.25)
    with pytest.raises(ValueError, match="reward_std must be >= 0.0, got -0.5"):
        RLMetrics("r").record(1, 0.5, reward_std=-0.5)
    with pytest.raises(ValueError, match="response_len_max must be a number"):
        RLMetrics("r").record(1, 0.5, response_len_max="24")
    RLMetrics("r").record(1, 0.5, entropy=float("nan"))  # a diverged policy is shown, as a NaN loss is
    with pytest.raises(ValueError, match="n must be an int"):
        ServeMetrics("chat").set_running(-1)
    with pytest.raises(ValueError, match="deployment"):
        ServeMetrics("")
    with pytest.raises(ValueError, match="hits must be <= queries, got hits=5, queries=4"):
        ServeMetrics("chat").add_prefix_cache(queries=4, hits=5)
    with pytest.raises(ValueError, match="queries must be an int"):
        ServeMetrics("chat").add_prefix_cache(queries=-1, hits=0)
    with pytest.raises(ValueError, match="stage"):
        TrainMetrics("r", None)


def test_serve_counters_exist_at_zero_from_the_start(monkeypatch):
    """A replica's counters are recorded at 0 when its ServeMetrics is made, as vLLM's are: hits appeared only
    at the first prefix-cache hit, so Grafana's hit rate, rate(hits) / rate(queries), had no data, not 0,
    while every query missed."""
    monkeypatch.setattr(metrics.ray, "is_initialized", lambda: True)
    recorded = []

    class Recorded:
        def __init__(self, name):
            self.name = name

        def _record(self, value, tags):
            recorded.append((self.name, value, tags))

    monkeypatch.setattr(metrics, "_metric", Recorded)
    ServeMetrics("chat")
    d = {"deployment": "chat"}
    assert recorded == [
        ("raychat_serve_generated_tokens", 0, d),
        ("raychat_prefix_cache_queries", 0, d),
        ("raychat_prefix_cache_hits", 0, d),
    ]


@pytest.fixture
def ray_with_metrics_port():
    import ray

    port = free_ports(1)[0]  # not an ephemeral port: Ray's start takes dozens of those
    init_local_ray(num_cpus=1, include_dashboard=False, _metrics_export_port=port)
    try:
        yield port
    finally:
        ray.shutdown()
        metrics._objects.clear()  # Ray metric objects belong to the session that created them


def _scrape(port: int, want: set[str], timeout_s: float = 45.0) -> dict:
    """Parse the node's Prometheus text until every family in `want` is present; {(name, labels): value}."""
    from prometheus_client.parser import text_string_to_metric_families

    deadline = time.monotonic() + timeout_s
    while True:
        body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
        samples = {}
        for family in text_string_to_metric_families(body):
            for s in family.samples:
                if "raychat" in s.name:
                    labels = {k: v for k, v in s.labels.items() if k in ("run", "stage", "deployment", "le")}
                    samples[(s.name, tuple(sorted(labels.items())))] = s.value
        if want <= {name for name, _ in samples} or time.monotonic() > deadline:
            return samples
        time.sleep(1.0)


@pytest.mark.ray
def test_metrics_reach_the_node_prometheus_endpoint(ray_with_metrics_port):
    TrainMetrics("t1", "pretrain").record(
        step=7,
        loss=3.25,
        lr=6e-4,
        tokens_per_s=4100.0,
        mfu=0.41,
        grad_norm=0.75,
        data_wait_frac=0.05,
        bpb=1.1,
    )
    rl_gauges("t1")({  # what the RL loop records each step with
        "step": 2, "reward_mean": 0.5, "pass_at_1": 0.25, "staleness_mean": 1, "sync_time_s": 0.3,
        "rollout_tokens_per_s": 900.0, "learner_wait_frac": 0.6, "zero_advantage_frac": 0.75,
        "reward_std": 0.433, "advantage_std": 0.3536, "entropy": 1.25, "response_len_mean": 13.5,
        "response_len_min": 3, "response_len_max": 24,
    })  # fmt: skip
    serve = ServeMetrics("chat")
    for ttft in (0.02, 0.2, 0.3):
        serve.observe_ttft(ttft)
    serve.observe_inter_token(0.004)
    serve.set_running(2)
    serve.set_waiting(1)
    serve.set_kv_slots_in_use(2)
    serve.add_tokens(5)
    serve.add_tokens(7)
    serve.add_prefix_cache(queries=100, hits=64)
    serve.add_prefix_cache(queries=40, hits=0)  # a miss: hits 0 is skipped (Ray counters need inc > 0)
    ServeMetrics("idle")  # a replica that has answered nothing yet
    ServeMetrics("cold").add_prefix_cache(queries=40, hits=0)  # queries, every one a miss

    # Ray's exporter prefixes `ray_`; a Counter gains `_total`; a Histogram gives _bucket/_sum/_count.
    want = {
        "ray_raychat_train_loss",
        "ray_raychat_train_bpb",
        "ray_raychat_rl_learner_wait_frac",
        "ray_raychat_rl_zero_advantage_frac",
        "ray_raychat_rl_entropy",
        "ray_raychat_rl_response_len_max",
        "ray_raychat_serve_generated_tokens_total",
        "ray_raychat_prefix_cache_queries_total",
        "ray_raychat_prefix_cache_hits_total",
        "ray_raychat_serve_ttft_seconds_count",
        "ray_raychat_serve_inter_token_seconds_count",
    }
    got = _scrape(ray_with_metrics_port, want)
    train = (("run", "t1"), ("stage", "pretrain"))
    assert got[("ray_raychat_train_step", train)] == 7
    assert got[("ray_raychat_train_loss", train)] == 3.25
    assert got[("ray_raychat_train_tokens_per_s", train)] == 4100.0
    assert got[("ray_raychat_train_mfu", train)] == 0.41
    assert got[("ray_raychat_train_grad_norm", train)] == 0.75
    assert got[("ray_raychat_train_data_wait_frac", train)] == 0.05
    assert got[("ray_raychat_train_bpb", train)] == 1.1
    rl = (("run", "t1"),)
    assert got[("ray_raychat_rl_reward_mean", rl)] == 0.5
    assert got[("ray_raychat_rl_pass_at_1", rl)] == 0.25
    assert got[("ray_raychat_rl_staleness", rl)] == 1
    assert got[("ray_raychat_rl_sync_time_seconds", rl)] == 0.3
    assert got[("ray_raychat_rl_rollout_tokens_per_s", rl)] == 900.0
    assert got[("ray_raychat_rl_learner_wait_frac", rl)] == 0.6
    assert got[("ray_raychat_rl_zero_advantage_frac", rl)] == 0.75
    assert got[("ray_raychat_rl_reward_std", rl)] == 0.433
    assert got[("ray_raychat_rl_advantage_std", rl)] == 0.3536
    assert got[("ray_raychat_rl_entropy", rl)] == 1.25
    assert got[("ray_raychat_rl_response_len_mean", rl)] == 13.5
    assert got[("ray_raychat_rl_response_len_min", rl)] == 3
    assert got[("ray_raychat_rl_response_len_max", rl)] == 24
    d = (("deployment", "chat"),)
    assert got[("ray_raychat_serve_generated_tokens_total", d)] == 12
    assert got[("ray_raychat_prefix_cache_queries_total", d)] == 140
    assert got[("ray_raychat_prefix_cache_hits_total", d)] == 64
    idle, cold = (("deployment", "idle"),), (("deployment", "cold"),)
    for name in ("serve_generated_tokens", "prefix_cache_queries", "prefix_cache_hits"):
        assert got[(f"ray_raychat_{name}_total", idle)] == 0
    assert got[("ray_raychat_prefix_cache_queries_total", cold)] == 40
    assert got[("ray_raychat_prefix_cache_hits_total", cold)] == 0  # Grafana's hit rate: 0 / rate(40) = 0
    assert got[("ray_raychat_serve_running_requests", d)] == 2
    assert got[("ray_raychat_serve_waiting_requests", d)] == 1
    assert got[("ray_raychat_serve_kv_slots_in_use", d)] == 2
    assert got[("ray_raychat_serve_ttft_seconds_count", d)] == 3
    # Ray 2.60 exports a histogram's _sum from bucket midpoints, not the exact 0.02 + 0.2 + 0.3 = 0.52:
    # (0.01 + 0.025) / 2 + (0.1 + 0.25) / 2 + (0.25 + 0.5) / 2 = 0.5675 (measured; use buckets, not _sum/_count)
    assert got[("ray_raychat_serve_ttft_seconds_sum", d)] == pytest.approx(0.5675)
    # cumulative buckets: 0.02 <= 0.025; 0.2 <= 0.25; 0.3 <= 0.5
    bucket = lambda le: got[("ray_raychat_serve_ttft_seconds_bucket", (("deployment", "chat"), ("le", le)))]  # noqa: E731
    assert [
        bucket("0.01"),
        bucket("0.025"),
        bucket("0.1"),
        bucket("0.25"),
        bucket("0.5"),
        bucket("+Inf"),
    ] == [
        0,
        1,
        1,
        2,
        3,
        3,
    ]
    assert got[("ray_raychat_serve_inter_token_seconds_count", d)] == 1
