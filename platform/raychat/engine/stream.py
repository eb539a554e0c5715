"""What a request's consumer receives: StreamEvent (with Usage and per-token logprobs) through a
RequestStream, the thread-safe queue between the step loop and one consumer (sync or asyncio).
"""

from __future__ import annotations

import asyncio
import collections
import threading
from dataclasses import dataclass
from typing import Protocol


class StepSource(Protocol):
    """What a RequestStream needs from its producer (a Scheduler or an EngineProcess)."""

    running: bool

    def step(self) -> int: ...

    def cancel(self, request_id: str) -> bool: ...


@dataclass(frozen=True)
class TokenLogprob:
    """One completion token's logprob (raychat.engine.sampling's docstring: which distribution) and, when
    asked for (SamplingParams.top_logprobs), the most likely alternatives as [(token_id, logprob), ...],
    most likely first."""

    token_id: int
    logprob: float
    top_logprobs: list[tuple[int, float]]


@dataclass(frozen=True)
class Usage:
    """Token counts and timings (seconds) of one request, finished or at its first token (StreamEvent.first).
    ttft_s: submit -> first token sampled (None: no token yet); total_s: submit -> this event.
    cached_tokens: prompt tokens whose keys/values came from the prefix cache (engine/prefix_cache.py)."""

    prompt_tokens: int
    completion_tokens: int
    ttft_s: float | None
    total_s: float
    cached_tokens: int = 0


@dataclass(frozen=True)
class StreamEvent:
    """One step of one request: `text` is the new delta (may be ""), token_ids the new completion tokens.

    The last event has finished=True, finish_reason in {"stop", "length", "cancelled", "timeout", "error"}
    and usage ("timeout": it ran past the scheduler's request_timeout_s; error says so);
    error holds the message when finish_reason == "error" (that request alone failed: non-finite logits,
    an invalid sampling state, or its forward raised, e.g. out of memory in its prefill; other requests go
    on). logprobs: one TokenLogprob per entry of token_ids when the request set SamplingParams.logprobs,
    else None. prompt_logprobs: only on the final event of a scoring request (Scheduler.score): one entry
    per prompt token (None for the first, engine/scoring.py).
    first: only on the event carrying the request's first token (once per request, the final event too when
    it is that one): its Usage then, with prompt_tokens and cached_tokens final (its prefill is complete) and
    completion_tokens 1. A consumer that counts at `first` counts every request that got a token, whether
    it later finishes, fails, times out or is cancelled, and none that never got one.
    """

    request_id: str
    text: str
    token_ids: list[int]
    finished: bool = False
    finish_reason: str | None = None
    usage: Usage | None = None
    error: str | None = None
    logprobs: list[TokenLogprob] | None = None
    prompt_logprobs: list[TokenLogprob | None] | None = None
    first: Usage | None = None


class RequestStream:
    """Events of one request; iterate with `for` or `async for`. Ends after the finished event.

    An async consumer is woken (one call_soon_threadsafe to its loop) by the first event, by the finished
    event, and otherwise once `wake_every` events are queued; each wake-up then drains every queued event
    without waiting. A serving replica passes its stream interval here, so its event loop wakes once per
    streamed delta instead of once per token (the loop shares the GIL with the decode step).
    """

    def __init__(self, scheduler: StepSource, request_id: str, wake_every: int = 1):
        if not isinstance(wake_every, int) or wake_every < 1:
            raise ValueError(f"wake_every must be an int >= 1, got {wake_every!r}")
        self.request_id = request_id
        self._scheduler = scheduler
        self._events: collections.deque[StreamEvent] = collections.deque()
        self._cond = threading.Condition()
        self._waiter: tuple[asyncio.AbstractEventLoop, asyncio.Future] | None = None
        self._wake_every = wake_every
        self._pushed = 0
        self.done = False

    def _push(self, event: StreamEvent) -> None:
        with self._cond:
            self._events.append(event)
            self._pushed += 1
            self._cond.notify_all()
            waiter = self._waiter
            if waiter is None or not (
                event.finished or self._pushed == 1 or len(self._events) >= self._wake_every
            ):
                return
            self._waiter = None
        loop, future = waiter
        try:
            loop.call_soon_threadsafe(_resolve, future)
        except RuntimeError:  # loop closed: its consumer is gone
            pass

    def cancel(self) -> bool:
        return self._scheduler.cancel(self.request_id)

    def _pop(self) -> StreamEvent | None:
        with self._cond:
            return self._events.popleft() if self._events else None

    def __iter__(self):
        while not self.done:
            event = self._pop()
            if event is None:
                if self._scheduler.running:
                    with self._cond:
                        self._cond.wait_for(lambda: self._events, timeout=0.5)
                else:
                    self._scheduler.step()
                continue
            self.done = event.finished
            yield event

    async def __aiter__(self):
        loop = asyncio.get_running_loop()
        try:
            while not self.done:
                event = self._pop()
                if event is not None:
                    self.done = event.finished
                    yield event
                    continue
                if not self._scheduler.running:
                    await asyncio.to_thread(self._scheduler.step)
                    continue
                with self._cond:
                    if self._events:  # raced with _push: drain first
                        continue
                    future = loop.create_future()
                    self._waiter = (loop, future)
                try:  # the timeout only guards a scheduler thread that died without a final event
                    await asyncio.wait_for(future, timeout=0.5)
                except asyncio.TimeoutError:
                    pass
        finally:
            with self._cond:
                self._waiter = None


def _resolve(future: asyncio.Future) -> None:
    if not future.done():
        future.set_result(None)
