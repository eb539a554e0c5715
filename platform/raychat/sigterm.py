"""SIGTERM (`ray job stop`'s stop of a job's driver, `kill`, `docker stop`, Kubernetes) ending a command as Ctrl-C
does: a Python exception in the main thread (Terminated), so that finally blocks run (a run's lease released, its
local Ray shut down) and the command ends in one line of its own, exit status 143 (raychat.cli).

Ray's core worker installs a native SIGTERM handler at ray.init (a stack trace, `*** SIGTERM received ***`, an
abort: exit status -6), replacing whatever Python had; a handler installed after ray.init replaces it in turn
(signal.signal is sigaction). ray.init itself runs under init_keeping_handler when SIGTERM must be caught while
Ray starts. The training commands (raychat.cli.TERMINATING) run under terminating() from their first moment, so
that SIGTERM raises Terminated wherever it lands: their imports, checks, Ray's start, the run (SigtermAsSigint),
their way out. Everything here acts in the main thread only (Python runs signal handlers there).
"""

from __future__ import annotations

import contextlib
import logging
import signal
import threading


class Terminated(BaseException):
    """SIGTERM arrived. A BaseException, as KeyboardInterrupt: Ray's waits within start-up catch Exception. Its
    message, when it has one, is the command's line (a training run's: where the same command resumes)."""


def raise_terminated(_signum, _frame):
    """The SIGTERM handler that raises Terminated."""
    raise Terminated


@contextlib.contextmanager
def terminating():
    """In a `with` block, in the main thread: SIGTERM raises Terminated (raise_terminated), for a command's whole
    life (raychat.cli: the training commands, from before their imports); its Ray starts through
    init_keeping_handler, and SigtermAsSigint sets it back after a run. The handler of before is back on the way
    out. Elsewhere (another thread) the block runs as it is."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGTERM, raise_terminated)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous if previous is not None else signal.SIG_DFL)


class SigtermAsSigint:
    """In a `with` block, in the main thread: SIGTERM does what Ctrl-C does at that moment and is remembered
    (`received`). While Ray Train's trainer.fit waits, that is Ray Train's SIGINT handler (its controller aborts
    the run: the worker group stops, then fit raises SystemExit); where Python's own SIGINT handler is in place,
    it raises Terminated. Enter it after ray.init (see the module's docstring). On the way out, SIGTERM's and
    SIGINT's handlers are those of its start (Ray Train leaves its own SIGINT handler behind, bound to a
    controller that is gone)."""

    def __init__(self) -> None:
        self.received = False
        self._previous: dict[int, object] = {}

    def __enter__(self) -> SigtermAsSigint:
        if threading.current_thread() is threading.main_thread():
            self._previous = {signal.SIGINT: signal.getsignal(signal.SIGINT)}
            self._previous[signal.SIGTERM] = signal.signal(signal.SIGTERM, self._on_sigterm)
        return self

    def __exit__(self, *_exc) -> bool:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler if handler is not None else signal.SIG_DFL)
        return False

    def _on_sigterm(self, _signum, frame) -> None:
        self.received = True
        sigint = signal.getsignal(signal.SIGINT)
        if not callable(sigint) or sigint is signal.default_int_handler:
            raise Terminated
        sigint(signal.SIGINT, frame)


def init_keeping_handler(init, **kwargs) -> None:
    """init(**kwargs) (ray.init or raychat.capacity.start_local_cluster). Under the raise_terminated handler it runs
    in a thread of its own while this (main) thread waits and keeps that handler in place: in the main thread
    ray.init installs Ray's, whose SystemExit, raised amid its process starts (in a fork handler), hung the
    command, and Ray's core worker a native one (a stack trace, an abort). A SIGTERM (or Ctrl-C) meanwhile lets
    ray.init end, then raises Terminated (or KeyboardInterrupt); a second SIGTERM ends the process at once. Under any
    other handler, init runs here as it is. Raises what init raises."""
    if signal.getsignal(signal.SIGTERM) is not raise_terminated:
        init(**kwargs)
        return
    failed: list[BaseException] = []
    done = threading.Event()  # not Thread.join: a signal's exception within it marks a live thread ended

    def run() -> None:
        try:
            init(**kwargs)
        except BaseException as e:  # noqa: BLE001 - raised in the caller's thread below
            failed.append(e)
        finally:
            done.set()
        # stay: the node processes a local ray.init starts are killed when the THREAD that started them
        # ends (their PR_SET_PDEATHSIG), so this one lives as long as the process
        threading.Event().wait()

    ray_log = logging.getLogger("ray._private.worker")
    ray_log.addFilter(_not_main_thread_warning)  # misleading: SIGTERM has main's handler
    thread = threading.Thread(target=run, name="raychat-ray-init", daemon=True)
    thread.start()
    try:
        while not done.is_set():
            signal.signal(signal.SIGTERM, raise_terminated)  # again: the core worker's native one replaced it
            done.wait(0.05)
        signal.signal(signal.SIGTERM, raise_terminated)
    except (Terminated, KeyboardInterrupt):
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        done.wait()  # ray.init cannot be stopped part way; what it started is shut down after it
        raise
    finally:
        ray_log.removeFilter(_not_main_thread_warning)
    if failed:
        raise failed[0]


def _not_main_thread_warning(record: logging.LogRecord) -> bool:
    return not record.getMessage().startswith("SIGTERM handler is not set because current thread")
