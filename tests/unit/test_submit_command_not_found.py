"""`raychat submit` of a job whose shell exits 127 (no such command): the hint fits what ran. The Jobs client is
replaced; tests/cluster/test_submit.py runs a stage with a --python that does not exist on a real cluster."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from raychat.cli import main as raychat_main
from raychat.ops import submit


class JobsClient:
    """A cluster whose every job fails with the shell's exit status 127; `entrypoints`: what was submitted."""

    def __init__(self):
        self.entrypoints = []

    def submit_job(self, **kwargs):
        self.entrypoints.append(kwargs["entrypoint"])
        return "raysubmit_1"

    def get_job_info(self, job_id: str):
        return SimpleNamespace(submission_id=job_id, driver_exit_code=127)


@pytest.fixture
def client(monkeypatch):
    jobs = JobsClient()
    monkeypatch.setattr(submit, "make_client", lambda address, token_file: jobs)
    monkeypatch.setattr(submit, "follow", lambda client, job_id, **kwargs: "FAILED")
    return jobs


def test_a_command_not_found_is_not_told_to_pass_python(client, capsys):
    """`command` runs its words as given, and --python plays no part in it: the hint said to pass --python."""
    assert raychat_main(["submit", "command", "nosuchtool", "--x"]) == 1
    assert client.entrypoints == ["nosuchtool --x"]
    err = capsys.readouterr().err
    assert "--python" not in err
    assert err.splitlines()[-1] == (
        "raychat submit: error: the job's shell found no such command ('nosuchtool': exit 127). `command` runs its "
        "words as given: 'nosuchtool' must be an executable on the PATH of the Ray node that ran the job, or its "
        "full path there"
    )


def test_a_stage_whose_python_is_not_found_is_told_to_pass_python(client, capsys):
    assert (
        raychat_main(
            [
                "submit",
                "--python",
                "/no/such/python",
                "tokenizer",
                "train",
                "--preset",
                "tiny",
                "--storage-path",
                "/mnt/r",
            ]
        )
        == 1
    )
    assert client.entrypoints == [
        "/no/such/python jobs/tokenizer.py train --preset tiny --storage-path /mnt/r"
    ]
    assert capsys.readouterr().err.splitlines()[-1] == (
        "raychat submit: error: the job's shell found no such command ('/no/such/python': exit 127). Pass --python "
        "with the cluster's Python (the one that runs Ray there), see docs/deployment.md"
    )
