"""pytest-xdist scheduling of this suite (`make test`: `pytest -n 2`). Units of work, each run by one worker in
collection order: tests/cluster as a whole (its modules share the session's fixture cluster, started once), each
module of tests/ray (its module-scoped Ray instance starts once), and every other test on its own.

Why: a Ray-tier test spends about a third of its time waiting (a node to start or die, an autoscaler's idle
timeout, a health check): run one at a time, the Ray tiers kept the 2 cores busy 65% of the time (measured,
2026-12-04: 2273 CPU-s in 1758 s). Side by side, one worker's waits are the other's CPU time.

xdist's `--dist loadgroup` would group tests by `xdist_group` markers, but pytest-xdist 3.8 tags the grouped
test ids through `item._nodeid`, which pytest 9.2 no longer reads, so the groups are lost; this scheduler keys
the units on the test path instead.
"""

from __future__ import annotations

from xdist.scheduler import LoadScopeScheduling


def unit_of(nodeid: str) -> str:
    """The unit of work of a test id: "tests/cluster/" for that tier, the module for tests/ray, else the id."""
    if nodeid.startswith("tests/cluster/"):
        return "tests/cluster/"
    if nodeid.startswith("tests/ray/"):
        return nodeid.split("::", 1)[0]
    return nodeid


class TierScheduling(LoadScopeScheduling):
    """xdist's scope scheduling with unit_of as the scope. The units with the most tests go out first (xdist's
    --loadscope-reorder, on by default): tests/cluster, the longest, starts at once on a worker of its own while
    the other runs the tests/ray modules; single tests fill in last, on whichever worker runs short of work."""

    def _split_scope(self, nodeid: str) -> str:
        return unit_of(nodeid)
