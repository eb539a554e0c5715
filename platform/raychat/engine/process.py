"""The continuous-batching Scheduler in a process of its own (an "engine core" process, as vLLM V1 does).

A serving replica's event loop (HTTP/Ray streaming, one coroutine per request) and the decode step share
one GIL when they share a process: every torch op gives the GIL up, and getting it back waits on the event
loop's Python. `EngineProcess` moves the model, KV cache and Scheduler into a child process and keeps only
the request streams in the caller, so the two run in parallel on two cores.

The child is `python -m raychat.engine.process FD`; protocol over a socketpair (multiprocessing Connection,
pickled tuples):
  parent -> child   (checkpoint, device, max_slots, max_len, torch_threads, engine options) first, then
                    ("submit", request_id, prompt, SamplingParams) | ("score", request_id, prompt,
                    top_logprobs) (Scheduler.score) | ("cancel", request_id) | ("stop",)
  child -> parent   ("ready", {"max_slots", "max_len"}) once the model is loaded, or ("failed", message)
                    ("events", [StreamEvent, ...], num_active) after every step that produced events or
                    changed the Scheduler's num_active (admission, a request's end): every event of every
                    request that step produced, in one message, and the rows busy after it; ("events", [],
                    num_active) after any other step when BEAT_INTERVAL_S passed since the last message (a
                    heartbeat: long prefill chunks)
The parent's num_active is the last num_active reported (0 while no child runs); its num_pending is its live
submit() requests less those, so a request the child has not read yet waits too; score() requests take no
row and never wait, as with the Scheduler.
The parent checks prompts itself (same rules and messages as Scheduler.submit), so a bad request still
raises ValueError at submit(). A request whose computation fails (non-finite logits, an out-of-memory in
its prefill, ...) ends alone with finish_reason "error" inside the child's Scheduler: the child never exits
because of a request. If the child dies anyway (killed, a crash in native code), every live request ends
with finish_reason "error" and a new child loads the model (`running` is False and submit raises
RuntimeError meanwhile); only when that fails, or after max_restarts, does the EngineProcess stay down (a
Serve health check then replaces the replica).

Liveness is progress: every message from the child is a heartbeat of its step loop. When requests are live
and none has come for stall_timeout_s (the child is stuck in a call, or stopped: SIGSTOP), the reader ends
every live stream with finish_reason "error" naming the stall, kills the child and does NOT restart it:
`running` turns False, `last_error` says why, and the replica's health check fails so that Ray Serve
replaces the replica. Bounds: the parent refuses a submit with QueueFullError when max_slots + max_pending
requests are live; the child's Scheduler ends a request past request_timeout_s ("timeout").
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
import time
import uuid
from multiprocessing.connection import Connection
from pathlib import Path

import torch

from raychat.checkpoint import load_model, read_meta
from raychat.engine.runner import ModelRunner, check_prompt
from raychat.engine.sampling import SamplingParams
from raychat.engine.scheduler import Scheduler, check_fits_row, check_limits, check_queue
from raychat.engine.stream import RequestStream, StreamEvent, Usage
from raychat.gc_heap import freeze_gc_heap

BEAT_INTERVAL_S = 0.5  # the child's heartbeat while steps produce no events; the reader's watch period


class EngineProcess:
    """A Scheduler over the checkpoint's model, run in a child process; the same surface as a
    started Scheduler for raychat.serve.server.ChatServer: submit, score, cancel, running, restarting,
    num_active, num_pending, num_free_slots, max_slots, max_len, last_error, stalled_s, stalled, start
    (no-op), stop.

    Args:
        checkpoint: raychat checkpoint directory (loaded by the child with raychat.checkpoint.load_model).
        device: torch device of the model in the child ("cpu", "cuda").
        max_slots, max_len: the Scheduler's (KV rows; tokens per row, default the model's max_seq_len).
        torch_threads: torch intra-op threads of the child (default 1).
        dtype: weights and KV cache of the child's ModelRunner; "auto" = bfloat16 on CUDA, float32 on CPU.
        attention, compile_decode: the child's ModelRunner's (engine/runner.py).
        prefill_chunk_tokens: the child's Scheduler's per-step prefill budget.
        prefix_cache_tokens: the child's ModelRunner's prefix-cache capacity ("auto", tokens, 0 = off).
        kv_dtype: the child's ModelRunner's KV-cache dtype ("model", "auto", "float32", "bfloat16", "float16").
        start_timeout_s: seconds to wait for the child to load the model.
        max_restarts: a child that exits unexpectedly is replaced by a new one (its live requests end with
            finish_reason "error"; submit raises RuntimeError while it loads) at most this many times;
            `restarts` counts them. A child that fails to start ends the EngineProcess (`running` False).
        max_pending: live requests beyond the max_slots slots (waiting for one; >= 1); more raise
            QueueFullError at submit. None: no bound.
        request_timeout_s: the child's Scheduler ends a request this many seconds after its submit
            (finish_reason "timeout", slot freed). None: no deadline.
        stall_timeout_s: seconds without a message from the child, while requests are live, after which
            the child counts as hung: live streams end with "error", the child is killed, no restart.
    Raises:
        ValueError: invalid max_slots / max_len (the child's Scheduler message), max_pending,
            request_timeout_s or stall_timeout_s.
        RuntimeError: the child failed to start or exited before it was ready.
    """

    def __init__(
        self,
        checkpoint: str | os.PathLike,
        device: str = "cpu",
        max_slots: int = 8,
        max_len: int | None = None,
        torch_threads: int = 1,
        start_timeout_s: float = 300.0,
        max_restarts: int = 100,
        dtype: str = "auto",
        attention: str = "auto",
        prefill_chunk_tokens: int = 512,
        compile_decode: bool = False,
        max_pending: int | None = None,
        request_timeout_s: float | None = None,
        stall_timeout_s: float = 60.0,
        prefix_cache_tokens="auto",
        kv_dtype="model",
    ):
        check_limits(max_pending, request_timeout_s, stall_timeout_s)
        config = read_meta(checkpoint)["model_config"]
        self.vocab_size, self.max_seq_len = config["vocab_size"], config["max_seq_len"]
        options = {"dtype": dtype, "attention": attention, "compile_decode": compile_decode}
        options |= {"prefix_cache_tokens": prefix_cache_tokens, "kv_dtype": kv_dtype}
        options |= {"prefill_chunk_tokens": prefill_chunk_tokens, "request_timeout_s": request_timeout_s}
        self.max_pending, self.request_timeout_s = max_pending, request_timeout_s
        self.stall_timeout_s = stall_timeout_s
        self._child_args = (str(checkpoint), device, max_slots, max_len, torch_threads, options)
        self._start_timeout_s = start_timeout_s
        self._proc, self._conn, ready = self._spawn()
        self.max_slots, self.max_len = ready["max_slots"], ready["max_len"]
        self.restarts = 0
        self.max_restarts = max_restarts
        self._restarting = False
        self.last_error: BaseException | None = None
        self._streams: dict[str, RequestStream] = {}
        self._scoring: set[str] = set()  # live score() requests (no row, never waiting for one)
        self._cancelled: set[str] = set()  # live requests whose cancel was sent
        self._active = 0  # the child's Scheduler.num_active, as last reported; 0 while no child runs
        self._lock = threading.Lock()  # _streams, _scoring, _cancelled, _active
        self._beat = time.monotonic()  # the last message from the child, or when it last became busy
        self._send_lock = threading.Lock()
        self._stopping = False
        self._reader = threading.Thread(target=self._read, name="raychat-engine-reader", daemon=True)
        self._reader.start()

    def _spawn(self) -> tuple[subprocess.Popen, Connection, dict]:
        """Start a child and wait until it has loaded the model; returns (process, connection, ready)."""
        checkpoint = self._child_args[0]
        # A fresh interpreter (`python -m raychat.engine.process`), not multiprocessing: forking a process
        # that holds threads (Ray, torch) is unsafe, and spawn re-imports the caller's __main__ (a Ray
        # worker's entry script). The two ends of a socketpair carry pickled messages (Connection).
        parent_sock, child_sock = socket.socketpair()
        package_root = str(Path(__file__).resolve().parents[2])
        env = {
            **os.environ,
            "PYTHONPATH": os.pathsep.join(filter(None, [package_root, os.environ.get("PYTHONPATH")])),
        }
        proc = subprocess.Popen(
            [sys.executable, "-m", "raychat.engine.process", str(child_sock.fileno())],
            pass_fds=(child_sock.fileno(),),
            env=env,
        )
        child_sock.close()
        conn = Connection(parent_sock.detach())
        conn.send(self._child_args)
        try:
            if not conn.poll(self._start_timeout_s):
                raise RuntimeError(
                    f"engine process did not load {checkpoint} within {self._start_timeout_s} s"
                )
            kind, payload = conn.recv()
        except EOFError:
            raise RuntimeError(f"engine process exited with code {proc.wait(5)} while starting") from None
        except BaseException:
            proc.kill()
            raise
        if kind == "failed":
            proc.wait(5)
            if payload.startswith("ValueError: "):
                raise ValueError(payload.removeprefix("ValueError: "))
            raise RuntimeError(f"engine process failed to start: {payload}")
        return proc, conn, payload

    # ---- the Scheduler surface -------------------------------------------------------------------
    def submit(
        self,
        prompt: list[int],
        params: SamplingParams | None = None,
        request_id: str | None = None,
        wake_every: int = 1,
    ) -> RequestStream:
        """Queue a request in the child; returns its RequestStream. Raises ValueError as Scheduler.submit,
        QueueFullError when max_pending requests wait, RuntimeError when the engine process is not running."""
        return self._enqueue("submit", prompt, params or SamplingParams(), request_id, wake_every)

    def score(self, prompt: list[int], top_logprobs: int = 0, request_id: str | None = None) -> RequestStream:
        """Scheduler.score in the child: a RequestStream whose only event is final (prompt_logprobs, or
        "error"). Raises ValueError, QueueFullError and RuntimeError as submit."""
        if not isinstance(top_logprobs, int) or top_logprobs < 0:
            raise ValueError(f"top_logprobs must be an int >= 0, got {top_logprobs!r}")
        return self._enqueue("score", prompt, top_logprobs, request_id, 1)

    def _enqueue(self, kind: str, prompt, payload, request_id: str | None, wake_every: int) -> RequestStream:
        """Check the prompt, register the stream and send (kind, request_id, ids, payload) to the child."""
        ids = check_prompt(prompt, self.vocab_size, self.max_seq_len)
        check_fits_row(ids, self.max_len)
        request_id = request_id or uuid.uuid4().hex
        stream = RequestStream(self, request_id, wake_every)
        with self._lock:
            if not self.running:
                state = f"stopped: {self.last_error}" if self.last_error else "stopping or restarting"
                raise RuntimeError(f"engine process is not running ({state})")
            if request_id in self._streams:
                raise ValueError(f"request_id {request_id!r} is already live")
            check_queue(len(self._streams), self.max_slots, self.max_pending)
            if not self._streams:  # busy from now: the stall clock starts here, not at the last message
                self._beat = time.monotonic()
            self._streams[request_id] = stream
            if kind == "score":
                self._scoring.add(request_id)
        self._send((kind, request_id, ids, payload))
        return stream

    def cancel(self, request_id: str) -> bool:
        """Ask the child to end a request; its stream ends with "cancelled". True if the request is live
        (its final event has not arrived here) and was not cancelled before; False, and no effect, for
        unknown, finished or already cancelled ids, or while the engine process is down."""
        with self._lock:
            if request_id not in self._streams or request_id in self._cancelled or not self.running:
                return False
            self._cancelled.add(request_id)
        self._send(("cancel", request_id))
        return True

    def step(self) -> int:
        """Steps run in the child; a consumer gets here only while the child is gone, and its stream then
        has (or is about to get) its final event: wait a moment."""
        time.sleep(0.01)
        return 0

    @property
    def running(self) -> bool:
        return (
            not self._stopping
            and not self._restarting
            and self.last_error is None
            and self._proc.poll() is None
        )

    @property
    def stalled_s(self) -> float:
        """Seconds since the last message from the child while requests are live; 0.0 when none are."""
        if not self._streams:
            return 0.0
        return max(0.0, time.monotonic() - self._beat)

    @property
    def stalled(self) -> bool:
        """True when stalled_s exceeds stall_timeout_s (the reader then ends the engine, see the module)."""
        return self.stalled_s > self.stall_timeout_s

    @property
    def restarting(self) -> bool:
        """True while a new child replaces one that exited (submit raises RuntimeError meanwhile)."""
        return self._restarting

    @property
    def num_active(self) -> int:
        """Rows busy in the child's Scheduler (admitted, prefilling or decoding), as it last reported."""
        return self._active

    @property
    def num_pending(self) -> int:
        """Live submit() requests without a row: waiting in the child's Scheduler or not yet read by it."""
        with self._lock:
            return max(0, len(self._streams) - len(self._scoring) - self._active)

    @property
    def num_free_slots(self) -> int:
        """max_slots - num_active."""
        return self.max_slots - self._active

    def start(self) -> None:
        """The child steps from the moment it is ready; nothing to start."""

    def stop(self, timeout: float | None = 10.0) -> None:
        """Stop the child after its current step (live requests end with "error")."""
        with self._lock:
            if self._stopping:
                return
            self._stopping = True
        try:
            self._send(("stop",))
        except OSError:
            pass
        try:
            self._proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self._proc.kill()
        self._reader.join(timeout)
        if self._proc.poll() is None:  # a child started by a restart that raced with this stop
            self._proc.kill()
        self._proc.wait(timeout)

    # ---- the pipe ---------------------------------------------------------------------------------
    def _send(self, message: tuple) -> None:
        # its own lock: the reader thread must never wait behind a send the child is not reading yet
        with self._send_lock:
            self._conn.send(message)

    def _read(self) -> None:
        while True:
            stall = self._read_until_exit()
            try:
                code = self._proc.wait(5)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                code = self._proc.wait(5)
            error = stall or RuntimeError(f"engine process exited with code {code}")
            with self._lock:
                self._restarting = stall is None and not self._stopping and self.restarts < self.max_restarts
                live = list(self._streams.values())
                self._streams.clear()
                self._scoring.clear()
                self._cancelled.clear()
                self._active = 0
                for stream in live:
                    usage = Usage(0, 0, None, 0.0)
                    stream._push(StreamEvent(stream.request_id, "", [], True, "error", usage, str(error)))
                if self._stopping:
                    return
                if not self._restarting:
                    self.last_error = error
                    return
            print(f"raychat engine: {error}; starting a new engine process", file=sys.stderr, flush=True)
            try:
                proc, conn, _ = self._spawn()
            except Exception as e:  # noqa: BLE001 - kept as last_error; running stays False
                with self._lock:
                    self.last_error, self._restarting = e, False
                return
            with self._lock, self._send_lock:
                self._conn.close()
                self._proc, self._conn = proc, conn
                self.restarts += 1
                self._restarting = False
                if self._stopping:  # stop() came while the new child loaded
                    proc.kill()
                    return

    def _read_until_exit(self) -> RuntimeError | None:
        """Route every event from the child to its stream until the child's end of the socket closes (None),
        or until the child stalls (see the module doc): then kill it and return the stall error."""
        try:
            while True:
                if not self._conn.poll(BEAT_INTERVAL_S):
                    if self.stalled and not self._stopping:
                        return self._kill_stalled()
                    continue
                _, events, active = self._conn.recv()
                self._beat = time.monotonic()
                with self._lock:
                    self._active = active
                    for ev in events:
                        stream = self._streams.get(ev.request_id)
                        if stream is None:
                            continue
                        if ev.finished:
                            del self._streams[ev.request_id]
                            self._scoring.discard(ev.request_id)
                            self._cancelled.discard(ev.request_id)
                        stream._push(ev)
        except (EOFError, OSError):
            return None

    def _kill_stalled(self) -> RuntimeError:
        """Kill the hung child (SIGKILL also ends a stopped one); the stall error for its live streams."""
        error = RuntimeError(
            f"engine process stalled: no step for {self.stalled_s:.1f} s with {len(self._streams)} requests "
            f"live (stall_timeout_s={self.stall_timeout_s:g}); killed it, the replica's health check fails"
        )
        print(f"raychat engine: {error}", file=sys.stderr, flush=True)
        self._proc.kill()
        return error


def _child_main(conn: Connection) -> None:
    """The child: load the model, then alternate reading the pipe and stepping the Scheduler."""
    try:
        checkpoint, device, max_slots, max_len, threads, options = conn.recv()
        torch.set_num_threads(max(1, int(threads)))
        model, tokenizer, _meta = load_model(checkpoint, device=device)
        limits = {k: options.pop(k) for k in ("prefill_chunk_tokens", "request_timeout_s")}
        engine = ModelRunner(model, tokenizer, **options)
        scheduler = Scheduler(engine, max_slots=max_slots, max_len=max_len, **limits)
    except Exception as e:  # noqa: BLE001 - reported to the parent, which raises it
        conn.send(("failed", f"{type(e).__name__}: {e}"))
        return
    freeze_gc_heap()
    conn.send(("ready", {"max_slots": scheduler.max_slots, "max_len": scheduler.max_len}))
    try:
        _serve(conn, scheduler)
    except (EOFError, BrokenPipeError, ConnectionResetError):
        pass  # the parent is gone (its end of the socket closed): exit quietly


def _serve(conn: Connection, scheduler) -> None:
    streams: dict[str, RequestStream] = {}
    last_sent, sent_active = time.monotonic(), 0
    while True:
        busy = bool(streams)
        if conn.poll(0 if busy else None):
            while True:
                message = conn.recv()
                if message[0] == "stop":
                    return
                if message[0] in ("submit", "score"):
                    kind, request_id, prompt, payload = message
                    run = scheduler.submit if kind == "submit" else scheduler.score
                    try:
                        streams[request_id] = run(prompt, payload, request_id=request_id)
                    except ValueError as e:  # the parent checked the prompt; end the request, not the child
                        usage = Usage(len(prompt), 0, None, 0.0)
                        event = StreamEvent(request_id, "", [], True, "error", usage, str(e))
                        conn.send(("events", [event], scheduler.num_active))
                else:
                    scheduler.cancel(message[1])
                if not conn.poll(0):
                    break
        if not streams:
            continue
        scheduler.step()
        events = []
        for request_id, stream in list(streams.items()):
            while (event := stream._pop()) is not None:
                events.append(event)
                if event.finished:
                    del streams[request_id]
        active = scheduler.num_active
        if events or active != sent_active or time.monotonic() - last_sent >= BEAT_INTERVAL_S:
            conn.send(("events", events, active))  # with no events and the same num_active: a heartbeat
            last_sent, sent_active = time.monotonic(), active


if __name__ == "__main__":
    _child_main(Connection(int(sys.argv[1])))
