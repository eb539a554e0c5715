"""`raychat submit --job-id ID` with ID taken: refused before anything is uploaded. The Jobs client is replaced
(the order of its calls is what is tested); tests/cluster/test_submit.py refuses a taken id on a real cluster. And `raychat jobs list`'s order."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import requests
from ray.job_submission import JobDetails, JobStatus, JobType
from support.fake_dashboard import RAY_VERSION, FakeDashboard, job_details

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


def test_jobs_list_keeps_a_job_on_one_line_whatever_its_entrypoint():
    """A driver's `python -c "<script>"` (listed with its command line) or a `command` job of several lines
    printed one line of `raychat jobs list` per line of its entrypoint, and a tab in it a fourth field: scripts
    that split stdout by line and tab read jobs that do not exist. Newlines, tabs and carriage returns are
    written as \\n, \\t and \\r."""
    driver = JobDetails(type=JobType.DRIVER, job_id="05000000", status=JobStatus.SUCCEEDED,
                        entrypoint='python -c "\nimport ray\nray.init()\r\n\tprint(1)\n"', start_time=1)  # fmt: skip
    lines = submit.job_lines([driver])
    assert lines == ['05000000\tSUCCEEDED\tpython -c "\\nimport ray\\nray.init()\\r\\n\\tprint(1)\\n"']
    assert [line.split("\t") for line in "\n".join(lines).split("\n")] == [
        ["05000000", "SUCCEEDED", 'python -c "\\nimport ray\\nray.init()\\r\\n\\tprint(1)\\n"']
    ]


class LostClient(JobsClient):
    """A job that runs on while the connection to the dashboard is lost as it is followed (a port-forward that
    drops, a head that restarts): the log stream ends as Ray's ends then (`closed`: "ws" for the websocket's
    abnormal closure, "http" for a clean close followed by a status request that finds nothing listening)."""

    def __init__(self, closed: str):
        super().__init__(set())
        self.closed = closed

    def submit_job(self, **kwargs):
        self.jobs.add(kwargs["submission_id"])
        return super().submit_job(**kwargs)

    def get_address(self):
        return "http://127.0.0.1:8299"

    async def tail_job_logs(self, job_id):
        yield "step 1\n"
        if self.closed == "ws":  # Ray's tail_job_logs on close code 1006
            raise RuntimeError("WebSocket connection closed unexpectedly with close code 1006")

    def get_job_status(self, job_id):
        raise requests.exceptions.ConnectionError(
            "HTTPConnectionPool(host='127.0.0.1', port=8299): Max retries exceeded with url: /api/jobs/j"
        )


@pytest.mark.parametrize("closed", ["ws", "http"])
def test_a_connection_lost_while_following_is_named_and_exits_4_not_1(monkeypatch, capsys, closed):
    """`raychat submit` ended in a traceback and exit status 1 (what a FAILED job gets) when the dashboard went
    away while it followed a job that runs on; both followers now end in one line, exit 4 (unreachable)."""
    client = LostClient(closed)
    monkeypatch.setattr(submit, "make_client", lambda address, token_file: client)
    reason = {
        "ws": "WebSocket connection closed unexpectedly with close code 1006",
        "http": "HTTPConnectionPool(host='127.0.0.1', port=8299): Max retries exceeded with url: /api/jobs/j",
    }[closed]
    line = (
        f"lost the connection to the Ray dashboard at http://127.0.0.1:8299 while following job j ({reason}); "
        "the job goes on without it: `raychat jobs logs --follow j` follows it again, `raychat jobs list` shows "
        "its status\n"
    )
    rc = raychat_main(["submit", "--job-id", "j", "command", "python", "-c", "print(1)"])
    out, err = capsys.readouterr()
    assert (rc, out) == (4, "step 1\n")
    assert err == "submitted j: python -c 'print(1)'\nraychat submit: error: " + line
    assert raychat_main(["jobs", "logs", "--follow", "j"]) == 4
    assert capsys.readouterr() == ("step 1\n", "raychat jobs: error: " + line)


class GoneClient(LostClient):
    """A job deleted from the cluster while it is followed (`ray job delete`, or a head restarted without its
    job history): its log stream ends, then the Jobs API answers its status request with 404."""

    def __init__(self):
        super().__init__("http")

    def get_job_status(self, job_id):
        raise RuntimeError(f"Request failed with status code 404: Job {job_id} does not exist.")


def test_a_job_deleted_while_it_is_followed_is_reported_gone_not_as_a_lost_connection(monkeypatch, capsys):
    """The 404 of the deleted job was reported as "lost the connection to the Ray dashboard ...", exit 4,
    though the dashboard answered; it is its own line, exit 2 as any job id the Jobs API does not find."""
    client = GoneClient()
    monkeypatch.setattr(submit, "make_client", lambda address, token_file: client)
    line = (
        "job j is no longer on the cluster at http://127.0.0.1:8299: the Jobs API answers that it does not exist "
        "(it was deleted while followed, e.g. `ray job delete j`, or its head restarted without its job "
        "history); its status and logs went with it\n"
    )
    rc = raychat_main(["submit", "--job-id", "j", "command", "python", "-c", "print(1)"])
    out, err = capsys.readouterr()
    assert (rc, out) == (2, "step 1\n")
    assert err == "submitted j: python -c 'print(1)'\nraychat submit: error: " + line
    assert raychat_main(["jobs", "logs", "--follow", "j"]) == 2
    assert capsys.readouterr() == ("step 1\n", "raychat jobs: error: " + line)


def test_a_job_deleted_before_its_log_stream_opens_is_reported_gone_not_as_a_traceback(monkeypatch, capsys):
    """Deleted between follow's first check (get_job_info answered) and the opening of its log stream, whose
    websocket handshake the dashboard answers 404: aiohttp's WSServerHandshakeError ended both followers in a
    traceback; they end in gone_line, exit 2, as a job deleted while followed. Ray's own Jobs client, against a
    loopback stub that answers as Ray's dashboard does for a job it no longer has."""
    monkeypatch.setenv("RAY_AUTH_TOKEN", "some-token")
    deleted = (404, b"Job j does not exist")
    replies = {"/api/version": (200, RAY_VERSION), "/api/jobs/j/logs/tail": deleted}
    with FakeDashboard(replies) as fake:
        client = submit.make_client(fake.url)
        checked = client.get_job_info

        def get_job_info_then_deleted(job_id):
            info = checked(job_id)
            replies[f"/api/jobs/{job_id}"] = deleted
            return info

        monkeypatch.setattr(client, "get_job_info", get_job_info_then_deleted)
        monkeypatch.setattr(client, "submit_job", lambda **kwargs: "j")  # no upload, no POST
        monkeypatch.setattr(submit, "make_client", lambda address, token_file: client)
        line = (
            f"job j is no longer on the cluster at {fake.url}: the Jobs API answers that it does not exist (it was "
            "deleted while followed, e.g. `ray job delete j`, or its head restarted without its job history); its "
            "status and logs went with it\n"
        )
        for argv, want in [
            (["submit", "command", "true"], "submitted j: true\nraychat submit: error: " + line),
            (["jobs", "logs", "--follow", "j"], "raychat jobs: error: " + line),
        ]:
            replies["/api/jobs/j"] = (200, job_details("j", "RUNNING"))
            assert raychat_main(argv) == 2
            assert capsys.readouterr() == ("", want)


def test_a_log_stream_refused_for_a_job_still_there_is_a_lost_connection(monkeypatch, capsys):
    """The dashboard refuses the websocket of the log stream (a proxy's 502) of a job it still has: not gone, the
    job runs on without its follower (lost_line, exit 4), where it ended in aiohttp's traceback."""
    monkeypatch.setenv("RAY_AUTH_TOKEN", "some-token")
    replies = {
        "/api/version": (200, RAY_VERSION),
        "/api/jobs/j": (200, job_details("j", "RUNNING")),
        "/api/jobs/j/logs/tail": (502, b"Bad Gateway"),
    }
    with FakeDashboard(replies) as fake:
        assert raychat_main(["jobs", "logs", "--follow", "j", "--address", fake.url]) == 4
        assert capsys.readouterr() == (
            "",
            f"raychat jobs: error: lost the connection to the Ray dashboard at {fake.url} while following job j "
            "(the dashboard refused the job's log stream: 502, message='Invalid response status', "
            f"url='{fake.url}/api/jobs/j/logs/tail'); the job goes on without it: `raychat jobs logs --follow j` "
            "follows it again, `raychat jobs list` shows its status\n",
        )
