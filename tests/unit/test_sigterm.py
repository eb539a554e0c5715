"""SIGTERM ends a command as Ctrl-C does (raychat.sigterm): during a training run it runs the SIGINT handler of
the moment (Ray Train's, which stops the worker group), or raises Terminated; `raychat` ends on Terminated with
its one line and exit status 143; an RL run's Ctrl-C and SIGTERM name the checkpoint a new start resumes from.
Real signals to this process; tests/ray/test_train_layout.py SIGTERMs a real `raychat pretrain`."""

from __future__ import annotations

import os
import signal
import sys
import time
from types import SimpleNamespace

import pytest
from test_checkpoint_manager import save

from raychat.checkpoint_manager import CheckpointManager
from raychat.cli import main
from raychat.rl.loop import RLRun
from raychat.sigterm import SigtermAsSigint, Terminated
from raychat.storage import open_storage
from raychat.train.launch import COMMANDS, interrupted
from raychat.train.trainer import resumed_line


def _sigterm_self() -> None:
    """SIGTERM this process and wait for its handler to run (Python runs it between bytecodes, main thread)."""
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(5)
    raise AssertionError("SIGTERM's handler did not run")


@pytest.fixture
def handlers():
    """SIGINT's and SIGTERM's handlers as the test found them, set back after it."""
    before = signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)
    yield before
    signal.signal(signal.SIGINT, before[0])
    signal.signal(signal.SIGTERM, before[1])


def test_sigterm_runs_the_sigint_handler_then_in_place_and_both_handlers_are_set_back(handlers):
    """As Ray Train's trainer.fit does, a SIGINT handler is installed inside the block: SIGTERM runs it (once,
    with SIGINT) and is remembered; on the way out SIGINT's handler is the one from before the block (Ray Train
    leaves its own behind), and so is SIGTERM's."""
    calls = []
    signal.signal(signal.SIGINT, signal.default_int_handler)
    with SigtermAsSigint() as sigterm:
        signal.signal(signal.SIGINT, lambda signum, _frame: calls.append(signum))
        os.kill(os.getpid(), signal.SIGTERM)
        deadline = time.monotonic() + 5
        while not calls and time.monotonic() < deadline:
            time.sleep(0.01)
    assert calls == [signal.SIGINT] and sigterm.received
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    assert signal.getsignal(signal.SIGTERM) is handlers[1]


def test_sigterm_without_a_sigint_handler_of_its_own_raises_terminated(handlers):
    signal.signal(signal.SIGINT, signal.default_int_handler)
    with pytest.raises(Terminated), SigtermAsSigint() as sigterm:
        _sigterm_self()
    assert sigterm.received and signal.getsignal(signal.SIGTERM) is handlers[1]


@pytest.mark.parametrize(
    "line, printed",
    [
        (
            "pretrain run 't' stopped before its last step; the same command starts it again: it starts over "
            "(no checkpoint was committed)",
            "raychat pretrain: terminated (SIGTERM): pretrain run 't' stopped before its last step; the same "
            "command starts it again: it starts over (no checkpoint was committed)\n",
        ),
        ("", "raychat pretrain: terminated (SIGTERM)\n"),
    ],
)
def test_terminated_ends_raychat_in_its_line_and_exit_status_143(line, printed, monkeypatch, capsys):
    def terminated(_args):
        raise Terminated(line)

    monkeypatch.setattr("raychat.train.pretrain.main", terminated)
    assert main(["pretrain", "--run-name", "t"]) == 143
    assert capsys.readouterr().err == printed


@pytest.mark.skipif(sys.platform != "linux", reason="POSIX signals")
def test_an_rl_runs_sigterm_and_ctrl_c_name_the_checkpoint_a_new_start_resumes_from(tmp_path, handlers):
    """RL's Ctrl-C ended in a bare "interrupted", and its SIGTERM met Ray's native handler (an abort); both now
    end in interrupted's line, raised once _run (its loop; here one that receives the signal mid-step) is out,
    SIGTERM as Terminated."""
    checkpoints = CheckpointManager(open_storage(str(tmp_path / "runs")), "t", 2)
    save(checkpoints, tmp_path / "parts", 3)
    run = RLRun.__new__(RLRun)  # only what the line needs: the run's name and checkpoints
    run.cfg = SimpleNamespace(run=SimpleNamespace(run_name="t"), rollout=SimpleNamespace(steps=5))
    run.checkpoints, run.flags = checkpoints, COMMANDS
    line = (
        "rl run 't' stopped before its last step; the same command starts it again: it resumes from its newest "
        f"committed checkpoint {tmp_path / 'runs' / 't' / 'checkpoint_000003'}"
    )
    run._run = _sigterm_self
    with pytest.raises(Terminated) as terminated:
        run._run_to_a_stop()
    assert str(terminated.value) == line
    assert signal.getsignal(signal.SIGTERM) is handlers[1]

    def ctrl_c():
        raise KeyboardInterrupt

    run._run = ctrl_c
    with pytest.raises(KeyboardInterrupt) as interrupted:
        run._run_to_a_stop()
    assert str(interrupted.value) == line and type(interrupted.value) is KeyboardInterrupt


@pytest.mark.parametrize(
    "saved, num_iterations, stop_after, said",
    [
        (3, 8, -1, "pretrain run 't' stopped before its last step; the same command starts it again: it resumes "
         "from its newest committed checkpoint {d}"),
        # Ray Train stops the worker group within seconds: a short run can reach its end (or --stop-after) in
        # them; this line said "stopped before its last step ... the same command resumes" (which trained
        # nothing, or refused the --stop-after)
        (8, 8, -1, "pretrain run 't' was stopped after its last step: its checkpoint {d} is at step 8 of 8, so "
         "the run is finished (started again, it has no step left to train)"),
        (4, 8, 4, "pretrain run 't' was stopped after its checkpoint {d}: stopped at step 4 of 8 (--stop-after "
         "4): the run is not finished; the same command without --stop-after (or with a later one) resumes it "
         "to step 8"),
        (3, 8, 4, "pretrain run 't' stopped before its last step; the same command starts it again: it resumes "
         "from its newest committed checkpoint {d}"),
    ],
)  # fmt: skip
def test_a_stopped_runs_line_says_what_its_newest_checkpoint_leaves(
    saved, num_iterations, stop_after, said, tmp_path
):
    """A run of 8 steps SIGTERMed after step 5 trained on to step 8 while Ray Train stopped it, and its line said
    it stopped before its last step (measured: --preset tiny, checkpoints every 4 steps)."""
    checkpoints = CheckpointManager(open_storage(str(tmp_path / "runs")), "t", 2)
    save(checkpoints, tmp_path / "parts", saved)
    d = tmp_path / "runs" / "t" / f"checkpoint_{saved:06d}"
    assert interrupted("pretrain run 't'", checkpoints, num_iterations, stop_after) == said.format(d=d)


def test_a_resumed_runs_line_names_the_step_it_trains_next():
    """The worker's and RL's line said "resumed from .../checkpoint_000005 at step 5", the checkpoint's step,
    where the next step line reads "step 6/8" (steps count from 1)."""
    assert resumed_line("/r/t/checkpoint_000005", 5, "written by 2 workers", " on 1 worker") == (
        "resumed from /r/t/checkpoint_000005 (step 5, written by 2 workers): goes on at step 6 on 1 worker"
    )
    assert resumed_line("/r/t/checkpoint_000002", 2, "version 2") == (
        "resumed from /r/t/checkpoint_000002 (step 2, version 2): goes on at step 3"
    )
