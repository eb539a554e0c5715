"""A local cluster a run starts (raychat.capacity.start_local_cluster) beside another Ray cluster of the machine:
Ray code in its processes that looks the cluster's address up (ray.util.state with no address, as Ray Train's
PlacementGroupCleaner actor does every second) finds this cluster, not "Found multiple active Ray instances"
nor the cluster a user's RAY_API_SERVER_ADDRESS names, and the cleaner removes the placement group of a
controller that died."""

import os
import time

import pytest
import ray
from ray._private.services import canonicalize_bootstrap_address_or_die, find_gcs_addresses
from ray.train.v2._internal.execution.controller.placement_group_cleaner import PlacementGroupCleaner
from ray.util.placement_group import placement_group, placement_group_table
from ray.util.state import get_actor
from support.cluster import LocalCluster, short_temp_dir

from raychat.capacity import start_local_cluster


@ray.remote(num_cpus=0)
class Probe:
    """What PlacementGroupCleaner does in its monitor thread: its own actor's state through the state API,
    the address left to Ray."""

    def actor_id(self) -> str:
        return ray.get_runtime_context().get_actor_id()

    def lookup(self) -> tuple[str, str]:
        return canonicalize_bootstrap_address_or_die(None), get_actor(self.actor_id()).state


def _removed_within(pg, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while placement_group_table(pg)["state"] != "REMOVED":
        if time.monotonic() > deadline:
            return False
        time.sleep(0.2)
    return True


@pytest.mark.ray
def test_a_local_cluster_beside_another_is_found_by_its_processes_and_its_cleaner_removes_a_dead_runs_group(
    monkeypatch,
):
    assert not ray.is_initialized()
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.delenv("RAY_GCS_SERVER_PORT", raising=False)
    other = LocalCluster(short_temp_dir("other-")).start({})  # a `ray start --head`: another GCS here
    # the user's dashboard address for `raychat submit` (ray.util.state reads it before RAY_ADDRESS): the state
    # API of the local cluster's processes asked that cluster instead
    monkeypatch.setenv("RAY_API_SERVER_ADDRESS", other.dashboard_url)
    try:
        start_local_cluster(num_cpus=1, log_to_driver=False)
        try:
            assert len(find_gcs_addresses()) >= 2
            assert "RAY_ADDRESS" not in os.environ and "RAY_GCS_SERVER_PORT" not in os.environ
            assert os.environ["RAY_API_SERVER_ADDRESS"] == other.dashboard_url
            address, state = ray.get(Probe.remote().lookup.remote(), timeout=60)
            assert address == ray.get_runtime_context().gcs_address
            assert state == "ALIVE"
            # Ray Train's cleaner as its controller starts it (placement_group_callback.py), the probe as the
            # controller: once that dies ungracefully, the cleaner removes the run's placement group.
            controller = Probe.remote()
            controller_id = ray.get(controller.actor_id.remote())
            pg = placement_group([{"CPU": 0.5}])
            ray.get(pg.ready(), timeout=60)
            cleaner = (
                ray.remote(num_cpus=0)(PlacementGroupCleaner)
                .options(lifetime="detached")
                .remote(controller_actor_id=controller_id, check_interval_s=0.2, get_actor_timeout_s=10,
                        stop_timeout=5)
            )  # fmt: skip
            ray.get(cleaner.start_monitoring.remote())
            ray.get(cleaner.register_placement_group.remote(pg))
            ray.kill(controller)
            assert _removed_within(pg, 30)
        finally:
            ray.shutdown()
    finally:
        other.stop()
