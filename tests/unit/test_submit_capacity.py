"""`raychat submit`'s check of a job's entrypoint resources (raychat.ops.submit.check_entrypoint_fits) where the
cluster's status cannot be read; tests/cluster/test_submit.py runs the check against real clusters."""

from __future__ import annotations

from raychat.ops.submit import check_entrypoint_fits, fixed_cluster_capacity


class JobsClientWithoutDoRequest:
    """A Jobs client of a Ray whose JobSubmissionClient no longer has the private `_do_request`."""


def test_a_jobs_client_without_do_request_cannot_tell_and_the_submission_goes_on():
    """An AttributeError from the missing method crashed `raychat submit --num-gpus 1` instead of leaving the
    job to Ray, as a dashboard that does not answer does."""
    client = JobsClientWithoutDoRequest()
    assert fixed_cluster_capacity(client) is None
    assert check_entrypoint_fits(client, {"GPU": 1.0}, "--num-gpus 1") is None  # not refused
