"""Serving configurations: ServeConfig (the chat app's build_app args, `raychat serve`) and VLLMConfig (the
Ray Serve LLM config that `python -m raychat.serve.vllm` writes). Each default is stated here once;
serve/chat.yaml sets its values through build_app's args and, for the options Serve owns (replica resources,
autoscaling, request bounds), its `deployments:` section (raychat.serve.deployments maps them).
"""

from __future__ import annotations

from dataclasses import dataclass

from raychat.config.schema import ConfigError, Section, label, option, owned_choices, owned_literal, section

# the engine's KV-cache dtype option (ModelRunner kv_dtype, engine/runner.py resolve_kv_dtype): serving, raychat chat
KV_DTYPE_HELP = (
    "KV-cache dtype: model = the weights' dtype; auto = bfloat16 where the device has native bf16 math "
    "(raychat.model.fast_bf16), else float32; accuracy cost of bfloat16 vs float32: bench/results/infer_bench.md"
)


def check_replicas(section) -> None:
    """ConfigError naming both options when `section`'s min_replicas exceeds its max_replicas."""
    if section.min_replicas > section.max_replicas:
        low, high = label(type(section), "min_replicas"), label(type(section), "max_replicas")
        raise ConfigError(
            f"{low} {section.min_replicas} exceeds {high} {section.max_replicas}; need {low} <= {high}"
        )


@dataclass
class ReplicaSection(Section):
    """One ChatServer replica: KV-cache slots, streaming, where the model runs."""

    NAMING = "key"

    max_slots: int = option(
        8, "KV-cache slots per replica: sequences decoded at once (1 = one request at a time)", ge=1,
        aliases=("max_rows",),
    )  # fmt: skip
    max_len: int | None = option(None, "tokens per slot; not given: the model's max_seq_len", ge=1)
    stream_interval: int = option(
        4, "completion tokens per streamed event after the first (1 = every token)", ge=1
    )
    dtype: str = option(
        "auto", "weights and KV-cache dtype: auto = bfloat16 on CUDA, float32 on CPU; model = the "
        "checkpoint's", choices=("auto", "model", "float32", "bfloat16", "float16"),
    )  # fmt: skip
    kv_dtype: str = option(
        "model", KV_DTYPE_HELP, choices=owned_choices("raychat.engine.runner", "KV_DTYPES")
    )
    prefill_chunk_tokens: int = option(
        512, "prompt tokens prefilled per engine step at most (bounds the other streams' inter-token "
        "latency while a long prompt is prefilled)", ge=1,
    )  # fmt: skip
    prefix_cache_tokens: int | None = option(
        None, "prefix cache capacity in tokens: KV blocks of earlier prompts and replies (a conversation's "
        "history, a shared system prompt) reused instead of prefilled again; not given: 8 x max_seq_len, "
        "allocated as it fills; 0 = off", ge=0,
    )  # fmt: skip
    engine_process: bool = option(
        True, "run the model and scheduler in a child process, off the event loop's GIL"
    )
    num_cpus: float = option(1.0, "CPUs each ChatServer replica reserves", ge=0)
    num_gpus: float = option(0.0, "GPUs each ChatServer replica reserves (> 0 puts the model on cuda)", ge=0)
    torch_threads: int | None = option(
        None, "torch threads per replica; not given: the CPUs it reserved", ge=1
    )
    max_ongoing_requests: int = option(32, "requests per replica (queued at the ingress beyond it)", ge=1)
    max_queued_requests: int = option(
        64, "requests queued at each caller (an ingress replica) for a ChatServer replica beyond "
        "max_ongoing_requests; more are answered 429 with Retry-After", ge=1,
    )  # fmt: skip
    max_pending: int = option(
        32, "requests a replica's engine holds beyond its max_slots (waiting for a KV slot); more are "
        "answered 429 with Retry-After", ge=1,
    )  # fmt: skip
    request_timeout_s: float | None = option(
        300.0, "seconds a request may run (queued + generating) before it ends with a 504-status error and "
        "frees its KV slot (none = no deadline)", gt=0,
    )  # fmt: skip
    stall_timeout_s: float = option(
        60.0, "seconds without an engine step, while requests are live, after which the replica's health "
        "check fails and its open streams end with an error (Serve then replaces the replica)", gt=0,
    )  # fmt: skip
    max_replicas_per_node: int | None = option(
        None,
        "most ChatServer replicas on one node (1 = each on a node of its own); not given: no limit",
        ge=1,
    )

    def __post_init__(self):
        super().__post_init__()
        block = owned_literal("raychat.engine.prefix_cache", "BLOCK_TOKENS")
        if self.prefix_cache_tokens is not None and 0 < self.prefix_cache_tokens < block:
            raise ConfigError(
                f"{label(type(self), 'prefix_cache_tokens')} must be 0 (off) or >= {block} (one KV block of "
                f"{block} tokens), got {self.prefix_cache_tokens}"
            )


@dataclass
class AutoscalingSection(Section):
    """Ray Serve autoscaling of ChatServer (how often load is reported: RAY_SERVE_*_METRIC_PUSH_INTERVAL_S)."""

    NAMING = "key"

    min_replicas: int = option(1, "fewest ChatServer replicas", ge=0)
    max_replicas: int = option(1, "most ChatServer replicas (autoscaled)", ge=1, aliases=("replicas",))
    target_ongoing_requests: float = option(4.0, "ongoing requests per replica the autoscaler aims at", gt=0)
    upscale_delay_s: float = option(30.0, "seconds of high load before adding a replica", ge=0)
    downscale_delay_s: float = option(600.0, "seconds of low load before removing a replica", ge=0)
    look_back_period_s: float = option(30.0, "seconds of load averaged (must exceed the push interval)", gt=0)

    def __post_init__(self):
        super().__post_init__()
        check_replicas(self)


@dataclass
class ServeConfig(Section):
    """The chat application: `serve run raychat.serve.app:build_app checkpoint=DIR key=value ...`."""

    NAMING = "key"

    checkpoint: str = option(
        "", "the checkpoint (required): a checkpoint dir, a run dir or <run dir>/latest on storage every node "
        "reads (a shared directory, s3:// or gs://)",
    )  # fmt: skip
    replica: ReplicaSection = section(ReplicaSection)
    autoscaling: AutoscalingSection = section(AutoscalingSection)
    api_key: str | None = option(
        None,
        "require 'Authorization: Bearer KEY'; not given: env RAYCHAT_API_KEY, else no key (every route open), "
        "which build_app refuses without allow_unauthenticated, and raychat serve on a --host beyond loopback "
        "without --allow-unauthenticated",
    )
    allow_unauthenticated: bool = option(
        False, "serve every route without a key when neither api_key nor RAYCHAT_API_KEY gives one (else "
        "build_app refuses); raychat serve: its --allow-unauthenticated (a --host beyond loopback), and set "
        "where its --host check let no key through", flag=False,
    )  # fmt: skip
    model_id: str | None = option(
        None,
        'the model id: what /v1/models lists and OpenAI requests\' "model" names; not given: the '
        "checkpoint reference as given (a trailing '/' dropped), which stays when the run trains on",
    )
    ingress_num_cpus: float = option(0.1, "CPUs the ChatIngress replica reserves", ge=0)
    ingress_max_queued_requests: int = option(
        256, "HTTP requests queued at each Serve proxy for the ingress beyond its ongoing requests; more are "
        "answered 429 with Retry-After", ge=1,
    )  # fmt: skip
    retry_after_s: int = option(1, "seconds of the Retry-After header of a 429 (overloaded) answer", ge=1)
    health_timeout_s: float = option(
        5.0, "seconds GET /health (and the model info that /v1/models and chat requests read once) waits for a "
        "ChatServer replica's answer; then 503 with the reason (no replica running, e.g. each new one fails to "
        "start, or every one busy). A chat request waiting for a replica asks this often whether ChatServer is "
        "failing (no replica running, UNHEALTHY, DEPLOY_FAILED or a failed start): then 503 with that reason", gt=0,
    )  # fmt: skip


@dataclass
class VLLMConfig(Section):
    """One vLLM model behind Ray Serve LLM (ray.serve.llm:build_openai_app), on GPUs."""

    NAMING = "key"

    hf_dir: str = option("", "directory written by `raychat export` (required)")
    check_files: bool = option(
        True,
        "require --hf-dir to hold an export here (--no-check-files: a directory of the cluster, e.g. its PVC)",
    )
    out: str = option("vllm.yaml", "Serve config YAML file to write")
    model_id: str = option("raychat", "name the OpenAI API serves the model as")
    accelerator_type: str = option(
        "H100", "Ray accelerator resource name (H100, A100, L4, ...; empty: any GPU)", blank_ok=True
    )
    min_replicas: int = option(1, "fewest replicas", ge=0)
    max_replicas: int = option(2, "most replicas (autoscaled)", ge=1)
    target_ongoing_requests: int = option(32, "ongoing requests per replica the autoscaler aims at", ge=1)
    max_ongoing_requests: int = option(64, "requests per replica", ge=1)
    tensor_parallel_size: int = option(1, "GPUs one replica shards the model over", ge=1)
    dtype: str = option("bfloat16", "vLLM weights/activations dtype")
    gpu_memory_utilization: float = option(0.9, "fraction of GPU memory vLLM may use, in (0, 1]", gt=0, le=1)
    port: int = option(8000, "HTTP port of the Serve proxy", ge=1, le=65535)

    def __post_init__(self):
        super().__post_init__()
        check_replicas(self)
