"""Fixtures of the ray tier: one local Ray instance per test module."""

import pytest
import ray
from support.cluster import init_local_ray


@pytest.fixture(scope="module")
def ray_cluster():
    """A local Ray instance of 2 CPUs (no dashboard) for one test module, shut down after it. A module that
    needs another size defines its own ray_cluster."""
    init_local_ray(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        yield
    finally:
        ray.shutdown()
