"""raychat.capacity.WaitReporter: what a run waiting for the cluster prints, on a real local Ray instance."""

import io
import re
import time

import pytest

from raychat.capacity import (
    WaitReporter,
    autoscaler_running,
    check_bundles,
    monitor_status,
    read_capacity,
    read_only_monitor,
)


def said(out: io.StringIO, n: int, timeout_s: float = 60) -> list[str]:
    """The reporter's lines once it has said `n` (it looks every second, slower on a loaded machine)."""
    deadline = time.monotonic() + timeout_s
    while len(lines := out.getvalue().splitlines()) < n:
        assert time.monotonic() < deadline, f"{n} line(s) not said within {timeout_s} s: {lines}"
        time.sleep(0.1)
    return lines


def test_a_wait_is_reported_then_its_end_once(ray_cluster):
    """While pending: a "waiting" line naming what and how many nodes are alive, at the first look (not after
    every_s); the caller who saw the placement first says "placed ... after N s" (stop(placed=True)), once."""
    out = io.StringIO()
    reporter = WaitReporter("2 workers x CPU 0.5", lambda: "pending", every_s=60, out=out).start()
    said(out, 1)
    reporter.stop(placed=True)
    lines = out.getvalue().splitlines()
    assert len(lines) == 2, lines
    waiting = re.fullmatch(
        r"waiting (\d+) s for 2 workers x CPU 0\.5: 1 alive node; the autoscaler may add more",
        lines[0],
    )
    placed = re.fullmatch(r"placed 2 workers x CPU 0\.5 after (\d+) s", lines[1])
    assert waiting and placed, lines
    assert 1 <= int(waiting[1]) <= int(placed[1]) < 60, lines  # the first look is 1 s in, not every_s


def test_the_reporter_sees_the_placement_itself_and_nothing_is_said_without_a_wait(ray_cluster):
    states = iter(["pending", "placed"])
    out = io.StringIO()
    reporter = WaitReporter("the group", lambda: next(states, "placed"), out=out).start()
    said(out, 2)
    reporter._thread.join(5)
    assert not reporter._thread.is_alive()  # it said "placed" itself and ended, before any stop()
    reporter.stop(placed=True)
    assert [line.split(" s ")[0].split(" ")[0] for line in out.getvalue().splitlines()] == [
        "waiting",
        "placed",
    ]
    quiet = io.StringIO()
    WaitReporter("the group", lambda: "placed", out=quiet).start().stop(placed=True)
    assert quiet.getvalue() == ""


def test_a_cluster_started_by_this_process_is_its_alive_nodes(ray_cluster):
    """ray.init() without an address starts a cluster that nothing grows, although its monitor (a read-only
    provider) writes the autoscaler status: a layout it cannot hold is refused at once, not waited for until
    --schedule-timeout-s."""
    deadline = time.monotonic() + 30
    while not read_only_monitor(monitor_status() or {}):  # its first report comes a few seconds after start
        assert time.monotonic() < deadline, "no read-only report from the local monitor"
        time.sleep(0.5)
    assert not autoscaler_running()
    capacity = read_capacity()
    assert (capacity.source, capacity.known, capacity.total("CPU")) == ("alive nodes", True, 2.0)
    with pytest.raises(
        ValueError,
        match=r"^--cpus-per-rollout: one of them needs \{CPU: 8\}; no node type has room: CPU \(need 8, the most a node has is 2\)",
    ):
        check_bundles([{"CPU": 8}], capacity, "--cpus-per-rollout")
