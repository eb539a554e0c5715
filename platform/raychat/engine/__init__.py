"""Inference engine: KV cache, batched sampling, safe calculator tool, streaming text, continuous batching.

Public API (stable; the serving layer and RL rollouts build on it). Import from `raychat.engine`.

Parameters shared by every entry point
    SamplingParams(max_tokens=256, temperature=1.0, top_k=None, top_p=None, seed=None, stop=(),
                   logprobs=False, top_logprobs=0)
        frozen dataclass, validated on construction (ValueError naming the field and allowed values).
        temperature: finite, >= 0; below TEMPERATURE_EPS (1e-5) = greedy (argmax, no random draw), so
        every accepted temperature is numerically safe. top_k None/0 = off. top_p None/1.0 = off.
        seed None = fresh entropy. stop: strings; generation ends when the streamed text contains one;
        it is never emitted. max_tokens counts every completion token (sampled and forced tool-output).
        logprobs: each completion token's logprob in StreamEvent.logprobs; top_logprobs (0..20, needs
        logprobs) the most likely alternatives too. The distribution (sampling.py): log_softmax of the
        temperature-scaled logits BEFORE top-k/top-p filtering, fp32 (greedy rows: of the raw logits).

Batched generation (RL rollouts, evaluation)
    engine = ModelRunner(model, tokenizer, kv_budget_bytes=None, dtype="model", attention="auto",
                         prefill_chunk_tokens=2048, compile_decode=False, packed_linears="auto")
        dtype: "model" keeps the model's dtype (default; RL rollouts and eval pass it explicitly); "auto"
        = bfloat16 on CUDA, float32 on CPU (the serving default: ChatServer, EngineProcess, raychat chat,
        ServeConfig --dtype); or "float32" / "bfloat16" / "float16" (the model is cast in place).
        packed_linears: "auto" runs the Linears through oneDNN with weights packed once on CPU in fp32
        (engine/packed.py); after writing weights behind torch's back call engine.refresh_weights(). attention: "auto" (FlexAttention on CUDA, dense-mask SDPA on CPU) |
        "flex" | "dense", for rows of different lengths (engine/attention.py). compile_decode:
        torch.compile / CUDA graphs of the decode step for fixed row counts (GPU; off by default).
    results = engine.generate_batch(prompts: list[list[int]], num_samples=1, max_tokens=256,
                                    temperature=1.0, top_k=None, top_p=None, seed=None, stop=())
        -> list[GenerationResult], len(prompts) * num_samples, prompt-major: results[i * num_samples + j]
           is sample j of prompt i. Each prompt is prefilled once and its cache replicated to num_samples
           rows; every row samples independently from its first token on (one torch.Generator per prompt,
           seeded from (seed, prompt index)). Raises KVBudgetError (a ValueError) naming the bytes needed
           and the budget when the batch cannot fit; ValueError for an empty prompt or one that does not
           leave room for a token within model.config.max_seq_len; RuntimeError naming the row when the
           model produced non-finite logits.
    GenerationResult fields:
        prompt_index: int, sample_index: int
        tokens: list[int]        prompt + completion token ids
        mask: list[int]          same length; 1 = sampled by the model, 0 = prompt or forced (tool output)
        num_prompt_tokens: int
        completion_tokens: list[int] (property)  tokens[num_prompt_tokens:]
        text: str                decoded completion (terminal special token and stop string excluded)
        finish_reason: str       "stop" (<|assistant_end|>, <|bos|> or a stop string) | "length"
    The terminal token (<|assistant_end|> or <|bos|>) is included in `tokens` with mask 1 so RL can learn to
    stop; tokens after a stop string's last token are not generated.

Continuous batching (serving)
    sched = Scheduler(engine, max_slots=8, max_len=None, kv_budget_bytes=None, prefill_chunk_tokens=512)
        one KV cache of max_slots slots x max_len tokens (default model.config.max_seq_len); with
        kv_budget_bytes the slot count is the most that fits (KVBudgetError if not even one fits). Each
        step prefills at most prefill_chunk_tokens prompt tokens (chunked prefill) and gives every
        decoding request one token, so a long prompt delays the others by at most one chunk per token.
    stream = sched.submit(prompt: list[int], params: SamplingParams, request_id: str | None = None,
                          wake_every: int = 1)
        -> RequestStream; thread-safe; raises ValueError for a prompt that cannot fit a slot. An async
        consumer is woken by the first event, the last, and otherwise every `wake_every` events.
    sched.cancel(request_id) -> bool      thread-safe, idempotent; the slot is freed at the start of the
                                          next step (True if the request was live and not yet cancelled).
    sched.step() -> int                   one step (scheduler.py); returns the number of busy slots; never
                                          raises for a request's failure.
    sched.start() / sched.stop()          run steps in a daemon thread until stop() (serving replicas).
    sched.num_free_slots, sched.num_active, sched.num_pending   (properties)
    RequestStream:  `for ev in stream` (blocking; when no background thread runs it drives sched.step()
                    itself) or `async for ev in stream` (asyncio; needs sched.start()); stream.request_id;
                    stream.cancel().
    StreamEvent(request_id, text: str, token_ids: list[int], finished: bool, finish_reason: str | None,
                usage: Usage | None, error: str | None, logprobs: list[TokenLogprob] | None)
        text is the new delta (may be ""); the last event has finished=True, finish_reason in
        {"stop", "length", "cancelled", "timeout", "error"} and usage set ("timeout": past the scheduler's
        request_timeout_s; the slot is freed). finish_reason "error" (error holds the
        message) ends ONE request: its logits were non-finite (NaN / +inf / no finite value), its
        sampling state was invalid, its prefill forward raised (e.g. torch.OutOfMemoryError), or its
        token bookkeeping raised; every other request keeps decoding, the engine keeps running. (A
        failure of the shared decode forward ends the requests in it, nothing else.) logprobs: one
        TokenLogprob(token_id, logprob, top_logprobs: [(token_id, logprob), ...] most likely first) per
        entry of token_ids when the request set logprobs=True, else None.
    Usage(prompt_tokens, completion_tokens, ttft_s, total_s)   ttft_s: submit -> first completion token.
    Scheduler(..., max_pending=None, request_timeout_s=None, stall_timeout_s=60.0): submit raises
        QueueFullError (scheduler.py) when max_pending requests wait for a slot; `stalled` is True when the
        step thread has not stepped for stall_timeout_s with requests live.
    EngineProcess(checkpoint, device="cpu", max_slots=8, max_len=None, torch_threads=1, ...,
                  dtype="auto", attention="auto", prefill_chunk_tokens=512, compile_decode=False,
                  max_pending=None, request_timeout_s=None, stall_timeout_s=60.0)
        the same Scheduler in a child process (`python -m raychat.engine.process`), with the surface of a
        started Scheduler (submit, cancel, running, num_active, num_pending, stop): the decode step then
        does not share the caller's GIL. Serving replicas use it (serve.app's engine_process=true). A
        failing request never ends the child (same isolation as the Scheduler); cancel is True only for
        a request that is live (no final event received yet) and not cancelled before.

Lower-level ModelRunner methods (used by the Scheduler; usable for custom loops)
    engine.check_prompt(prompt) -> list[int]; engine.new_cache(batch_size, max_len, budget_bytes=None)
    engine.forward_rows(cache, start, pieces: list[list[int]]) -> (len(pieces), V) fp32 logits at each
        row's last new token; appends pieces[i] to row start+i (consecutive rows, in place, one forward).
    engine.prefill(cache, rows, prompts) -> (len(rows), V) fp32 logits at each prompt's last token
    engine.decode(cache, rows, token_ids) -> (len(rows), V) fp32 next-token logits (one token per row)
    derive_seed(seed, i) (runner.py): prompt i's generator seed within a generate_batch call.

Building blocks
    KVCache(n_layer, batch_size, n_kv_head, max_len, head_dim, dtype=float32, device="cpu")
        .k, .v: (n_layer, B, n_kv_head, max_len, head_dim); .lengths: (B,) int64 (host) tokens per row
        KVCache.for_model(config, batch_size, max_len, dtype, device, budget_bytes=None)
        KVCache.bytes_per_token(config, dtype) -> int  (2 * n_layer * n_kv_head * head_dim * itemsize)
        KVCache.rows_for_budget(config, budget_bytes, max_len, dtype) -> int
        .batch(start, B, T) -> attention.CacheBatch, passed as the model's `kv_cache`
        .replicate(src_row, dst_rows), .move_row(src, dst), .compact(busy_rows) -> {old: new},
        .reset_rows(rows), .attention_mask(rows, T) -> (B',1,T,S) bool (the dense reference)
    KVBudgetError(ValueError)
    sample_next(logits (n, V), temperature, top_k, top_p, generator) -> (n,) int64   [sampling.py]
    SamplingBatch (sampling.py): per-row parameters, one sample() per step; filter_logits(logits, top_k,
    top_p); TEMPERATURE_EPS; RowState (sequence.py): per-row tool/stop state.
    make_generator(seed, device) -> torch.Generator
    calculate(expression: str) -> str | None; evaluate(expression) -> int | float | None   [calculator.py]
    StreamDecoder(tokenizer, stop=()): push(token_id) -> str delta; finish() -> str; .text; .offset;
        .stopped; .stop_string   [detokenize.py]

`raychat chat --checkpoint DIR [-p PROMPT] [--temperature T --top-k K --top-p P --max-tokens N --seed S]`
streams replies rendered with raychat.chat_template.render_for_completion.
"""

from raychat.engine.calculator import calculate, evaluate
from raychat.engine.detokenize import StreamDecoder
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
    "calculate",
    "evaluate",
    "make_generator",
    "sample_next",
]
