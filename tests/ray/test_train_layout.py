"""The CPU layout check (raychat.train.layout): what fits runs, what would hang is refused before Ray starts;
the layout that used to hang (1 worker x 1.75 CPUs on 2 cores, issue 15) trains on the local cluster."""

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import ray
from support.cluster import _cmdline, _kill_leftovers, short_temp_dir
from support.serve_process import sigint_as_default

from raychat.train import layout
from raychat.train.layout import check_cpu_layout, data_reservation, start_or_connect
from raychat.train.pretrain import Pretraining
from raychat.train.sft import SFT


def test_data_reservation_covers_ray_datas_one_cpu_listing_task():
    assert data_reservation(Pretraining.data_cpus) == 1.0  # read tasks ask 0.25, ListFiles always 1
    assert data_reservation(1.5) == 1.5
    assert data_reservation(SFT.data_cpus) == 0.0  # SFT has no Ray Data


def test_layouts_that_fit_are_described():
    # the former preset on 2 CPUs: 2 x 0.5 + 1 for Ray Data = 2 of 2
    assert check_cpu_layout(2, 0.5, Pretraining.data_cpus, 2, 2) == (
        "layout: 2 workers x 0.5 CPUs (1 torch thread each) + 1 CPU for Ray Data of 2 CPUs"
    )
    # one worker with both cores on the local cluster of 2 cores + 1 logical CPU for Ray Data: 2 + 1 = 3 of 3
    assert check_cpu_layout(1, 2, Pretraining.data_cpus, 3, 3) == (
        "layout: 1 worker x 2 CPUs (2 torch threads each) + 1 CPU for Ray Data of 3 CPUs"
    )
    assert check_cpu_layout(1, 2, SFT.data_cpus, 2, 2).endswith("(2 torch threads each) of 2 CPUs")
    # the cpu preset on 2 cores: 2 x 1 + 1 = 3 of 3 (it said `2 worker(s) x 1 CPUs (1 torch thread(s) each)`)
    assert check_cpu_layout(2, 1.0, Pretraining.data_cpus, 3, 3) == (
        "layout: 2 workers x 1 CPU (1 torch thread each) + 1 CPU for Ray Data of 3 CPUs"
    )


def test_layouts_that_would_hang_are_refused_with_the_reason():
    # issue 15: 1.75 + 0.25 passed the old check (2 of 2) and the 1-CPU ListFiles task never ran
    with pytest.raises(
        ValueError, match=r"needs 2.75 CPUs; the cluster has 2: lower --cpus-per-worker to at most 1 "
    ):
        check_cpu_layout(1, 1.75, Pretraining.data_cpus, 2, 2)
    with pytest.raises(ValueError, match=r"--num-workers 3 x --cpus-per-worker 1 plus 1 CPU for Ray Data"):
        check_cpu_layout(3, 1, Pretraining.data_cpus, 3, 3)
    with pytest.raises(ValueError, match="one worker needs 2 CPUs, the largest node has 1"):
        check_cpu_layout(1, 2, SFT.data_cpus, 4, 1)  # 4 nodes of 1 CPU: no node can take the worker


def test_a_local_layout_that_cannot_fit_is_refused_before_ray_starts(monkeypatch):
    assert not ray.is_initialized()
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.setattr(layout, "local_cores", lambda: 2)  # the local cluster would have 2 + 1 CPUs
    with pytest.raises(
        ValueError, match=r"needs 3.5 CPUs; the cluster has 3: lower --cpus-per-worker to at most 2 "
    ):
        start_or_connect(1, 2.5, Pretraining.data_cpus)
    assert not ray.is_initialized()


@pytest.fixture(scope="module")
def corpus(tmp_path_factory, small_tokenizer):
    """3 train shards + 1 validation shard of the tokenizer's own vocabulary, and the tokenizer."""
    from raychat.data.corpus.shards import write_manifest, write_shards

    root = tmp_path_factory.mktemp("corpus")
    docs = [
        " ".join(["river stone light", "cloud tree bird"][i % 2] for _ in range(5 + i % 40))
        for i in range(200)
    ]
    entries = write_shards(docs, root / "shards", num_shards=3, row_group_size=64, log=lambda *_: None)
    write_manifest(root / "shards", {"source": "test", "shards": entries})
    small_tokenizer.save(root / "tok")
    return root


@pytest.fixture
def ray_tmp():
    """A short RAY_TMPDIR (Ray's AF_UNIX socket paths under it must stay within 107 bytes)."""
    path = str(short_temp_dir("layout-"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


def _pretrain_on_two_cores(corpus, tmp_path, ray_tmp, *flags):
    """`raychat pretrain` in a child process restricted to CPUs {0, 1} (a 2-core machine), no RAY_ADDRESS:
    it starts its own local Ray cluster (temp dir ray_tmp) and stops it when it exits."""
    cmd = _pretrain_command(corpus, tmp_path, "layout", "--num-iterations", "2", "--checkpoint-every", "0",
                            "--max-failures", "0", *flags)  # fmt: skip
    return subprocess.run(
        cmd, env=_local_env(ray_tmp), capture_output=True, text=True, timeout=600,
        preexec_fn=lambda: os.sched_setaffinity(0, {0, 1}),
    )  # fmt: skip


def _local_env(ray_tmp: str) -> dict[str, str]:
    """This environment without RAY_ADDRESS (the command starts its own local cluster, temp dir ray_tmp).
    Ray Train's preemption watcher is off (one actor process fewer a run: no node of a local cluster is ever
    drained)."""
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "RAYCHAT_THREADS")}
    env.update(RAY_TMPDIR=ray_tmp, RAY_AUTH_MODE="disabled", RAY_TRAIN_ENABLE_PREEMPTION_WATCHER="0")
    return env


def _pretrain_command(corpus, tmp_path, run_name: str, *flags: str) -> list[str]:
    """`raychat pretrain` of a depth-1 model on the corpus fixture into tmp_path/runs/<run_name>, then `flags`."""
    return [
        sys.executable, "-m", "raychat.cli", "pretrain", "--preset", "none",
        "--data-dir", str(corpus / "shards"), "--tokenizer-path", str(corpus / "tok"),
        "--storage-path", str(tmp_path / "runs"), "--run-name", run_name,
        "--depth", "1", "--aspect-ratio", "64", "--head-dim", "32", "--seq-len", "32", "--device-batch-size", "2",
        "--total-batch-size", "128", "--eval-every", "0", "--eval-tokens", "64", "--buffer-size", "8", *flags,
    ]  # fmt: skip


@pytest.mark.ray
@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs 2 cores")
def test_the_layout_that_hung_trains_two_steps_on_the_local_cluster(corpus, tmp_path, ray_tmp):
    done = _pretrain_on_two_cores(
        corpus, tmp_path, ray_tmp, "--num-workers", "1", "--cpus-per-worker", "1.75"
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "layout: 1 worker x 1.75 CPUs (2 torch threads each) + 1 CPU for Ray Data of 3 CPUs" in done.stdout
    assert "(a local Ray cluster: 2 cores + 1 for Ray Data)" in done.stdout
    assert done.stdout.startswith("data: 2 training shards, ")  # how many epochs, before the plan
    # Ray Train's INFO line of each rank's report (every metric and sample again) is left out
    assert "Reporting training result" not in done.stdout + done.stderr
    lines = (tmp_path / "runs" / "layout" / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(x)["step"] for x in lines] == [1, 2]


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs 2 cores")
def test_a_layout_beyond_the_local_cluster_is_refused_before_ray_starts(corpus, tmp_path, ray_tmp):
    done = _pretrain_on_two_cores(corpus, tmp_path, ray_tmp, "--num-workers", "2", "--cpus-per-worker", "1.5")
    assert done.returncode != 0
    assert "needs 4 CPUs; the cluster has 3: lower --cpus-per-worker to at most 1 " in done.stderr
    assert os.listdir(ray_tmp) == []  # Ray never started


@pytest.mark.ray
@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs 2 cores")
def test_sigterm_then_ctrl_c_mid_run_end_in_one_line_naming_the_checkpoint_it_resumes_from(
    corpus, tmp_path, ray_tmp
):
    """SIGTERM (`ray job stop`, kill, docker stop) met Ray's native handler: `*** SIGTERM received ***`, the
    workers trained on, exit status -6. Ctrl-C met Ray Train's SIGINT handler, which aborts the run and makes
    ray.get raise SystemExit(1): no line, exit status 1. Now a run SIGTERMed at step 2 ends with exit 143 and
    one line saying where the same command resumes (raychat.train.launch.interrupted), its lease gone; the same
    command resumes after that checkpoint, and Ctrl-C ends it with exit 130 and the same line."""
    env = _local_env(ray_tmp)
    cmd = _pretrain_command(corpus, tmp_path, "stop", "--num-iterations", "100000", "--checkpoint-every", "1",
                            "--num-workers", "1", "--cpus-per-worker", "1")  # fmt: skip
    run = tmp_path / "runs" / "stop"
    resumed_after = 0
    for signum, status, said in (
        (signal.SIGTERM, 143, "terminated (SIGTERM)"),
        (signal.SIGINT, 130, "interrupted"),
    ):
        proc = subprocess.Popen(
            cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
            preexec_fn=sigint_as_default,
        )  # fmt: skip
        steps = []
        try:
            for line in proc.stdout:
                if m := re.search(r"\bstep +(\d+)/", line):
                    steps.append(int(m.group(1)))
                if len(steps) == 2:
                    proc.send_signal(signum)
                    break
            out, err = proc.communicate(timeout=120)
            # a node process killed as its parent exits is gone within moments (30 s on a loaded machine)
            deadline = time.monotonic() + 30
            while (left := _naming(ray_tmp)) and time.monotonic() < deadline:
                time.sleep(0.1)
            left = [_cmdline(pid) for pid in left]
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait(10)
            _kill_leftovers(ray_tmp)
        committed = sorted(p for p in run.glob("checkpoint_*") if (p / "commit.json").exists())
        assert proc.returncode == status and committed, out[-3000:] + err[-3000:]
        assert steps[0] == resumed_after + 1, steps  # the second run resumes after the first one's checkpoint
        assert err.strip().splitlines()[-1] == (
            f"raychat pretrain: {said}: pretrain run 'stop' stopped before its last step; the same command "
            f"starts it again: it resumes from its newest committed checkpoint {committed[-1]}"
        ), err[-3000:]
        assert "SIGTERM received" not in err
        assert not (run / "lease.json").exists()
        assert left == [], left  # the worker group and the local Ray: stopped
        resumed_after = int(committed[-1].name.split("_")[1])


def _naming(marker: str) -> list[int]:
    """Ids of the processes whose command line contains `marker` (this test's Ray temp dir)."""
    pids = [int(e.name) for e in Path("/proc").iterdir() if e.name.isdigit() and int(e.name) != os.getpid()]
    return [pid for pid in pids if marker in " ".join(_cmdline(pid))]
