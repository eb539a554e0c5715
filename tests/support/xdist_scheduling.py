"""How `make test` spreads the suite over pytest-xdist workers (`-n 2 --dist loadfile`, tests/conftest.py).

loadfile, except that the whole cluster tier (tests/cluster) is one unit: its modules share the session's
fixture cluster (conftest.py: multinode_cluster), which then starts once, in one worker, and the tier's clusters
never run beside each other. Units go out in collection order (--no-loadscope-reorder; conftest.py queues the
longest waits first), not xdist's default of the most tests first.

Why not `--dist loadgroup` with xdist_group marks: pytest-xdist 3.8 tags a grouped test by assigning
`item._nodeid`, which pytest 9.2 no longer reads (Node.nodeid comes from `_id`), so every group is ignored.
"""

from __future__ import annotations

from xdist.scheduler import LoadFileScheduling

CLUSTER_TIER = "tests/cluster/"


class ClusterTierAsOneUnit(LoadFileScheduling):
    """LoadFileScheduling whose unit of work is the test's file, or the whole cluster tier."""

    def _split_scope(self, nodeid: str) -> str:
        path = nodeid.split("::", 1)[0]
        return CLUSTER_TIER if path.startswith(CLUSTER_TIER) else path
