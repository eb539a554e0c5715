"""Continuous batching: one KV cache of fixed rows serves many request streams.

Every `step()`:
  1. cancelled requests leave (their rows are freed; their stream ends with finish_reason "cancelled");
  2. pending requests are admitted into free rows and prefilled together (one batched forward);
  3. every busy row takes its next token (sampled with the request's own generator and parameters, or a
     forced tool-output token), its stream gets a StreamEvent, and finished rows are freed;
  4. one decode forward runs over the rows that are still busy (free rows cost nothing).
So a request submitted or cancelled between steps is admitted / freed by the next step.

Threading: submit() and cancel() may be called from any thread (they only touch a lock-protected inbox);
steps are serialized by a second lock. Serving replicas call start() once, which runs steps in a daemon
thread while there is work, and consume streams with `async for` (events are handed to the event loop with
call_soon_threadsafe) or a plain `for` from a worker thread. Without start(), iterating a stream drives
step() itself (sync: inline; async: in asyncio.to_thread), which suits the CLI and tests.
"""

from __future__ import annotations

import asyncio
import collections
import threading
import time
import uuid
from dataclasses import dataclass

import torch

from raychat.engine.kv_cache import KVBudgetError, KVCache
from raychat.engine.sampling import SamplingParams, make_generator, sample_next
from raychat.engine.sequence import RowState


@dataclass(frozen=True)
class Usage:
    """Token counts and timings (seconds) of one finished request. ttft_s: submit -> first token."""

    prompt_tokens: int
    completion_tokens: int
    ttft_s: float | None
    total_s: float


@dataclass(frozen=True)
class StreamEvent:
    """One step of one request: `text` is the new delta (may be ""), token_ids the new completion tokens.

    The last event has finished=True, finish_reason in {"stop", "length", "cancelled", "error"} and usage;
    error holds the message when finish_reason == "error".
    """

    request_id: str
    text: str
    token_ids: list[int]
    finished: bool = False
    finish_reason: str | None = None
    usage: Usage | None = None
    error: str | None = None


class RequestStream:
    """Events of one request; iterate with `for` or `async for`. Ends after the finished event.

    An async consumer is woken (one call_soon_threadsafe to its loop) by the first event, by the finished
    event, and otherwise once `wake_every` events are queued; each wake-up then drains every queued event
    without waiting. A serving replica passes its stream interval here, so its event loop wakes once per
    streamed delta instead of once per token (the loop shares the GIL with the decode step).
    """

    def __init__(self, scheduler: Scheduler, request_id: str, wake_every: int = 1):
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


def check_fits_row(ids: list[int], max_len: int) -> list[int]:
    """`ids`, or ValueError if a row of max_len tokens leaves no room to generate after them."""
    if len(ids) >= max_len:
        raise ValueError(f"prompt has {len(ids)} tokens; rows hold max_len {max_len} tokens in total")
    return ids


class _Request:
    def __init__(self, request_id, prompt, params, stream, device):
        self.id, self.prompt, self.params, self.stream = request_id, prompt, params, stream
        self.generator = make_generator(params.seed, device) if params.temperature > 0 else None
        self.submitted = time.perf_counter()
        self.first_token: float | None = None
        self.state: RowState | None = None
        self.row: int | None = None
        self.cancel_requested = False


class Scheduler:
    """Continuous batching over one ModelRunner.

    Args:
        engine: a ModelRunner (model + tokenizer).
        max_slots: concurrent rows (requests being decoded), >= 1.
        max_len: tokens per row (prompt + completion); default and maximum model.config.max_seq_len.
        kv_budget_bytes: if given, rows = min(max_slots, rows that fit the budget).
    Raises:
        ValueError: max_slots < 1 or max_len outside 2..max_seq_len.
        KVBudgetError: not even one row of max_len tokens fits kv_budget_bytes (message names the numbers).
    """

    def __init__(
        self, engine, max_slots: int = 8, max_len: int | None = None, kv_budget_bytes: int | None = None
    ):
        cfg = engine.config
        max_len = cfg.max_seq_len if max_len is None else int(max_len)
        if not 2 <= max_len <= cfg.max_seq_len:
            raise ValueError(f"max_len must be in 2..{cfg.max_seq_len} (model max_seq_len), got {max_len}")
        if not isinstance(max_slots, int) or max_slots < 1:
            raise ValueError(f"max_slots must be an int >= 1, got {max_slots!r}")
        rows = max_slots
        if kv_budget_bytes is not None:
            rows = min(max_slots, KVCache.rows_for_budget(cfg, kv_budget_bytes, max_len, engine.dtype))
            if rows < 1:
                bpt = KVCache.bytes_per_token(cfg, engine.dtype)
                raise KVBudgetError(
                    f"kv_budget_bytes {kv_budget_bytes} cannot hold one row of max_len {max_len} tokens: "
                    f"that needs {bpt * max_len} bytes ({bpt} bytes/token); lower max_len or raise the budget"
                )
        self.engine = engine
        self.cache = engine.new_cache(rows, max_len)
        self.max_slots, self.max_len = rows, max_len
        self._rows: list[_Request | None] = [None] * rows
        self._logits: dict[int, torch.Tensor] = {}  # row -> next-token logits (V,)
        self._pending: collections.deque[_Request] = collections.deque()
        self._live: dict[str, _Request] = {}
        self._lock = threading.Lock()  # inbox: _pending, _live, cancel flags
        self._step_lock = threading.Lock()  # one step at a time
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self.last_error: BaseException | None = None

    # ---- public, thread-safe ---------------------------------------------------------------------
    def submit(
        self,
        prompt: list[int],
        params: SamplingParams | None = None,
        request_id: str | None = None,
        wake_every: int = 1,
    ):
        """Queue a request; returns its RequestStream (wake_every: see RequestStream). Raises ValueError for
        a bad prompt or duplicate id."""
        params = params or SamplingParams()
        ids = check_fits_row(self.engine.check_prompt(prompt), self.max_len)
        request_id = request_id or uuid.uuid4().hex
        stream = RequestStream(self, request_id, wake_every)
        req = _Request(request_id, ids, params, stream, self.engine.device)
        with self._lock:
            if request_id in self._live:
                raise ValueError(f"request_id {request_id!r} is already live")
            self._live[request_id] = req
            self._pending.append(req)
        self._wake.set()
        return stream

    def cancel(self, request_id: str) -> bool:
        """Ask to end a request; its row is free after the next step. True if it was live and not yet
        cancelled; False (and no effect) for unknown, finished or already cancelled ids."""
        with self._lock:
            req = self._live.get(request_id)
            if req is None or req.cancel_requested:
                return False
            req.cancel_requested = True
        self._wake.set()
        return True

    @property
    def num_free_slots(self) -> int:
        return sum(r is None for r in self._rows)

    @property
    def num_active(self) -> int:
        return self.max_slots - self.num_free_slots

    @property
    def num_pending(self) -> int:
        return len(self._pending)

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    @property
    def restarting(self) -> bool:
        """Always False: a stopped scheduler thread stays stopped (an EngineProcess may restart)."""
        return False

    def start(self) -> None:
        """Run steps in a daemon thread (idempotent)."""
        if self.running:
            return
        self._stop.clear()
        self._thread = threading.Thread(target=self._loop, name="raychat-scheduler", daemon=True)
        self._thread.start()

    def stop(self, timeout: float | None = 10.0) -> None:
        """Stop the background thread after its current step (requests stay queued)."""
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout)
        self._thread = None

    def _loop(self) -> None:
        while not self._stop.is_set():
            if self.num_active == 0 and not self._pending:
                self._wake.wait(timeout=0.1)
                self._wake.clear()
                continue
            self.step()

    # ---- one step ----------------------------------------------------------------------------------
    def step(self) -> int:
        """Cancel, admit, take one token per busy row, decode. Returns the number of busy rows after it."""
        with self._step_lock:
            with self._lock:
                cancelled = [r for r in self._live.values() if r.cancel_requested]
                for req in cancelled:
                    if req.row is None:
                        self._pending.remove(req)
                    self._finish(req, "cancelled")
                admitted = []
                for row in range(self.max_slots):
                    if self._rows[row] is None and self._pending:
                        req = self._pending.popleft()
                        req.row = row
                        self._rows[row] = req
                        admitted.append(req)
            try:
                self._compute(admitted)
            except Exception as e:  # fail the busy requests, keep the scheduler alive
                self.last_error = e
                with self._lock:
                    for req in [r for r in self._rows if r is not None]:
                        self._finish(req, "error", error=f"{type(e).__name__}: {e}")
                if not self.running:
                    raise
            return self.num_active

    def _compute(self, admitted: list[_Request]) -> None:
        if admitted:
            rows = [r.row for r in admitted]
            logits = self.engine.prefill(self.cache, rows, [r.prompt for r in admitted])
            for req, lg in zip(admitted, logits):
                req.state = RowState(self.engine.tokenizer, req.prompt, req.params, self.max_len)
                self._logits[req.row] = lg
        busy = [row for row, req in enumerate(self._rows) if req is not None]
        if not busy:
            return
        finished = []
        for row in busy:
            req = self._rows[row]
            sampled = None
            if req.state.needs_sample:
                p = req.params
                logits = self._logits[row][None]
                sampled = int(sample_next(logits, p.temperature, p.top_k, p.top_p, req.generator)[0])
            token, delta = req.state.step(sampled)
            if req.first_token is None:
                req.first_token = time.perf_counter()
            if req.state.finished:
                finished.append((req, token, delta))
            else:
                req.stream._push(StreamEvent(req.id, delta, [token]))
        with self._lock:
            for req, token, delta in finished:
                self._finish(req, req.state.finish_reason, text=delta, token_ids=[token])
        busy = [row for row, req in enumerate(self._rows) if req is not None]
        if busy:
            logits = self.engine.decode(self.cache, busy, [self._rows[r].state.tokens[-1] for r in busy])
            self._logits.update(zip(busy, logits))

    def _finish(self, req: _Request, reason: str, text: str = "", token_ids=(), error: str | None = None):
        """Free the request's row and send its final event. Caller holds self._lock."""
        if self._live.pop(req.id, None) is None:
            return
        if req.row is not None:
            self._rows[req.row] = None
            self._logits.pop(req.row, None)
            self.cache.reset_rows([req.row])
        done = time.perf_counter()
        usage = Usage(
            prompt_tokens=len(req.prompt),
            completion_tokens=req.state.num_completion_tokens if req.state else 0,
            ttft_s=None if req.first_token is None else req.first_token - req.submitted,
            total_s=done - req.submitted,
        )
        req.stream._push(StreamEvent(req.id, text, list(token_ids), True, reason, usage, error))
