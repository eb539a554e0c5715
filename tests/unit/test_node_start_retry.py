"""The test fixtures' retry of a Ray node start that hit Ray's startup timeout (support.cluster.start_with_retry),
driven by a real command in place of `ray start`: it fails like Ray's when told to, and refuses to start over a
session dir a failed attempt left behind."""

import subprocess
import sys

import pytest
from support.cluster import STARTUP_TIMEOUT, NodeStartError, remove_sessions, start_with_retry

# argv: ROOT FAILURES MESSAGE. Run k (1-based) fails printing MESSAGE while k <= FAILURES, else succeeds; each run
# first refuses a session dir left in ROOT (as a node start would collide with a failed one's files) and then
# makes one, with a session_latest link to it, as Ray does.
FAKE_START = r"""
import pathlib, sys
root, failures, message = pathlib.Path(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
runs = root / "runs"
k = len(runs.read_text()) + 1 if runs.exists() else 1
runs.write_text("x" * k)
if list(root.glob("session_*")):
    sys.exit("a failed start's session dir is still there")
(root / f"session_{k}").mkdir()
(root / "session_latest").symlink_to(root / f"session_{k}")
if k <= failures:
    sys.exit(message)
print("node up")
"""
RAY_TIMEOUT = (
    f"Exception: {STARTUP_TIMEOUT}. This could happen because some of the raylet failed to startup or the GCS "
    "has become overloaded."
)


def _start(root, failures: int, message: str = RAY_TIMEOUT):
    def start() -> str:
        done = subprocess.run(
            [sys.executable, "-c", FAKE_START, str(root), str(failures), message],
            capture_output=True,
            text=True,
        )
        if done.returncode:
            raise NodeStartError(f"ray node a: ray start exited with {done.returncode}\n{done.stderr}")
        return done.stdout.strip()

    return start


def _runs(root) -> int:
    return len((root / "runs").read_text())


def test_a_start_that_timed_out_is_cleaned_up_and_started_again(tmp_path, capsys):
    assert (
        start_with_retry(_start(tmp_path, failures=2), lambda: remove_sessions(tmp_path), "ray node a")
        == "node up"
    )
    assert _runs(tmp_path) == 3
    assert sorted(p.name for p in tmp_path.glob("session_*")) == ["session_3", "session_latest"]
    assert capsys.readouterr().err.splitlines() == [
        "ray node a: Ray's node start-up timed out (attempt 1 of 3); starting it again",
        "ray node a: Ray's node start-up timed out (attempt 2 of 3); starting it again",
    ]


def test_the_third_timeout_is_raised(tmp_path, capsys):
    with pytest.raises(NodeStartError, match=f"ray start exited with 1\nException: {STARTUP_TIMEOUT}"):
        start_with_retry(_start(tmp_path, failures=3), lambda: remove_sessions(tmp_path), "ray node a")
    assert _runs(tmp_path) == 3
    assert len(capsys.readouterr().err.splitlines()) == 2


def test_any_other_failure_is_raised_at_once_without_cleaning_up(tmp_path, capsys):
    cleaned = []
    message = "OSError: [Errno 98] Address already in use"
    with pytest.raises(NodeStartError, match="Address already in use"):
        start_with_retry(
            _start(tmp_path, failures=1, message=message), lambda: cleaned.append(1), "ray node a"
        )
    assert (_runs(tmp_path), cleaned, capsys.readouterr().err) == (1, [], "")


def test_a_local_ray_inits_bare_exception_is_retried_too(capsys):
    """A local ray.init() raises Ray's timeout as a bare Exception (ray/_private/node.py), not the RuntimeError
    of the `ray start` helpers: it was not retried (7 tests/ray errors of a loaded CI run)."""
    calls, cleaned = [], []

    def init():
        calls.append(1)
        if len(calls) == 1:
            raise Exception(RAY_TIMEOUT.removeprefix("Exception: "))  # noqa: TRY002 - as Ray raises it
        return "up"

    assert start_with_retry(init, lambda: cleaned.append(1), "local ray.init") == "up"
    assert (len(calls), cleaned) == (2, [1])
    assert capsys.readouterr().err == (
        "local ray.init: Ray's node start-up timed out (attempt 1 of 3); starting it again\n"
    )
