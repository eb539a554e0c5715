"""A ChatServer's answer to an engine request of the "prompt" form (POST /v1/completions, built by
raychat.serve.completions_api.engine_requests): the prompt's raw tokens, no chat template, no tool parsing.

Events (the vocabulary of raychat.serve.server, plus "prompt"):
  {"type": "prompt", "text": str, "tokens": int, "logprobs": [ENTRY] | None}
        first, only with echo: the prompt's text (a string prompt as sent, token ids decoded) and, with
        logprobs, one ENTRY per prompt token (the first one's logprob and top_logprobs are None)
  {"type": "delta", "text": str, "tokens": int, "logprobs": [ENTRY] | None}     completion tokens (an ENTRY
        goes with the text its token starts in: none for a stop string's tokens; the end token's, whose text
        is not sent, when the model ended the completion with <|assistant_end|> or <|bos|>;
        engine_adapter.LogprobGate)
  {"type": "done", "finish_reason": "stop" | "length", "usage": USAGE}           last event of a success
  {"type": "error", "status": 400 | 429 | 500 | 503 | 504, "message", "param"[, "code"][, "retry_after"]}
        code "context_length_exceeded": a prompt of max_len tokens or more (OpenAI's code, as chat's), or a
        max_tokens the row cannot hold after the prompt (prompt + max_tokens > max_len: param "max_tokens");
        both in one voice: "the prompt has 300 tokens, but the model's context length is 256 tokens and ..."
  ENTRY = {"token": str, "logprob": float | None, "top_logprobs": {token: logprob} | None}
        the token's text (its bytes decoded, invalid UTF-8 replaced), its logprob (-inf sent as MIN_LOGPROB)
        and the request's `logprobs` most likely alternatives plus the token itself (a text shared by two
        tokens keeps the larger logprob): OpenAI's legacy logprobs, one token at a time.
max_tokens 0 finishes with "length" and no completion token; max_tokens None (not sent) is
DEFAULT_MAX_TOKENS, or fewer when the row has less room left after the prompt. The same bounds as chat
requests: the prompt scoring and the generation are each one engine request (Scheduler.score / submit: 400
for a bad prompt, 429 when the engine's queue is full, 503 while the engine process is down); the scoring is
one forward bounded by request_timeout_s (504 past it), and the generation ends at its own deadline.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

from raychat.engine.row_state import end_ids
from raychat.engine.scheduler import QueueFullError, prompt_overflow
from raychat.serve.completions_api import DEFAULT_MAX_TOKENS
from raychat.serve.engine_adapter import MIN_LOGPROB, LogprobGate, check_max_tokens, sampling_params
from raychat.serve.errors import ContextLengthError, refusal
from raychat.serve.sse import usage_dict


def prompt_ids(tokenizer, prompt: str | list[int], max_len: int) -> list[int]:
    """A string prompt's ids (plain text, no <|bos|>: raychat.tokenizer.Tokenizer.encode), or the ids as
    given, checked as the engine checks a prompt (also for max_tokens 0, which never reaches it, and before
    echo decodes them).

    Raises:
        ValueError: an empty prompt, an id outside 0..vocab_size-1; ContextLengthError (a ValueError): max_len
            tokens or more.
    """
    ids = tokenizer.encode(prompt) if isinstance(prompt, str) else [int(t) for t in prompt]
    if not ids:
        raise ValueError("is empty; it needs at least one token")
    bad = [t for t in ids if not 0 <= t < tokenizer.vocab_size]
    if bad:
        raise ValueError(f"has token ids outside 0..{tokenizer.vocab_size - 1}: {bad[:5]}")
    why = prompt_overflow(len(ids), max_len)
    if why:
        raise ContextLengthError(why)
    return ids


def checked_prompt(tokenizer, request: dict, max_len: int) -> tuple[list[int], int]:
    """(prompt ids, max_tokens) of a prompt-form request, checked as the engine would be asked (prompt_ids,
    then check_max_tokens), before any engine work; max_tokens not sent is DEFAULT_MAX_TOKENS, or what the row
    leaves after the prompt when that is less.

    Raises:
        ValueError: prompt_ids' (a ContextLengthError for a prompt over the context) or check_max_tokens'
            ContextLengthError (param "max_tokens").
    """
    param = request.get("param") or "prompt"
    ids = prompt_ids(tokenizer, request["prompt"], max_len)
    check_max_tokens(len(ids), request, max_len, "the prompt" if param == "prompt" else param)
    max_tokens = request["max_tokens"]
    if max_tokens is None:  # not sent: the default, or what the row leaves
        max_tokens = min(DEFAULT_MAX_TOKENS, max_len - len(ids))
    return ids, max_tokens


def _text(tokenizer, token_id: int) -> str:
    return b"".join(tokenizer.iter_tokens([token_id])).decode("utf-8", errors="replace")


def _finite(logprob: float) -> float:
    return float(logprob) if logprob > float("-inf") else MIN_LOGPROB


def legacy_entry(tokenizer, token_id: int, entry) -> dict:
    """ENTRY (module doc) of one token from its TokenLogprob (None: the first prompt token)."""
    if entry is None:
        return {"token": _text(tokenizer, token_id), "logprob": None, "top_logprobs": None}
    top: dict[str, float] = {}
    for t, lp in [*entry.top_logprobs, (token_id, entry.logprob)]:
        key = _text(tokenizer, t)
        top[key] = max(top.get(key, MIN_LOGPROB), _finite(lp))
    return {"token": _text(tokenizer, token_id), "logprob": _finite(entry.logprob), "top_logprobs": top}


def _rejection(server, e: Exception, param: str) -> dict:
    """The error event of an exception from Scheduler.submit / score (as ChatServer.generate answers)."""
    server.rejected += 1
    if isinstance(e, ValueError):
        return refusal(e, param)
    if isinstance(e, QueueFullError):
        return {"type": "error", "status": 429, "message": str(e), "param": None,
                "retry_after": server.retry_after_s}  # fmt: skip
    return {"type": "error", "status": 503, "message": f"engine unavailable: {e}", "param": None}


async def _score(scheduler, ids: list[int], k: int):
    """The final event of Scheduler.score, its forward run off the event loop."""
    stream = await asyncio.to_thread(scheduler.score, ids, k)
    async for event in stream:
        if event.finished:
            return event
    raise RuntimeError("the scoring stream ended without a final event")


async def completion_events(server, request: dict) -> AsyncIterator[dict]:
    """The events (module doc) of one prompt-form request on `server` (a ChatServer: its scheduler, tokenizer,
    metrics, counters and retry_after_s); never raises for bad input. Closing it early cancels the request."""
    scheduler, tokenizer = server.scheduler, server.tokenizer
    param, k, echo = request.get("param") or "prompt", request.get("logprobs"), bool(request.get("echo"))
    stream, finished = None, False
    try:
        try:
            ids, max_tokens = checked_prompt(tokenizer, request, scheduler.max_len)
            scored = None
            if echo and k is not None:
                timeout = getattr(scheduler, "request_timeout_s", None)
                try:
                    scored = await asyncio.wait_for(_score(scheduler, ids, k), timeout)
                except TimeoutError:
                    message = f"scoring the prompt ran past request_timeout_s={timeout:g}"
                    yield {"type": "error", "status": 504, "message": message, "param": None}
                    return
                if scored.finish_reason != "stop":
                    status = 500 if scheduler.running else 503
                    yield {"type": "error", "status": status, "message": scored.error, "param": None}
                    return
            if max_tokens > 0:
                budget = {"max_tokens": max_tokens, "logprobs": k is not None, "top_logprobs": k or 0}
                params = sampling_params({**request, **budget}, scheduler.max_len)
                stream = scheduler.submit(ids, params, wake_every=server.stream_interval)
        except (ValueError, QueueFullError, RuntimeError, OSError) as e:
            yield _rejection(server, e, param)
            return
        if echo:
            text = request["prompt"] if isinstance(request["prompt"], str) else tokenizer.decode(ids)
            entries = None
            if scored is not None:
                entries = [legacy_entry(tokenizer, t, e) for t, e in zip(ids, scored.prompt_logprobs)]
            yield {"type": "prompt", "text": text, "tokens": len(ids), "logprobs": entries}
        if stream is None:
            server.completed += 1
            finished = True
            yield {"type": "done", "finish_reason": "length", "usage": usage_dict(len(ids), 0)}
            return
        gate = LogprobGate(tokenizer, end_ids(tokenizer))  # logprobs go with the text they start in
        async for ev in stream:
            server.count_first_token(ev)
            if ev.token_ids:
                server.metrics.add_tokens(len(ev.token_ids))
            if ev.token_ids or ev.text:
                entries = None
                if k is not None:
                    entries = [legacy_entry(tokenizer, t, e) for t, e in zip(ev.token_ids, ev.logprobs or ())]
                    entries = gate.push(ev.token_ids, entries, ev.text, ev.finished)
                yield {"type": "delta", "text": ev.text, "tokens": len(ev.token_ids), "logprobs": entries}
            if not ev.finished:
                continue
            finished = True
            u = ev.usage
            if ev.finish_reason in ("stop", "length"):
                server.completed += 1
                usage = usage_dict(u.prompt_tokens, u.completion_tokens, u.ttft_s, u.cached_tokens)
                yield {"type": "done", "finish_reason": ev.finish_reason, "usage": usage}
            elif ev.finish_reason == "cancelled":
                server.cancelled += 1
            elif ev.finish_reason == "timeout":
                yield {"type": "error", "status": 504, "message": ev.error, "param": None}
            else:
                status = 500 if scheduler.running else 503
                yield {"type": "error", "status": status, "message": ev.error or "generation failed",
                       "param": None}  # fmt: skip
            return
    finally:
        if stream is not None and not finished:
            server.cancelled += 1
            try:
                stream.cancel()  # the consumer left: free the row
            except OSError:  # the engine process died under it
                pass
