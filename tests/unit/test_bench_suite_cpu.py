"""bench/suite_cpu.py: a process's kind from the command lines it was seen with, and a real run that sums the
CPU seconds of a command's descendants under their kinds and exits with the command's status."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench"
sys.path.insert(0, str(BENCH))
from suite_cpu import Sampler, kind_of  # noqa: E402

VENV = "/r/.venv/lib/python3.11/site-packages"


@pytest.mark.parametrize(
    "titles, kind",
    [
        # a Ray worker keeps the last title it had that was not IDLE, method names dropped
        ([f"/r/.venv/bin/python -u {VENV}/ray/_private/workers/default_worker.py --node-ip-address=1",
          "ray::IDLE", "ray::RayTrainWorker.__init__", "ray::RayTrainWorker", "ray::IDLE"],
         ("ray::RayTrainWorker", "Ray worker")),
        (["ray::IDLE"], ("ray::IDLE", "Ray worker")),
        (["ray::ServeReplica:raychat:ChatServer"], ("ray::ServeReplica:raychat:ChatServer", "Ray worker")),
        (["ray::DashboardAgent"], ("ray::DashboardAgent", "Ray daemon")),
        ([f"{VENV}/ray/core/src/ray/raylet/raylet --raylet_socket_name=/tmp/x"], ("raylet", "Ray daemon")),
        ([f"/r/.venv/bin/python -u {VENV}/ray/_private/log_monitor.py --session-dir=/tmp/s"],
         ("log monitor", "Ray daemon")),
        (["ray-dashboard-JobHead-0 (/r/.venv/bin/python3 -B -c from multiprocessing.forkserver import main)"],
         ("dashboard module", "Ray daemon")),
        (['/r/.venv/bin/python3 -u -c import sys;exec(eval(sys.stdin.readline()))'],
         ("pytest-xdist worker", "pytest")),
        (["/r/.venv/bin/python3 -m raychat.cli serve --checkpoint /tmp/ck --port 8000"],
         ("python3 -m raychat.cli serve", "other")),
        (["/r/.venv/bin/python3 /r/.venv/bin/pytest -q -n 2"], ("python3 pytest", "pytest")),
        (["python jobs/pretrain.py --preset tiny"], ("python pretrain.py", "other")),
        (["/usr/bin/python3 -c import os; print(1)"], ("python3 -c", "other")),
        ([""], ("?", "other")),
    ],
)  # fmt: skip
def test_kind_of(titles, kind):
    assert kind_of(titles) == kind


def test_a_name_cut_to_15_characters_counts_under_the_one_kind_it_cuts():
    """A Ray process seen only by its comm ("ray::RayTrainWo", its command line unreadable) is counted as the
    one kind it cuts, in that kind's family; one that cuts two kinds, or none, stays as it is."""
    s = Sampler(root=0)
    seen = [
        ("ray::RayTrainWorker", 4.0), ("ray::RayTrainWo", 1.5), ("ray::DashboardAgent", 1.0),
        ("ray::DashboardA", 0.5), ("ray::ServeReplica:a:X", 1.0), ("ray::ServeReplica:a:Y", 1.0),
        ("ray::ServeRepli", 0.25), ("ray::ReadShards", 2.0),
    ]  # fmt: skip
    for pid, (title, cpu) in enumerate(seen):
        s.cpu[(pid, 0.0)], s.titles[(pid, 0.0)] = cpu, [title]
    cpu, count, family = s.by_kind()
    assert cpu == {
        "ray::RayTrainWorker": 5.5, "ray::DashboardAgent": 1.5, "ray::ServeReplica:a:X": 1.0,
        "ray::ServeReplica:a:Y": 1.0, "ray::ServeRepli": 0.25, "ray::ReadShards": 2.0,
    }  # fmt: skip
    assert count["ray::RayTrainWorker"] == 2 and count["ray::DashboardAgent"] == 2
    assert family == {"Ray worker": 9.75, "Ray daemon": 1.5}


def test_a_child_seen_before_its_exec_is_named_by_its_own_command():
    xdist = "/r/.venv/bin/python3 -u -c import sys;exec(eval(sys.stdin.readline()))"
    assert kind_of([xdist, "/r/.venv/bin/python3 -m raychat.cli serve --port 1"]) == (
        "python3 -m raychat.cli serve",
        "other",
    )


def test_a_run_sums_its_descendants_cpu_and_exits_with_the_commands_status(tmp_path):
    """The command starts a script that burns ~0.8 CPU-s (then sleeps, so a sample sees all of it), then exits
    3: the script's CPU is attributed under its kind (the program and the script's file name), and the tool
    exits 3."""
    burner = tmp_path / "burner.py"
    burner.write_text(
        "import time\nt = time.process_time()\nwhile time.process_time() - t < 0.8:\n    pass\ntime.sleep(1)\n"
    )
    parent = f"import subprocess, sys; subprocess.run([sys.executable, {str(burner)!r}]); sys.exit(3)"
    r = subprocess.run(
        [sys.executable, str(BENCH / "suite_cpu.py"), "--interval", "0.1", "--", sys.executable, "-c", parent],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert r.returncode == 3, r.stderr
    result = json.loads(r.stdout.strip().splitlines()[-1])
    assert result["bench"] == "suite_cpu" and result["returncode"] == 3 and result["processes"] == 2
    child = result["kinds"][f"{Path(sys.executable).name} burner.py"]
    assert 0.75 <= child <= 1.5, result
    assert result["attributed_cpu_s"] >= child and result["busy_cpu_s"] >= 0.7
    assert "| kind | CPU-s | share | processes |" in r.stdout
