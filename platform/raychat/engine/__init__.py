"""Inference engine (API: docs/engine.md): KV cache, sampling, ModelRunner, Scheduler, EngineProcess."""

from raychat.engine.detokenize import StreamDecoder, stop_strings
from raychat.engine.kv_cache import KVBudgetError, KVCache
from raychat.engine.runner import GenerationResult, ModelRunner, SamplingParams
from raychat.engine.sampling import TEMPERATURE_EPS, SamplingBatch, make_generator, sample_next
from raychat.engine.scheduler import Scheduler
from raychat.engine.stream import RequestStream, StreamEvent, TokenLogprob, Usage

__all__ = [
    "ModelRunner",
    "GenerationResult",
    "KVBudgetError",
    "KVCache",
    "RequestStream",
    "SamplingBatch",
    "SamplingParams",
    "Scheduler",
    "StreamDecoder",
    "StreamEvent",
    "TEMPERATURE_EPS",
    "TokenLogprob",
    "Usage",
    "make_generator",
    "sample_next",
    "stop_strings",
]
