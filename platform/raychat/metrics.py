"""raychat's own metrics, exported through `ray.util.metrics` to the Ray dashboard and Prometheus.

Every metric name starts with `raychat_`. Ray's Prometheus endpoint (each node's metrics export port, and the
dashboard) adds its own `ray_` prefix, so `raychat_train_loss` is scraped as `ray_raychat_train_loss`, and a
Counter gains Prometheus' `_total` suffix (`ray_raychat_serve_generated_tokens_total`). Histograms expose
`_bucket`, `_sum` and `_count` series; Ray 2.60 computes `_sum` from bucket midpoints (checked by
tests/ray/test_metrics.py), so quantiles come from the buckets and `_sum / _count` is only approximate.

Metrics (tags in brackets; units in the name or below):
  training   [run, stage]   raychat_train_step, raychat_train_loss (nats/token), raychat_train_lr,
                            raychat_train_tokens_per_s, raychat_train_mfu (0..1), raychat_train_grad_norm
                            (global L2 norm before clipping), raychat_train_data_wait_frac (0..1 of step
                            wall time spent waiting for data), raychat_train_bpb (bits per byte)
  RL         [run]          raychat_rl_step, raychat_rl_reward_mean, raychat_rl_pass_at_1 (0..1),
                            raychat_rl_staleness (policy versions between the rollout's weights and the
                            learner's), raychat_rl_sync_time_seconds, raychat_rl_rollout_tokens_per_s,
                            raychat_rl_learner_wait_frac (0..1), raychat_rl_zero_advantage_frac (0..1
                            of the step's prompts whose samples all got the same reward: no signal),
                            raychat_rl_reward_std and raychat_rl_advantage_std (population stds over the
                            step's samples), raychat_rl_entropy (the policy's, nats a sampled token),
                            raychat_rl_response_len_mean / _min / _max (completion tokens a sample)
  serving    [deployment]   raychat_serve_ttft_seconds (histogram: time to first token),
                            raychat_serve_inter_token_seconds (histogram), raychat_serve_running_requests,
                            raychat_serve_waiting_requests, raychat_serve_kv_slots_in_use,
                            raychat_serve_generated_tokens (counter; tokens/s = rate() of it),
                            raychat_prefix_cache_queries / raychat_prefix_cache_hits (counters, prompt
                            tokens looked up / served from the prefix cache, as vLLM's; hit rate =
                            rate(hits) / rate(queries)); the serving counters exist at 0 from the
                            replica's start

Recording is a no-op while Ray is not initialized in this process (`ray.is_initialized()` is False), so the
same trainer or engine code runs in plain unit tests; the Ray metric objects are created once per process, on
the first record after `ray.init`. Invalid values raise ValueError naming the field, whether Ray runs or not.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Sequence

import ray
from ray.util import metrics as rm

# Bucket upper bounds in seconds (Prometheus `le`), spaced roughly x2-x2.5 as in Prometheus' default buckets.
TTFT_BUCKETS_S = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
INTER_TOKEN_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0)

# name -> (kind, description, tag keys, histogram boundaries or None)
_SPECS: dict[str, tuple[str, str, tuple[str, ...], Sequence[float] | None]] = {}


def _spec(name: str, kind: str, description: str, tags: tuple[str, ...], buckets=None) -> str:
    _SPECS[name] = (kind, description, tags, buckets)
    return name


_TRAIN = ("run", "stage")
TRAIN_STEP = _spec("raychat_train_step", "gauge", "Last optimizer step recorded.", _TRAIN)
TRAIN_LOSS = _spec("raychat_train_loss", "gauge", "Training loss, nats per target token.", _TRAIN)
TRAIN_LR = _spec("raychat_train_lr", "gauge", "Learning rate of the step.", _TRAIN)
TRAIN_TOKENS_PER_S = _spec("raychat_train_tokens_per_s", "gauge", "Training tokens per second.", _TRAIN)
TRAIN_MFU = _spec("raychat_train_mfu", "gauge", "Model FLOPs utilization, 0..1.", _TRAIN)
TRAIN_GRAD_NORM = _spec(
    "raychat_train_grad_norm", "gauge", "Global gradient L2 norm before clipping.", _TRAIN
)
TRAIN_DATA_WAIT = _spec(
    "raychat_train_data_wait_frac", "gauge", "Fraction of step time waiting for data, 0..1.", _TRAIN
)
TRAIN_BPB = _spec("raychat_train_bpb", "gauge", "Validation bits per byte.", _TRAIN)

_RL = ("run",)
RL_STEP = _spec("raychat_rl_step", "gauge", "Last RL learner step recorded.", _RL)
RL_REWARD = _spec("raychat_rl_reward_mean", "gauge", "Mean rollout reward of the step.", _RL)
RL_PASS_AT_1 = _spec("raychat_rl_pass_at_1", "gauge", "pass@1 of the step's rollouts, 0..1.", _RL)
RL_STALENESS = _spec(
    "raychat_rl_staleness", "gauge", "Policy versions between rollout weights and learner weights.", _RL
)
RL_SYNC_TIME = _spec("raychat_rl_sync_time_seconds", "gauge", "Weight sync time to rollout actors.", _RL)
RL_ROLLOUT_TPS = _spec(
    "raychat_rl_rollout_tokens_per_s", "gauge", "Rollout tokens generated per second.", _RL
)
RL_LEARNER_WAIT = _spec(
    "raychat_rl_learner_wait_frac", "gauge", "Fraction of learner time waiting for rollouts, 0..1.", _RL
)
RL_ZERO_ADVANTAGE = _spec(
    "raychat_rl_zero_advantage_frac",
    "gauge",
    "Fraction of the step's prompts whose samples all got the same reward (no learning signal), 0..1.",
    _RL,
)
RL_REWARD_STD = _spec("raychat_rl_reward_std", "gauge", "Population std of the step's rollout rewards.", _RL)
RL_ADVANTAGE_STD = _spec(
    "raychat_rl_advantage_std", "gauge", "Population std of the step's advantages (learning signal).", _RL
)
RL_ENTROPY = _spec(
    "raychat_rl_entropy", "gauge", "Policy entropy before the update, nats per sampled token.", _RL
)
RL_RESPONSE_LEN_MEAN = _spec(
    "raychat_rl_response_len_mean", "gauge", "Mean completion tokens of the step's samples.", _RL
)
RL_RESPONSE_LEN_MIN = _spec(
    "raychat_rl_response_len_min", "gauge", "Fewest completion tokens of a step's sample.", _RL
)
RL_RESPONSE_LEN_MAX = _spec(
    "raychat_rl_response_len_max", "gauge", "Most completion tokens of a step's sample.", _RL
)

_SERVE = ("deployment",)
SERVE_TTFT = _spec(
    "raychat_serve_ttft_seconds", "histogram", "Time to first token, seconds.", _SERVE, TTFT_BUCKETS_S
)
SERVE_INTER_TOKEN = _spec(
    "raychat_serve_inter_token_seconds",
    "histogram",
    "Time between consecutive streamed deltas divided by the tokens the later one carries, seconds.",
    _SERVE,
    INTER_TOKEN_BUCKETS_S,
)
SERVE_RUNNING = _spec("raychat_serve_running_requests", "gauge", "Requests being decoded.", _SERVE)
SERVE_WAITING = _spec("raychat_serve_waiting_requests", "gauge", "Requests queued for a slot.", _SERVE)
SERVE_KV_SLOTS = _spec("raychat_serve_kv_slots_in_use", "gauge", "KV-cache rows (sequences) in use.", _SERVE)
SERVE_TOKENS = _spec(
    "raychat_serve_generated_tokens", "counter", "Tokens generated (rate() = tokens/s).", _SERVE
)
PREFIX_CACHE_QUERIES = _spec(
    "raychat_prefix_cache_queries", "counter", "Prompt tokens looked up in the prefix cache.", _SERVE
)
PREFIX_CACHE_HITS = _spec(
    "raychat_prefix_cache_hits",
    "counter",
    "Prompt tokens served from the prefix cache (not prefilled).",
    _SERVE,
)

METRIC_NAMES: tuple[str, ...] = tuple(_SPECS)

_lock = threading.Lock()
_objects: dict[str, object] = {}


def _metric(name: str):
    """The process-wide Ray metric object for `name`, created on first use (Ray must be initialized)."""
    obj = _objects.get(name)
    if obj is None:
        with _lock:
            obj = _objects.get(name)
            if obj is None:
                kind, description, tags, buckets = _SPECS[name]
                if kind == "gauge":
                    obj = rm.Gauge(name, description=description, tag_keys=tags)
                elif kind == "counter":
                    obj = rm.Counter(name, description=description, tag_keys=tags)
                else:
                    obj = rm.Histogram(name, description=description, boundaries=list(buckets), tag_keys=tags)
                _objects[name] = obj
    return obj


def _number(
    field: str, value, lo: float | None = None, hi: float | None = None, finite: bool = True
) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{field} must be a number, got {value!r}")
    value = float(value)
    if finite and not math.isfinite(value):
        raise ValueError(f"{field} must be finite, got {value!r}")
    if lo is not None and value < lo:
        raise ValueError(f"{field} must be >= {lo}, got {value!r}")
    if hi is not None and value > hi:
        raise ValueError(f"{field} must be <= {hi}, got {value!r}")
    return value


def _step(value) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"step must be an int >= 0, got {value!r}")
    return value


def _label(field: str, value) -> str:
    if not isinstance(value, str) or not value:
        raise ValueError(f"{field} must be a non-empty string, got {value!r}")
    return value


class _Recorder:
    def __init__(self, tags: dict[str, str]):
        self.tags = tags

    def _emit(self, values: dict[str, float | None]) -> None:
        if not ray.is_initialized():
            return
        for name, value in values.items():
            if value is None:
                continue
            kind = _SPECS[name][0]
            m = _metric(name)
            if kind == "gauge":
                m.set(value, tags=self.tags)
            elif kind == "counter":
                m.inc(value, tags=self.tags)
            else:
                m.observe(value, tags=self.tags)


class TrainMetrics(_Recorder):
    """Pretraining / SFT step metrics, tagged run=<run>, stage=<stage> (e.g. "pretrain", "sft")."""

    def __init__(self, run: str, stage: str):
        super().__init__({"run": _label("run", run), "stage": _label("stage", stage)})

    def record(
        self,
        step: int,
        loss: float,
        lr: float,
        tokens_per_s: float,
        mfu: float | None,
        grad_norm: float,
        data_wait_frac: float,
        bpb: float | None = None,
    ) -> None:
        """Record one optimizer step. loss may be NaN/inf (a diverged run should show as such); mfu and bpb
        may be None (not measured: the gauge keeps its previous value). Raises ValueError on a negative rate,
        a fraction outside [0, 1] or a non-number."""
        self._emit(
            {
                TRAIN_STEP: _step(step),
                TRAIN_LOSS: _number("loss", loss, finite=False),
                TRAIN_LR: _number("lr", lr, lo=0.0),
                TRAIN_TOKENS_PER_S: _number("tokens_per_s", tokens_per_s, lo=0.0),
                TRAIN_MFU: None if mfu is None else _number("mfu", mfu, lo=0.0),
                TRAIN_GRAD_NORM: _number("grad_norm", grad_norm, lo=0.0, finite=False),
                TRAIN_DATA_WAIT: _number("data_wait_frac", data_wait_frac, lo=0.0, hi=1.0),
                TRAIN_BPB: None if bpb is None else _number("bpb", bpb, lo=0.0),
            }
        )


class RLMetrics(_Recorder):
    """RL learner-step metrics, tagged run=<run>."""

    def __init__(self, run: str):
        super().__init__({"run": _label("run", run)})

    def record(
        self,
        step: int,
        reward_mean: float,
        pass_at_1: float | None = None,
        staleness: float | None = None,
        sync_time_s: float | None = None,
        rollout_tokens_per_s: float | None = None,
        learner_wait_frac: float | None = None,
        zero_advantage_frac: float | None = None,
        reward_std: float | None = None,
        advantage_std: float | None = None,
        entropy: float | None = None,
        response_len_mean: float | None = None,
        response_len_min: int | None = None,
        response_len_max: int | None = None,
    ) -> None:
        """Record one learner step; None leaves that gauge unchanged. entropy (nats a sampled token) may be
        NaN/inf, as the loss may. Raises ValueError on out-of-range values (pass_at_1, learner_wait_frac and
        zero_advantage_frac in [0, 1]; staleness, sync_time_s, rollout_tokens_per_s, the stds, entropy and the
        response lengths (completion tokens) >= 0)."""
        opt = lambda field, v, **kw: None if v is None else _number(field, v, **kw)  # noqa: E731
        self._emit(
            {
                RL_STEP: _step(step),
                RL_REWARD: _number("reward_mean", reward_mean),
                RL_PASS_AT_1: opt("pass_at_1", pass_at_1, lo=0.0, hi=1.0),
                RL_STALENESS: opt("staleness", staleness, lo=0.0),
                RL_SYNC_TIME: opt("sync_time_s", sync_time_s, lo=0.0),
                RL_ROLLOUT_TPS: opt("rollout_tokens_per_s", rollout_tokens_per_s, lo=0.0),
                RL_LEARNER_WAIT: opt("learner_wait_frac", learner_wait_frac, lo=0.0, hi=1.0),
                RL_ZERO_ADVANTAGE: opt("zero_advantage_frac", zero_advantage_frac, lo=0.0, hi=1.0),
                RL_REWARD_STD: opt("reward_std", reward_std, lo=0.0),
                RL_ADVANTAGE_STD: opt("advantage_std", advantage_std, lo=0.0),
                RL_ENTROPY: opt("entropy", entropy, lo=0.0, finite=False),
                RL_RESPONSE_LEN_MEAN: opt("response_len_mean", response_len_mean, lo=0.0),
                RL_RESPONSE_LEN_MIN: opt("response_len_min", response_len_min, lo=0.0),
                RL_RESPONSE_LEN_MAX: opt("response_len_max", response_len_max, lo=0.0),
            }
        )


SERVE_COUNTERS = (SERVE_TOKENS, PREFIX_CACHE_QUERIES, PREFIX_CACHE_HITS)


class ServeMetrics(_Recorder):
    """Serving metrics of one deployment (tagged deployment=<deployment>); make it in the replica, whose
    counters (SERVE_COUNTERS) it records at 0 at once, as vLLM's exist from its start: a hit rate of 0 hits
    over N queries is then 0, not "no data"."""

    def __init__(self, deployment: str):
        super().__init__({"deployment": _label("deployment", deployment)})
        if ray.is_initialized():
            for name in SERVE_COUNTERS:
                # Counter.inc refuses 0; _record is the call inc makes after that check
                _metric(name)._record(0, tags=self.tags)

    def observe_ttft(self, seconds: float) -> None:
        """Time from request arrival to the first streamed token, seconds >= 0."""
        self._emit({SERVE_TTFT: _number("seconds", seconds, lo=0.0)})

    def observe_inter_token(self, seconds: float) -> None:
        """Per-token time between two consecutive streamed deltas of one request (gap / tokens), seconds >= 0."""
        self._emit({SERVE_INTER_TOKEN: _number("seconds", seconds, lo=0.0)})

    def set_running(self, n: int) -> None:
        self._emit({SERVE_RUNNING: _count("n", n)})

    def set_waiting(self, n: int) -> None:
        self._emit({SERVE_WAITING: _count("n", n)})

    def set_kv_slots_in_use(self, n: int) -> None:
        self._emit({SERVE_KV_SLOTS: _count("n", n)})

    def add_tokens(self, n: int) -> None:
        """Add n generated tokens to the counter (n >= 0; 0 is skipped: Ray counters need a positive inc)."""
        n = _count("n", n)
        if n:
            self._emit({SERVE_TOKENS: n})

    def add_prefix_cache(self, queries: int, hits: int) -> None:
        """Count one request's prompt: `queries` tokens looked up, `hits` of them served from the prefix
        cache (ints, 0 <= hits <= queries; ValueError otherwise). Zeros are skipped (Ray counters)."""
        queries, hits = _count("queries", queries), _count("hits", hits)
        if hits > queries:
            raise ValueError(f"hits must be <= queries, got hits={hits}, queries={queries}")
        self._emit({PREFIX_CACHE_QUERIES: queries or None, PREFIX_CACHE_HITS: hits or None})


def _count(field: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{field} must be an int >= 0, got {value!r}")
    return value
