"""A local cluster a run starts (raychat.capacity.start_local_cluster) beside another Ray cluster of the machine:
Ray code in its processes that looks the cluster's address up (ray.util.state with no address, as Ray Train's
PlacementGroupCleaner actor does every second) finds this cluster, not "Found multiple active Ray instances"."""

import os

import pytest
import ray
from ray._private.services import canonicalize_bootstrap_address_or_die, find_gcs_addresses
from ray.util.state import get_actor
from support.cluster import LocalCluster, short_temp_dir

from raychat.capacity import start_local_cluster


@ray.remote(num_cpus=0)
class Probe:
    """What PlacementGroupCleaner does in its monitor thread: its own actor's state through the state API,
    the address left to Ray."""

    def lookup(self) -> tuple[str, str]:
        me = ray.get_runtime_context().get_actor_id()
        return canonicalize_bootstrap_address_or_die(None), get_actor(me).state


@pytest.mark.ray
def test_the_processes_of_a_local_cluster_find_it_beside_another_cluster(monkeypatch):
    assert not ray.is_initialized()
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.delenv("RAY_GCS_SERVER_PORT", raising=False)
    other = LocalCluster(short_temp_dir("other-")).start({})  # a `ray start --head`: another GCS here
    try:
        start_local_cluster(num_cpus=1, log_to_driver=False)
        try:
            assert len(find_gcs_addresses()) >= 2
            assert "RAY_ADDRESS" not in os.environ and "RAY_GCS_SERVER_PORT" not in os.environ
            address, state = ray.get(Probe.remote().lookup.remote(), timeout=60)
            assert address == ray.get_runtime_context().gcs_address
            assert state == "ALIVE"
        finally:
            ray.shutdown()
    finally:
        other.stop()
