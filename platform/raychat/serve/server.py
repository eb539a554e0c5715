"""One engine replica's logic: render with the ONE chat template, run the continuous-batching Scheduler,
stream event dicts, free the row when the consumer leaves. Plain Python (the Ray Serve deployment in
raychat.serve.app wraps it), so tests can drive it in-process.

`ChatServer.generate(request)` takes the ingress' engine request:
  {"messages": template messages (raychat.chat_template), "temperature", "top_k", "top_p", "max_tokens"
   (None = until the row is full), "max_tokens_param" (the field max_tokens came in, named by its error),
   "seed", "stop": [str], "logprobs": bool, "top_logprobs": int,
   "client_tools": bool (stop right after a calculator call: the client runs it; docs/openai.md)}
(or the "prompt" form of POST /v1/completions: raychat.serve.completion_server has its request and events)
and yields (the completion read by raychat.chat.turn.TurnParser, so no control-token text is ever sent):
  {"type": "delta", "text": str, "tokens": int, "logprobs": [dict] | None}
                                 visible text (may be "": tokens that showed nothing yet, e.g. inside a call);
                                 `tokens` completion tokens since the previous delta (stream_interval);
                                 logprobs of its text tokens in OpenAI's shape when asked (each with the
                                 delta its text starts in: none for a stop string's tokens)
  {"type": "tool_call", "id": "call_...", "expression": str}      a closed calculator call
  {"type": "tool_result", "id": "call_...", "output": str}        the calculator's output for that call
  {"type": "done", "finish_reason": "stop"|"length"|"tool_calls", "usage": {prompt_tokens,
   completion_tokens, total_tokens, ttft_s, cached_tokens}}       last event of a success (cached_tokens:
                                 prompt tokens served by the prefix cache)
  {"type": "error", "status": 400|429|500|503|504, "message": str, "param": str|None, "code": str (optional:
   "context_length_exceeded" for a conversation that leaves no room for a reply, param "messages", or for
   its max_tokens: prompt + max_tokens > max_len, param "max_tokens_param"; both before the engine sees it,
   in one voice: "the conversation has 40 tokens, but the model's context length is 32 tokens and ...")
   [, "retry_after": seconds]}   first and only event of a rejected request (400; 429 with retry_after when
                                 the engine's queue is full (max_pending); 503 while the engine process is
                                 down), or last event of a failed one (500; 503 when the engine process died
                                 or stalled under it; 504 when it ran past request_timeout_s)
`ChatServer.check(requests)` answers, without submitting anything, the 400 event generate() would give the
first of a request's choices (or of a completions batch's prompts) that it refuses, or None: the ingress asks
it before opening any of them, so one bad prompt of a batch costs the engine nothing.
In-flight accounting: `in_flight` counts generate() calls between entry and exit (success, rejection,
error, cancellation alike); it returns to 0 when every consumer has finished or left.
"""

from __future__ import annotations

import asyncio
import os
import time
import uuid
from collections.abc import AsyncIterator

from raychat.chat.turn import TurnParser
from raychat.chat_template import MARKERS, TEMPLATE_VERSION, render_for_completion
from raychat.checkpoint import load_model, read_meta
from raychat.checkpoint_manager import IN_USE_MARK_S, CheckpointError, read_commit, resolve_checkpoint
from raychat.engine import ModelRunner, SamplingParams, Scheduler
from raychat.engine.process import EngineProcess
from raychat.engine.scheduler import QueueFullError, prompt_overflow
from raychat.metrics import ServeMetrics
from raychat.serve.completion_server import checked_prompt, completion_events
from raychat.serve.engine_adapter import LogprobGate, check_max_tokens, sampling_params, text_logprobs
from raychat.serve.errors import ContextLengthError, ParamError, refusal
from raychat.serve.in_use import MarkInUse
from raychat.serve.sse import usage_dict
from raychat.storage import is_remote
from raychat.tokenizer import Tokenizer

GAUGE_PERIOD_S = 0.5  # seconds between two publications of the gauges while requests live


def default_model_id(checkpoint: str | os.PathLike) -> str:
    """The model id a checkpoint is served under unless one is given: the reference as given (a run dir,
    <run dir>/latest, a checkpoint dir, an s3:// or gs:// URI; relative stays relative), without surrounding
    blanks and trailing '/' (a bare "/" stays). Like vLLM's default served_model_name (its model argument), it
    stays the same while a run dir served again resolves to a newer checkpoint; OpenAI's API takes any
    string as a model id ("org/model" is common)."""
    text = str(checkpoint).strip()
    return text.rstrip("/") or text


def committed_at(checkpoint: str | os.PathLike) -> int | None:
    """The Unix time, whole seconds, the local checkpoint was committed (its commit marker's committed_at); None
    for a marker without it, or none that can be read (loading the checkpoint names what is wrong with it)."""
    try:
        when = read_commit(checkpoint).get("committed_at")
    except CheckpointError:
        return None
    return int(when) if isinstance(when, (int, float)) else None


class ChatServer:
    """A Scheduler (started in a daemon thread) over a model and tokenizer.

    Args:
        model, tokenizer: a raychat GPT (eval mode) and Tokenizer.
        max_slots: concurrent decode rows of the KV cache (1 = one request at a time).
        max_len: tokens per row (prompt + completion), default model.config.max_seq_len.
        model_id: the name reported by /v1/models and in each response's "model" (default_model_id).
        deployment: tag of the serving metrics (raychat_serve_*{deployment=...}).
        meta: checkpoint meta (its "tokenizer_version" and "step" are reported by info()).
        created: the Unix time, whole seconds, the served checkpoint was committed (from_checkpoint: its
            commit marker's committed_at), reported by info() as the model card's "created"; None: unknown.
        scheduler: run requests on this (an EngineProcess, see from_checkpoint) instead of a Scheduler
            built over `model` (then model, max_slots and max_len are ignored).
        stream_interval: completion tokens per delta event after the first (>= 1). The first delta is sent
            at once (TTFT is unchanged) and the last one when the request finishes; in between, tokens are
            buffered until `stream_interval` of them are ready, so each event carries that many. Every
            event crosses two Ray hops and one HTTP write, so under load this per-token transport cost is
            what bounds a small model's throughput; 1 streams every token. (SGLang's --stream-interval is
            the same knob.)
        dtype: weights and KV cache of the ModelRunner (engine/runner.py resolve_dtype): "auto" (default)
            = bfloat16 on CUDA, float32 on CPU; "model" keeps the checkpoint's; "float32" / "bfloat16" /
            "float16". The model is cast in place.
        prefill_chunk_tokens: prompt tokens prefilled per scheduler step at most (chunked prefill, >= 1).
        prefix_cache_tokens: the ModelRunner's prefix-cache capacity (engine/prefix_cache.py): "auto"
            (default), a token count >= 16, or 0 = off. Each request's prompt tokens, and those the cache
            served, are counted at its first token (count_first_token: raychat_prefix_cache_queries / _hits).
        kv_dtype: the ModelRunner's KV-cache dtype (engine/runner.py resolve_kv_dtype): "model" (default)
            = the weights' (`dtype`); "auto" = bfloat16 where the device has native bf16 math
            (raychat.model.fast_bf16), else float32; or "float32" / "bfloat16" / "float16". Accuracy cost of
            bfloat16 vs float32: bench/results/infer_bench.md.
        max_pending, request_timeout_s, stall_timeout_s: the Scheduler's queue bound, per-request deadline
            and stall limit (engine/scheduler.py; ignored with `scheduler`, which has its own).
        retry_after_s: seconds a 429 answer (the engine's queue is full) asks the client to wait (>= 1).
    Raises:
        ValueError: stream_interval or retry_after_s < 1, or invalid ModelRunner / Scheduler arguments
            (dtype, kv_dtype, prefill_chunk_tokens, max_slots, max_len, max_pending, request_timeout_s,
            stall_timeout_s).
    """

    def __init__(
        self,
        model,
        tokenizer,
        max_slots: int = 8,
        max_len: int | None = None,
        model_id: str = "raychat",
        deployment: str = "ChatServer",
        meta: dict | None = None,
        stream_interval: int = 1,
        scheduler=None,
        dtype: str = "auto",
        prefill_chunk_tokens: int = 512,
        max_pending: int | None = None,
        request_timeout_s: float | None = None,
        stall_timeout_s: float = 60.0,
        retry_after_s: int = 1,
        prefix_cache_tokens="auto",
        kv_dtype: str = "model",
        created: int | None = None,
    ):
        if not isinstance(stream_interval, int) or stream_interval < 1:
            raise ValueError(f"stream_interval must be an int >= 1, got {stream_interval!r}")
        if not isinstance(retry_after_s, int) or retry_after_s < 1:
            raise ValueError(f"retry_after_s must be an int >= 1, got {retry_after_s!r}")
        self.stream_interval, self.retry_after_s = stream_interval, retry_after_s
        self.tokenizer = tokenizer
        self.model_id = model_id
        self.meta = meta or {}
        self.created = created
        if scheduler is None:
            runner = ModelRunner(
                model, tokenizer, dtype=dtype, prefix_cache_tokens=prefix_cache_tokens, kv_dtype=kv_dtype
            )
            limits = {"max_pending": max_pending, "request_timeout_s": request_timeout_s}
            limits["stall_timeout_s"] = stall_timeout_s
            scheduler = Scheduler(
                runner,
                max_slots=max_slots,
                max_len=max_len,
                prefill_chunk_tokens=prefill_chunk_tokens,
                **limits,
            )
        self.scheduler = scheduler
        self.scheduler.start()
        self.metrics = ServeMetrics(deployment)
        self.in_flight = 0
        self.completed = 0
        self.cancelled = 0
        self.rejected = 0
        self._gauges: asyncio.Task | None = None  # the task of _publish_until_idle, while one runs
        self.in_use: MarkInUse | None = None  # from_checkpoint: the marker of a remote checkpoint's copy

    @classmethod
    def from_checkpoint(
        cls,
        checkpoint: str | os.PathLike,
        device: str = "cpu",
        engine_process: bool = False,
        torch_threads: int = 1,
        **kwargs,
    ) -> ChatServer:
        """Load a raychat checkpoint directory (raychat.checkpoint.load_model) onto `device`. An s3:// or gs://
        checkpoint is fetched once into this node's cache (raychat.checkpoint_manager.resolve_checkpoint) and
        everything, a restarted engine process included, loads that copy, which the server marks in use every
        IN_USE_MARK_S until shutdown (`in_use`, raychat.serve.in_use), so that a later resolve of a new
        commit of that checkpoint keeps it (remove_unused_versions deletes copies unmarked for a day).

        engine_process=True runs the model and Scheduler in a child process (raychat.engine.process,
        with `torch_threads` torch threads) so the decode step does not share this process' GIL with
        the event loop; only the tokenizer is loaded here. The model id (not in kwargs): `checkpoint` as
        given (default_model_id), not the cache copy's name.
        Raises CheckpointError / ValueError / OSError as resolve_checkpoint and load_model.
        """
        kwargs.setdefault("model_id", default_model_id(checkpoint))
        copy = None
        if is_remote(checkpoint):
            checkpoint = copy = resolve_checkpoint(checkpoint)
        if not engine_process:
            model, tokenizer, meta = load_model(checkpoint, device=device)
            server = cls(model, tokenizer, meta=meta, created=committed_at(checkpoint), **kwargs)
        else:
            rows, max_len = kwargs.pop("max_slots", 8), kwargs.pop("max_len", None)
            names = ("dtype", "prefill_chunk_tokens", "max_pending", "request_timeout_s", "stall_timeout_s")
            names += ("prefix_cache_tokens", "kv_dtype")
            engine = {k: kwargs.pop(k) for k in names if k in kwargs}
            scheduler = EngineProcess(checkpoint, device, rows, max_len, torch_threads, **engine)
            meta = read_meta(checkpoint)
            created = committed_at(checkpoint)
            server = cls(
                None, Tokenizer.load(checkpoint), meta=meta, scheduler=scheduler, created=created, **kwargs
            )
        if copy is not None:
            server.in_use = MarkInUse(str(copy), IN_USE_MARK_S)
        return server

    def info(self) -> dict:
        return {
            "model_id": self.model_id,
            "template_version": TEMPLATE_VERSION,
            "tokenizer_version": self.tokenizer.version,
            "max_seq_len": self.scheduler.max_len,
            "max_slots": self.scheduler.max_slots,
            "stream_interval": self.stream_interval,
            "step": self.meta.get("step"),
            "created": self.created,
        }

    def stats(self) -> dict:
        """Counters of this replica: in_flight, running (rows decoding), waiting (queued), completed,
        cancelled, rejected, free_rows, max_slots, and engine_running (False while an engine process is
        down)."""
        s = self.scheduler
        return {
            "engine_running": s.running,
            "in_flight": self.in_flight,
            "running": s.num_active,
            "waiting": s.num_pending,
            "free_rows": s.num_free_slots,
            "max_slots": s.max_slots,
            "completed": self.completed,
            "cancelled": self.cancelled,
            "rejected": self.rejected,
        }

    def check_health(self) -> None:
        """Raise RuntimeError when the engine cannot make progress: its scheduler stopped (and is not
        restarting), or it has not stepped for stall_timeout_s while requests are live (a Serve replica's
        health check; Ray Serve then replaces the replica)."""
        s = self.scheduler
        if not s.running and not s.restarting:
            raise RuntimeError(f"engine stopped: {s.last_error}")
        if s.stalled:
            raise RuntimeError(
                f"engine stalled: no step for {s.stalled_s:.1f} s with requests live "
                f"(stall_timeout_s={s.stall_timeout_s:g})"
            )

    def _publish_gauges(self) -> None:
        s = self.scheduler
        self.metrics.set_running(s.num_active)
        self.metrics.set_waiting(s.num_pending)
        self.metrics.set_kv_slots_in_use(s.num_active)

    def _watch_gauges(self) -> None:
        """Keep the running / waiting / KV-slot gauges true while requests live (_publish_until_idle in a task
        of the running loop, one at a time): a request's submit and end alone miss its admission, and a
        cancelled request leaves the engine at its next step, after its consumer has gone."""
        if self._gauges is None or self._gauges.done():
            self._gauges = asyncio.get_running_loop().create_task(self._publish_until_idle())

    async def _publish_until_idle(self) -> None:
        """Publish the gauges every GAUGE_PERIOD_S until no request is in flight and the engine holds none
        (or has stopped), then once more: the idle gauges read 0."""
        s = self.scheduler
        while True:
            self._publish_gauges()
            idle = self.in_flight == 0 and s.num_active == 0 and s.num_pending == 0
            if idle or not (s.running or s.restarting):
                return
            await asyncio.sleep(GAUGE_PERIOD_S)

    async def generate(self, request: dict) -> AsyncIterator[dict]:
        """Stream the reply to `request` (see the module doc for the events); never raises for bad input.
        A request with "prompt" instead of "messages" is a raw completion (raychat.serve.completion_server)."""
        self._watch_gauges()
        if "prompt" in request:
            self.in_flight += 1
            try:
                async for event in completion_events(self, request):
                    yield event
            finally:
                self.in_flight -= 1
            return
        self.in_flight += 1
        stream = None
        finished = False
        try:
            param = None  # a sampling parameter's error names no field
            try:
                prompt, params = self._chat_prompt(request)
                param = "messages"  # from here on, errors are about the conversation
                stream = self.scheduler.submit(prompt, params, wake_every=self.stream_interval)
            except ValueError as e:
                self.rejected += 1
                yield refusal(e, param)
                return
            except QueueFullError as e:  # overloaded: retry after retry_after_s
                self.rejected += 1
                yield {"type": "error", "status": 429, "message": str(e), "param": None,
                       "retry_after": self.retry_after_s}  # fmt: skip
                return
            except (RuntimeError, OSError) as e:  # the engine process is down (being replaced): retry later
                self.rejected += 1
                yield {"type": "error", "status": 503, "message": f"engine unavailable: {e}", "param": None}
                return
            self._publish_gauges()
            async for event in self._events(stream, request):
                if event["type"] in ("done", "error"):
                    finished = True
                yield event
            finished = True
        finally:
            if stream is not None and not finished:
                self.cancelled += 1
                try:
                    stream.cancel()  # the consumer left (GeneratorExit / CancelledError): free the row
                except OSError:  # the engine process died under it: its rows are gone with it
                    pass
            self.in_flight -= 1

    def _chat_prompt(self, request: dict) -> tuple[list[int], SamplingParams]:
        """The prompt tokens and SamplingParams of a chat request, checked as far as they can be before the
        engine sees it.

        Raises:
            ValueError: SamplingParams' own checks (no field named); ParamError("messages"): the template
                refuses the conversation; ContextLengthError: the conversation leaves no room for a reply
                (param "messages": OpenAI's code, on which clients drop earlier messages), or for its
                max_tokens (param: request["max_tokens_param"]).
        """
        max_len = self.scheduler.max_len
        params = sampling_params(request, max_len)
        try:
            prompt = render_for_completion(self.tokenizer, request["messages"])
        except ValueError as e:
            raise ParamError("messages", str(e)) from None
        why = prompt_overflow(len(prompt), max_len, "the conversation")
        if why:
            raise ContextLengthError(f"{why}; drop earlier messages", "messages")
        check_max_tokens(len(prompt), request, max_len, "the conversation")
        return prompt, params

    def check(self, requests: list[dict]) -> dict | None:
        """The error event generate() would answer first for the first of `requests` (the choices of one
        request, or the prompts of a completions batch) that it refuses before submitting: a bad conversation
        or prompt, one over the context, a max_tokens beyond what it leaves (a 400); None when every one
        passes. Submits nothing, so the ingress asks this before opening any of the requests, and a refused
        request costs the engine no work (a refusal counts once in `rejected`)."""
        for request in requests:
            prompt_form = "prompt" in request
            try:
                if prompt_form:
                    checked_prompt(self.tokenizer, request, self.scheduler.max_len)
                else:
                    self._chat_prompt(request)
            except ValueError as e:
                self.rejected += 1
                return refusal(e, (request.get("param") or "prompt") if prompt_form else None)
        return None

    async def _events(self, stream, request: dict) -> AsyncIterator[dict]:
        """Engine StreamEvents -> the event dicts of the module doc (text buffered per stream_interval)."""
        parser = TurnParser(self.tokenizer)
        gate = LogprobGate(self.tokenizer)  # logprobs go with the text they start in
        want_logprobs = bool(request.get("logprobs"))
        python_end = self.tokenizer.special_id(MARKERS["python_end"])
        last = None
        text, logprobs, tokens, sent = [], [], 0, False  # buffered delta (see stream_interval)
        call_id, last_token = None, None

        def delta() -> dict:
            nonlocal text, logprobs, tokens, sent, last
            now = time.perf_counter()
            if last is not None and tokens:  # per token: events arrive in bursts of stream_interval
                self.metrics.observe_inter_token((now - last) / tokens)
            last = now
            out = {"type": "delta", "text": "".join(text), "tokens": tokens}
            out["logprobs"] = logprobs if want_logprobs else None
            text, logprobs, tokens, sent = [], [], 0, True
            return out

        async for ev in stream:
            self.count_first_token(ev)
            if ev.token_ids:
                self.metrics.add_tokens(len(ev.token_ids))
                last_token = ev.token_ids[-1]
            parts, kinds = parser.push(ev.token_ids, ev.text)
            if ev.finished:
                parts += parser.finish()
            if want_logprobs:
                entries = text_logprobs(self.tokenizer, ev, kinds)
                logprobs += gate.push(ev.token_ids, entries, ev.text, ev.finished)
            for kind, value in parts:
                if kind == "text":
                    text.append(value)
                    continue
                if text or tokens:
                    yield delta()
                if kind == "tool_call":
                    call_id = f"call_{uuid.uuid4().hex[:24]}"
                    yield {"type": "tool_call", "id": call_id, "expression": value}
                else:
                    yield {"type": "tool_result", "id": call_id, "output": value}
            if ev.finished:  # flush what is buffered; a bare end token (no text) needs no delta
                flush = tokens > 0 or any(text) or bool(logprobs)
            else:
                flush = not sent or tokens + len(ev.token_ids) >= self.stream_interval
            tokens += len(ev.token_ids)
            if flush:
                yield delta()
            if not ev.finished:
                continue
            self._publish_gauges()
            u = ev.usage
            if ev.finish_reason in ("stop", "length"):
                self.completed += 1
                reason = ev.finish_reason
                if request.get("client_tools") and reason == "stop" and last_token == python_end:
                    reason = "tool_calls"
                usage = usage_dict(u.prompt_tokens, u.completion_tokens, u.ttft_s, u.cached_tokens)
                yield {"type": "done", "finish_reason": reason, "usage": usage}
            elif ev.finish_reason == "cancelled":
                self.cancelled += 1
            elif ev.finish_reason == "timeout":  # past request_timeout_s: its slot is already free
                yield {"type": "error", "status": 504, "message": ev.error, "param": None}
            else:
                status = 500 if self.scheduler.running else 503  # 503: the engine process is being replaced
                message = ev.error or "generation failed"
                yield {"type": "error", "status": status, "message": message, "param": None}
            return

    def count_first_token(self, ev) -> None:
        """Record the request's TTFT (raychat_serve_ttft_seconds: the engine's submit -> first token, seconds)
        and its prompt's prefix-cache queries / hits when the event carrying its first token reaches this
        replica (StreamEvent.first; no-op for every other event). So each request is counted once, before
        its first delta is sent, whether its client then stays or leaves, and one that never got a token
        (cancelled or failed while queued or prefilling, rejected) is not counted."""
        u = ev.first
        if u is not None:
            self.metrics.observe_ttft(u.ttft_s)
            self.metrics.add_prefix_cache(queries=u.prompt_tokens, hits=u.cached_tokens)

    async def wait_idle(self, timeout_s: float = 10.0) -> bool:
        """Wait until no request is in flight and every row is free (True), or timeout_s passes (False)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.in_flight == 0 and self.scheduler.num_active == 0 and self.scheduler.num_pending == 0:
                return True
            await asyncio.sleep(0.02)
        return False

    def shutdown(self) -> None:
        """Stop the engine (and the marking of a cached copy: `in_use`)."""
        self.scheduler.stop()
        if self.in_use is not None:
            self.in_use.stop()


def merge_deltas(events: list[dict]) -> list[dict]:
    """`events` with each run of consecutive delta events replaced by one delta (texts joined, tokens
    summed, logprobs concatenated: None when the request did not ask for them); other events keep their
    place. Used where several events travel in one message."""
    out: list[dict] = []
    for ev in events:
        if ev["type"] == "delta" and out and out[-1]["type"] == "delta":
            prev = out[-1]
            logprobs = None
            if prev.get("logprobs") is not None or ev.get("logprobs") is not None:
                logprobs = (prev.get("logprobs") or []) + (ev.get("logprobs") or [])
            out[-1] = {
                "type": "delta",
                "text": prev["text"] + ev["text"],
                "tokens": prev["tokens"] + ev["tokens"],
                "logprobs": logprobs,
            }
        else:
            out.append(ev)
    return out
