"""`raychat submit --job-id ID` with ID taken: refused before anything is uploaded. The Jobs client is replaced
(the order of its calls is what is tested); tests/cluster/test_submit.py refuses a taken id on a real cluster. And `raychat jobs list`'s order."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from ray.job_submission import JobDetails, JobStatus, JobType

from raychat.cli import main as raychat_main
from raychat.ops import submit


class JobsClient:
    """Records the calls of `raychat submit`; `jobs`: the submission ids already on the cluster."""

    def __init__(self, jobs: set[str]):
        self.jobs, self.calls = jobs, []

    def get_job_info(self, job_id: str):
        self.calls.append(("get_job_info", job_id))
        if job_id not in self.jobs:  # the Jobs API's answer (Ray's JobSubmissionClient._raise_error)
            raise RuntimeError(f"Request failed with status code 404: Job {job_id} does not exist.")
        return SimpleNamespace(submission_id=job_id)

    def submit_job(self, **kwargs):  # Ray's uploads the working dir and py_modules here, then submits
        self.calls.append(("submit_job", kwargs["submission_id"]))
        return kwargs["submission_id"]


@pytest.fixture
def client(monkeypatch):
    jobs = JobsClient({"taken"})
    monkeypatch.setattr(submit, "make_client", lambda address, token_file: jobs)
    return jobs


def test_a_taken_job_id_is_refused_before_the_upload(client, capsys):
    """The working dir and raychat were uploaded (submit_job) before Ray refused the id."""
    rc = raychat_main(["submit", "--job-id", "taken", "--no-wait", "command", "python", "-c", "print(1)"])
    assert (rc, client.calls) == (2, [("get_job_info", "taken")])
    assert capsys.readouterr().err == (
        "raychat submit: error: --job-id taken: a job with this submission id already exists on this cluster; "
        "choose another\n"
    )


def test_a_free_job_id_is_submitted(client, capsys):
    rc = raychat_main(["submit", "--job-id", "free", "--no-wait", "command", "python", "-c", "print(1)"])
    assert (rc, client.calls) == (0, [("get_job_info", "free"), ("submit_job", "free")])
    assert capsys.readouterr().out == "free\n"
    rc = raychat_main(
        ["submit", "--no-wait", "command", "python", "-c", "print(1)"]
    )  # no id: nothing to check
    assert (rc, client.calls[2:]) == (0, [("submit_job", None)])


def test_jobs_list_prints_oldest_start_first():
    """`raychat jobs list`: Ray's list_jobs returns jobs in no stated order; the lines come oldest start first
    (ties by id), a job without a submission id under its job id."""

    def job(sid, start, status=JobStatus.SUCCEEDED, job_id=None):
        return JobDetails(type=JobType.SUBMISSION, submission_id=sid, job_id=job_id, status=status,
                          entrypoint=f"run {sid or job_id}", start_time=start)  # fmt: skip

    jobs = [
        job("b", 2000),
        job("c", 1000, JobStatus.RUNNING),
        job(None, 1500, job_id="02000000"),
        job("a", 2000),
    ]
    assert submit.job_lines(jobs) == [
        "c\tRUNNING\trun c",
        "02000000\tSUCCEEDED\trun 02000000",
        "a\tSUCCEEDED\trun a",
        "b\tSUCCEEDED\trun b",
    ]
