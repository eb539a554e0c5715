"""The resource requests Ray's AutoscalingCoordinator holds for the connected cluster (Ray 2.60: one detached
actor that every Ray Data executor and Ray Train run registers with, and that forwards the merged requests to
the autoscaler until each is cancelled or expires, 180 s after its last renewal)."""

from __future__ import annotations

import ray

COORDINATOR = ("AutoscalingCoordinator", "AutoscalingCoordinator")  # actor name, namespace


def autoscaling_requests() -> dict[str, list[dict]]:
    """{requester id: its requested bundles} held by the coordinator now; {} when none was ever created.
    Ray Data executors' ids start with "data-"."""
    name, namespace = COORDINATOR
    try:
        coordinator = ray.get_actor(name, namespace=namespace)
    except ValueError:
        return {}
    return ray.get(
        coordinator.__ray_call__.remote(
            lambda self: {k: list(v.requested_resources) for k, v in self._ongoing_reqs.items()}
        )
    )


def data_requesters() -> set[str]:
    """The Ray Data executors that hold a request now."""
    return {k for k in autoscaling_requests() if k.startswith("data-")}
