"""Continuous batching with chunked prefill: one KV cache of fixed rows ("slots") serves many request streams.

Every `step()`:
  1. cancelled requests leave (their slots are freed; their stream ends with finish_reason "cancelled"),
     so do requests past their deadline (`request_timeout_s` after submit: finish_reason "timeout"), and
     pending requests are admitted into free slots (prompt not yet in the cache: "prefilling");
  2. prefill: at most `prefill_chunk_tokens` prompt tokens of the prefilling requests, oldest first (a
     long prompt takes several steps, one chunk each), one forward per run of consecutive slots; a
     request whose prompt is now complete gets its first-token logits (at its last prompt token only).
     Before its chunk, a request copies the prefix-cache blocks that continue its prompt into its row
     (engine/prefix_cache.py; they cost no budget); its newly complete blocks are cached after it;
  3. every request with logits takes its next token: one SamplingBatch over all of them (per-request
     temperature / top-k / top-p / generator / logprobs; ONE device-to-host transfer per step), or a
     forced tool-output token; its stream gets a StreamEvent; finished requests free their slots;
  4. one decode forward over slots 0..n-1 (prefilling slots ride along as placeholders).
So decoding requests get one token per step however long a prompt being prefilled is: the prompt delays
them by at most one chunk per step. A request submitted or cancelled between steps is admitted / freed by
the next step.

Busy slots are always 0..n-1: when requests finish, KVCache.compact moves the last busy slots into the
freed ones (one copy of each moved row's history per finished request, never per step), so every
forward reads the cache in place (kv_cache.py, attention.py).

Fault isolation: a failure while computing one request ends that request alone with finish_reason
"error" and its message: non-finite logits or an invalid sampling state (sampling.py), an exception in its
prefill forward (e.g. torch.OutOfMemoryError: a batched prefill that raises is retried one request at a
time, so only the request that fails alone is ended), or in its token bookkeeping. An exception in the
shared decode forward ends the requests in it; the scheduler keeps serving; nothing raises out of step().

Bounds: at most `max_pending` live requests beyond the slots (waiting for one); submit() beyond that raises
QueueFullError (a serving replica answers 429 with Retry-After). Liveness: the step thread (start()) beats once per step or
idle wait; `stalled_s` is how long it has not while requests are live (a health check's measure).

Threading: submit() and cancel() may be called from any thread (they only touch a lock-protected inbox);
steps are serialized by a second lock. Serving replicas call start() once, which runs steps in a daemon
thread while there is work, and consume streams with `async for` (stream.py) or a plain `for` from a
worker thread. Without start(), iterating a stream drives step() itself (sync: inline; async: in
asyncio.to_thread), which suits the CLI and tests.
"""

from __future__ import annotations

import collections
import threading
import time
import uuid

import torch

from raychat.engine.kv_cache import KVBudgetError, KVCache, check_budget_bytes
from raychat.engine.prefix_cache import BLOCK_TOKENS, block_digests
from raychat.engine.row_state import RowState
from raychat.engine.sampling import SamplingBatch, SamplingParams, is_greedy, make_generator
from raychat.engine.stream import RequestStream, StreamEvent, TokenLogprob, Usage

__all__ = [
    "QueueFullError",
    "RequestStream",
    "Scheduler",
    "StreamEvent",
    "TokenLogprob",
    "Usage",
    "check_fits_row",
    "completion_overflow",
    "check_limits",
    "prompt_overflow",
    "check_queue",
]


class QueueFullError(RuntimeError):
    """submit() found `max_pending` requests already waiting for a slot: the caller should retry later."""


def check_queue(num_live: int, max_slots: int, max_pending: int | None) -> None:
    """QueueFullError when `num_live` requests (submitted, not finished) already fill the max_slots KV slots
    and max_pending more wait for one (max_pending None: no bound)."""
    waiting = num_live - max_slots
    if max_pending is not None and waiting >= max_pending:
        raise QueueFullError(
            f"engine queue full: {waiting} requests already wait for a KV slot (max_pending={max_pending})"
        )


def check_limits(max_pending: int | None, request_timeout_s: float | None, stall_timeout_s: float) -> None:
    """ValueError naming the option when max_pending < 1, request_timeout_s <= 0 or stall_timeout_s <= 0."""
    if max_pending is not None and (not isinstance(max_pending, int) or max_pending < 1):
        raise ValueError(f"max_pending must be None or an int >= 1, got {max_pending!r}")
    if request_timeout_s is not None and not request_timeout_s > 0:
        raise ValueError(f"request_timeout_s must be None or > 0 seconds, got {request_timeout_s!r}")
    if not stall_timeout_s > 0:
        raise ValueError(f"stall_timeout_s must be > 0 seconds, got {stall_timeout_s!r}")


def check_fits_row(ids: list[int], max_len: int) -> list[int]:
    """`ids`, or ValueError (prompt_overflow's message) if a row of max_len tokens leaves no room to generate
    after them."""
    why = prompt_overflow(len(ids), max_len)
    if why:
        raise ValueError(why)
    return ids


def prompt_overflow(
    prompt_tokens: int, max_len: int, prompt: str = "the prompt", reply_tokens: int = 1
) -> str | None:
    """Why a prompt of `prompt_tokens` tokens leaves no room for `reply_tokens` (>= 1) completion tokens in a
    row of `max_len` (the context length, tokens), in completion_overflow's words: the prompt is to blame, so
    "at most N fit" counts prompt tokens; None when prompt_tokens + reply_tokens <= max_len. `prompt` names
    the prompt in the message ("the conversation")."""
    if prompt_tokens + reply_tokens <= max_len:
        return None
    need = f"at least {reply_tokens} completion token{'s' if reply_tokens != 1 else ''}"
    room = max(max_len - reply_tokens, 0)
    return (
        f"{prompt} has {prompt_tokens} tokens, but the model's context length is {max_len} tokens and {need} "
        f"must follow ({prompt_tokens} + {reply_tokens} > {max_len}): at most {room} fit"
    )


def completion_overflow(
    prompt_tokens: int, max_tokens: int, max_len: int, prompt: str = "the prompt"
) -> str | None:
    """Why `max_tokens` completion tokens do not fit after a prompt of `prompt_tokens` tokens in a row of
    `max_len` (the context length, tokens), naming the three numbers as OpenAI's and vLLM's 400 does; None when
    prompt_tokens + max_tokens <= max_len. `prompt` names the prompt in the message ("the conversation")."""
    if prompt_tokens + max_tokens <= max_len:
        return None
    return (
        f"{max_tokens} completion tokens requested, but the model's context length is {max_len} tokens and "
        f"{prompt} has {prompt_tokens} ({prompt_tokens} + {max_tokens} > {max_len}): at most "
        f"{max(max_len - prompt_tokens, 0)} fit"
    )


class _Request:
    def __init__(self, request_id, prompt, params, stream, device):
        self.id, self.prompt, self.params, self.stream = request_id, prompt, params, stream
        greedy = is_greedy(params.temperature)
        self.generator = None if greedy else make_generator(params.seed, device)
        self.submitted = time.perf_counter()
        self.deadline = float("inf")  # perf_counter() time past which step() ends it ("timeout")
        self.first_token: float | None = None
        self.state: RowState | None = None  # set when the prompt is in the cache (decoding)
        self.slot: int | None = None
        self.prefilled = 0  # prompt tokens in the cache
        self.logits: torch.Tensor | None = None  # (V,) next-token logits, until sampled
        self.cancel_requested = False
        # prefix cache (engine/prefix_cache.py): the prompt's block digests (None: not looked up yet), the
        # blocks this request holds, of the cache's epoch `epoch`, covering its first `blocks_done` blocks
        self.digests: list[bytes] | None = None
        self.blocks: list[int] = []
        self.epoch = -1
        self.blocks_done = 0
        self.cached_tokens = 0  # prompt tokens whose keys/values came from the prefix cache


class Scheduler:
    """Continuous batching over one ModelRunner.

    Args:
        engine: a ModelRunner (model + tokenizer).
        max_slots: concurrent requests in the KV cache (decoding or prefilling), >= 1.
        max_len: tokens per slot (prompt + completion); default and maximum model.config.max_seq_len.
        kv_budget_bytes: None (no cap) or an int >= 1: slots = min(max_slots, slots that fit the budget).
        prefill_chunk_tokens: prompt tokens prefilled per step at most (>= 1), shared by the prefilling
            requests oldest first; bounds how long one step (the other requests' inter-token latency) takes.
        max_pending: live requests beyond the max_slots slots, i.e. waiting for one (>= 1); submit() beyond
            raises QueueFullError. None: no bound.
        request_timeout_s: seconds from submit after which a request (waiting or decoding) ends with
            finish_reason "timeout" and its slot is freed. None: no deadline.
        stall_timeout_s: seconds without a step, while requests are live, after which `stalled` is True.
    Raises:
        ValueError: max_slots < 1, max_len outside 2..max_seq_len, prefill_chunk_tokens < 1, max_pending < 1,
            request_timeout_s or stall_timeout_s <= 0, kv_budget_bytes not None or an int >= 1.
        KVBudgetError: not even one slot of max_len tokens fits kv_budget_bytes (message names the numbers).
    """

    def __init__(
        self,
        engine,
        max_slots: int = 8,
        max_len: int | None = None,
        kv_budget_bytes: int | None = None,
        prefill_chunk_tokens: int = 512,
        max_pending: int | None = None,
        request_timeout_s: float | None = None,
        stall_timeout_s: float = 60.0,
    ):
        cfg = engine.config
        max_len = cfg.max_seq_len if max_len is None else int(max_len)
        if not 2 <= max_len <= cfg.max_seq_len:
            raise ValueError(f"max_len must be in 2..{cfg.max_seq_len} (model max_seq_len), got {max_len}")
        if not isinstance(max_slots, int) or max_slots < 1:
            raise ValueError(f"max_slots must be an int >= 1, got {max_slots!r}")
        if not isinstance(prefill_chunk_tokens, int) or prefill_chunk_tokens < 1:
            raise ValueError(f"prefill_chunk_tokens must be an int >= 1, got {prefill_chunk_tokens!r}")
        check_limits(max_pending, request_timeout_s, stall_timeout_s)
        slots = max_slots
        if check_budget_bytes(kv_budget_bytes) is not None:
            slots = min(max_slots, KVCache.rows_for_budget(cfg, kv_budget_bytes, max_len, engine.kv_dtype))
            if slots < 1:
                bpt = KVCache.bytes_per_token(cfg, engine.kv_dtype)
                raise KVBudgetError(
                    f"kv_budget_bytes {kv_budget_bytes} cannot hold one row of max_len {max_len} tokens: "
                    f"that needs {bpt * max_len} bytes ({bpt} bytes/token); lower max_len or raise the budget"
                )
        self.engine = engine
        self.cache = engine.new_cache(slots, max_len)
        self.max_slots, self.max_len = slots, max_len
        self.prefill_chunk_tokens = prefill_chunk_tokens
        self.max_pending, self.request_timeout_s = max_pending, request_timeout_s
        self.stall_timeout_s = stall_timeout_s
        self._beat = time.monotonic()  # the step thread's last step or idle wait
        self._slots: list[_Request | None] = [None] * slots  # busy slots are 0..num_active-1
        self._prefilling: collections.deque[_Request] = collections.deque()  # admitted, oldest first
        self._decoded: tuple[torch.Tensor, list[_Request]] | None = None  # _decode's logits and their rows
        self._sampling: tuple[list[_Request], SamplingBatch] | None = None  # last step's rows and their batch
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
    ) -> RequestStream:
        """Queue a request; returns its RequestStream (wake_every: see RequestStream). Raises ValueError for
        a bad prompt or duplicate id, QueueFullError when max_pending requests already wait."""
        params = params or SamplingParams()
        ids = check_fits_row(self.engine.check_prompt(prompt), self.max_len)
        request_id = request_id or uuid.uuid4().hex
        stream = RequestStream(self, request_id, wake_every)
        req = _Request(request_id, ids, params, stream, self.engine.device)
        if self.request_timeout_s is not None:
            req.deadline = req.submitted + self.request_timeout_s
        with self._lock:
            if request_id in self._live:
                raise ValueError(f"request_id {request_id!r} is already live")
            check_queue(len(self._live), self.max_slots, self.max_pending)
            self._live[request_id] = req
            self._pending.append(req)
        self._wake.set()
        return stream

    def cancel(self, request_id: str) -> bool:
        """Ask to end a request; its slot is free after the next step. True if it was live and not yet
        cancelled; False (and no effect) for unknown, finished or already cancelled ids."""
        with self._lock:
            req = self._live.get(request_id)
            if req is None or req.cancel_requested:
                return False
            req.cancel_requested = True
        self._wake.set()
        return True

    def score(self, prompt: list[int], top_logprobs: int = 0, request_id: str | None = None) -> RequestStream:
        """The prompt's logprobs (ModelRunner.prompt_logprobs) as a RequestStream whose only event is final:
        finish_reason "stop" with `prompt_logprobs`, or "error" with the message when the forward failed
        (non-finite logits, out of memory: this request alone). The forward runs now, in the calling thread,
        between two steps (it holds the step lock); it takes no KV slot.

        Raises:
            ValueError: a bad prompt (as submit: rows hold max_len tokens) or top_logprobs < 0.
        """
        ids = check_fits_row(self.engine.check_prompt(prompt), self.max_len)
        if not isinstance(top_logprobs, int) or top_logprobs < 0:
            raise ValueError(f"top_logprobs must be an int >= 0, got {top_logprobs!r}")
        stream = RequestStream(self, request_id or uuid.uuid4().hex)
        start, entries, reason, error = time.perf_counter(), None, "stop", None
        try:
            with self._step_lock:
                entries = self.engine.prompt_logprobs(ids, top_logprobs)
        except Exception as e:  # noqa: BLE001 - this request alone fails (reported on its stream)
            reason, error = "error", f"{type(e).__name__}: {e}"
        usage = Usage(len(ids), 0, None, time.perf_counter() - start)
        event = StreamEvent(stream.request_id, "", [], True, reason, usage, error, prompt_logprobs=entries)
        stream._push(event)
        return stream

    @property
    def num_free_slots(self) -> int:
        return sum(r is None for r in self._slots)

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
    def stalled_s(self) -> float:
        """Seconds since the step thread last stepped (or waited idle) while requests are live; 0.0 when
        none are live or no step thread runs."""
        if not self._live or not self.running:
            return 0.0
        return max(0.0, time.monotonic() - self._beat)

    @property
    def stalled(self) -> bool:
        """True when stalled_s exceeds stall_timeout_s (the step thread is stuck with work to do)."""
        return self.stalled_s > self.stall_timeout_s

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
            self._beat = time.monotonic()
            if self.num_active == 0 and not self._pending:
                self._wake.wait(timeout=0.1)
                self._wake.clear()
                continue
            self.step()

    # ---- one step ----------------------------------------------------------------------------------
    def step(self) -> int:
        """Cancel, end the requests past their deadline, admit, prefill a chunk, take one token per decoding
        request, decode. Returns the number of busy slots after it. Never raises for a request's failure
        (see the module docstring)."""
        with self._step_lock:
            with self._lock:
                now = time.perf_counter()
                for req in [r for r in self._live.values() if r.cancel_requested or r.deadline <= now]:
                    if req.slot is None:
                        self._pending.remove(req)
                    if req.cancel_requested:
                        self._finish(req, "cancelled")
                    else:
                        self._finish(req, "timeout", error=self._timeout_message(now - req.submitted))
                self._compact()
                n = self.num_active
                while n < self.max_slots and self._pending:
                    req = self._pending.popleft()
                    req.slot, self._slots[n] = n, req
                    self._prefilling.append(req)
                    n += 1
            try:
                for phase in (self._prefill, self._sample, self._decode):
                    self._compact()  # slots only move here, between phases
                    phase()
            except Exception as e:  # a bug in the bookkeeping: end the busy requests, keep serving
                self._fail([r for r in self._slots if r is not None], e)
            self._compact()
            if self.num_active == 0:  # idle: hold no finished request (stream, generator) or logits
                self._sampling = self._decoded = None
            return self.num_active

    def _timeout_message(self, elapsed_s: float) -> str:
        return (
            f"request timed out: ran {elapsed_s:.1f} s, past request_timeout_s={self.request_timeout_s:g}; "
            "it was ended and its KV slot freed"
        )

    def _prefill(self) -> None:
        budget, pieces = self.prefill_chunk_tokens, []
        pc = self.engine.prefix_cache
        if pc is not None and self._prefilling:
            pc.sync(self.engine.weight_version())
        for req in self._prefilling:
            if pc is not None and budget:
                try:
                    self._reuse(pc, req)
                except Exception as e:  # noqa: BLE001 - a caching bug costs the reuse, never the request
                    self.last_error = e
            take = min(len(req.prompt) - req.prefilled, budget)
            if take == 0:
                break
            pieces.append((req, take))
            budget -= take
        pieces.sort(key=lambda piece: piece[0].slot)
        runs: list[list[tuple[_Request, int]]] = []
        for piece in pieces:
            if runs and runs[-1][-1][0].slot + 1 == piece[0].slot and self._fits([*runs[-1], piece]):
                runs[-1].append(piece)
            else:
                runs.append([piece])
        for run in runs:
            try:
                logits = self._prefill_forward(run)
            except Exception as e:  # noqa: BLE001 - retried alone: only a request that fails alone ends
                if len(run) == 1:
                    self._fail([run[0][0]], e)
                    continue
                for piece in run:
                    try:
                        self._prefilled([piece], self._prefill_forward([piece]))
                    except Exception as e1:  # noqa: BLE001 - reported on that request's stream
                        self._fail([piece[0]], e1)
                continue
            self._prefilled(run, logits)

    def _fits(self, run: list[tuple[_Request, int]]) -> bool:
        """True when one forward of `run` (padded to its longest piece) stays inside every row: rows that
        start at different lengths (a prefix-cache hit) could otherwise pad past max_len."""
        return max(req.prefilled for req, _ in run) + max(take for _, take in run) <= self.max_len

    def _reuse(self, pc, req: _Request) -> None:
        """Copy the cached blocks that continue `req`'s prompt from where its row stands (a block boundary)
        into its row (PrefixCache.match/load); it holds them until it ends."""
        if req.epoch != pc.epoch:
            if req.digests is not None:  # cleared (new weights) since its lookup: its row is of the old ones,
                return  # so it neither reuses nor caches anything more (its epoch stays the old one)
            pc.queries += len(req.prompt)
            req.digests, req.epoch = pc.digests(req.prompt), pc.epoch
        if req.prefilled != req.blocks_done * BLOCK_TOKENS:
            return
        ids = pc.match(req.prompt, req.digests, req.blocks_done)
        if ids:
            n = pc.load(self.cache, req.slot, ids, req.blocks_done)
            pc.acquire(ids)  # once copied: a load that raises leaves no hold behind
            req.blocks += ids
            req.blocks_done += len(ids)
            req.prefilled += n
            req.cached_tokens += n
            pc.hits += n

    def _cache_blocks(self, req: _Request, tokens: list[int], digests: list[bytes]) -> None:
        """Put `req`'s full blocks past blocks_done (keys/values in its row) in the prefix cache; hold them."""
        pc = self.engine.prefix_cache
        if pc is None or req.epoch != pc.epoch or len(digests) <= req.blocks_done:
            return
        try:
            req.blocks += pc.insert(self.cache, req.slot, tokens, digests, req.blocks_done)
        except Exception as e:  # noqa: BLE001 - a caching bug costs the caching, never the request
            self.last_error = e
        req.blocks_done = len(digests)

    def _prefill_forward(self, run: list[tuple[_Request, int]]) -> torch.Tensor:
        chunks = [req.prompt[req.prefilled : req.prefilled + take] for req, take in run]
        return self.engine.forward_rows(self.cache, run[0][0].slot, chunks)

    def _prefilled(self, run: list[tuple[_Request, int]], logits: torch.Tensor) -> None:
        for (req, take), lg in zip(run, logits):
            req.prefilled += take
            if req.digests is not None:  # the blocks now complete, for the requests that follow
                self._cache_blocks(req, req.prompt, req.digests[: req.prefilled // BLOCK_TOKENS])
            if req.prefilled == len(req.prompt):
                req.logits = lg
                req.state = RowState(self.engine.tokenizer, req.prompt, req.params, self.max_len)
                self._prefilling.remove(req)

    def _sample(self) -> None:
        rows = [r for r in self._slots if r is not None and r.logits is not None]
        if not rows:
            return
        reuse, self._sampling = self._sampling, None
        if reuse is not None and reuse[0] == rows and all(r.state.forced_token is None for r in rows):
            batch = reuse[1]  # the rows of the last step, none with a forced token: the same batch
        else:
            batch = SamplingBatch()
            for req in rows:
                p = req.params
                batch.add(p.temperature, p.top_k, p.top_p, req.generator, req.state.forced_token,
                          p.logprobs, p.top_logprobs)  # fmt: skip
        decoded, self._decoded = self._decoded, None
        logits = decoded[0] if decoded and decoded[1] == rows else torch.stack([req.logits for req in rows])
        samples = batch.sample(logits)
        if all(f < 0 for f in batch.forced):
            self._sampling = (rows, batch)
        finished, failed = [], []
        for req, s in zip(rows, samples):
            req.logits = None
            if s.error:
                failed.append((req, RuntimeError(s.error)))
                continue
            try:
                token, delta = req.state.step(s.token)
            except Exception as e:  # noqa: BLE001 - this request's bookkeeping (tool, detokenizer) failed
                failed.append((req, e))
                continue
            first = None
            if req.first_token is None:
                req.first_token = time.perf_counter()
                first = self._usage(req, req.first_token)
            lps = [TokenLogprob(token, s.logprob, s.top_logprobs)] if s.logprob is not None else None
            if req.state.finished:
                finished.append((req, token, delta, lps, first))
            else:
                req.stream._push(StreamEvent(req.id, delta, [token], logprobs=lps, first=first))
        with self._lock:
            for req, token, delta, lps, first in finished:
                self._finish(
                    req, req.state.finish_reason, text=delta, token_ids=[token], logprobs=lps, first=first
                )
        for req, e in failed:
            self._fail([req], e)

    def _decode(self) -> None:
        n = self.num_active
        decoding = [r for r in self._slots[:n] if r.state is not None]
        if not decoding:
            return
        pieces = [[r.state.tokens[-1]] if r.state is not None else [] for r in self._slots[:n]]
        try:
            logits = self.engine.forward_rows(self.cache, 0, pieces)
        except Exception as e:  # noqa: BLE001 - shared forward: every request in it ends
            self._fail(decoding, e)
            return
        for req in decoding:
            req.logits = logits[req.slot]
        # every row decoded, in slot order: the next _sample takes these logits as they are (no stack)
        self._decoded = (logits, decoding) if len(decoding) == n else None

    def _compact(self) -> None:
        busy = [slot for slot, r in enumerate(self._slots) if r is not None]
        if not busy or busy[-1] == len(busy) - 1:  # already rows 0..n-1
            return
        for src, dst in self.cache.compact(busy).items():
            req = self._slots[src]
            self._slots[src], self._slots[dst] = None, req
            req.slot = dst

    def _fail(self, requests: list[_Request], error: BaseException) -> None:
        """End `requests` with finish_reason "error" (their slots are freed; step() compacts later)."""
        self.last_error = error
        if isinstance(error, torch.OutOfMemoryError) and torch.cuda.is_available():
            torch.cuda.empty_cache()
        with self._lock:
            for req in requests:
                self._finish(req, "error", error=f"{type(error).__name__}: {error}")

    def _finish(self, req, reason, text="", token_ids=(), error=None, logprobs=None, first=None) -> None:
        """Free the request's slot and send its final event (`first`: StreamEvent.first, when this event
        carries the first token). Caller holds self._lock."""
        if self._live.pop(req.id, None) is None:
            return
        pc = self.engine.prefix_cache
        if pc is not None and req.digests is not None:
            if req.slot is not None and req.state is not None and reason in ("stop", "length"):
                # the completion's blocks too (a chat client's next turn sends this reply back)
                tokens = req.state.tokens[: int(self.cache.lengths[req.slot])]
                digests = block_digests(tokens, len(tokens) // BLOCK_TOKENS, pc.version or 0)
                self._cache_blocks(req, tokens, digests)
            pc.release(req.blocks, req.epoch)
            req.blocks = []
        if req.slot is not None:
            self._slots[req.slot] = None
            self.cache.reset_rows([req.slot])
            req.slot = None
        if req in self._prefilling:
            self._prefilling.remove(req)
        req.logits = None
        usage = self._usage(req, time.perf_counter())
        event = StreamEvent(req.id, text, list(token_ids), True, reason, usage, error, logprobs, first=first)
        req.stream._push(event)

    @staticmethod
    def _usage(req: _Request, now: float) -> Usage:
        """`req`'s Usage at perf_counter() time `now`."""
        return Usage(
            prompt_tokens=len(req.prompt),
            completion_tokens=req.state.num_completion_tokens if req.state else 0,
            ttft_s=None if req.first_token is None else req.first_token - req.submitted,
            total_s=now - req.submitted,
            cached_tokens=req.cached_tokens,
        )
