"""RL on a local Ray cluster: weight sync (same hash and version everywhere), a killed rollout actor (during a
rollout, and between a weight sync and its next rollout, on both sync paths), resume."""

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time

import pytest
import ray
from ray.exceptions import ActorUnavailableError, RayActorError
from support.cluster import short_temp_dir
from support.rl_fixtures import rl_config, tiny_checkpoint, tiny_config

from raychat.rl import dispatcher as rl_dispatcher
from raychat.rl.actors import ActorGroup
from raychat.rl.dispatcher import RolloutDispatcher
from raychat.rl.learner import LearnerActor
from raychat.rl.loop import RLRun, rl_tasks
from raychat.rl.rollout import RolloutActor
from raychat.rl.sync import WeightSync
from raychat.rl.weights import create_collective_group, sync_object_store

pytestmark = pytest.mark.ray


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory, small_tokenizer):
    return tiny_checkpoint(tmp_path_factory.mktemp("rl") / "ck", small_tokenizer, seed=1)


def test_sync_gives_every_rollout_the_same_weights_and_version(ray_cluster, checkpoint):
    cfg = rl_config(init_from=checkpoint, task_examples=8, eval_examples=2, max_operand=9)
    tasks = rl_tasks(cfg)
    learner = LearnerActor.options(num_cpus=0.5).remote(checkpoint, cfg)
    rollouts = [RolloutActor.options(num_cpus=0.5).remote(checkpoint, tasks, i) for i in range(2)]
    before = ray.get(learner.weights_hash.remote())
    assert {i["hash"] for i in ray.get([w.info.remote() for w in rollouts])} == {before}
    batch = [
        {"tokens": [1, 5, 9, 20, 21], "mask": [0, 0, 0, 1, 1], "advantage": 1.0},
        {"tokens": [1, 6, 40, 41], "mask": [0, 0, 1, 1], "advantage": -1.0},
    ]
    assert ray.get(learner.step.remote(batch))["version"] == 1
    after = ray.get(learner.weights_hash.remote())
    assert after != before
    result = sync_object_store(learner, rollouts, version=1)
    assert result["hash"] == after and result["version"] == 1 and result["sync_time_s"] > 0
    infos = ray.get([w.info.remote() for w in rollouts])
    assert [(i["version"], i["hash"]) for i in infos] == [(1, after), (1, after)]
    # the rollouts now sample from the new weights and tag samples with version 1
    out = ray.get(rollouts[1].rollout.remote([0], 2, 3, 1.0, 0))
    assert [s["version"] for s in out["samples"]] == [1, 1]
    for a in [learner, *rollouts]:
        ray.kill(a)


def test_killed_rollout_actor_run_goes_on_and_resumes(ray_cluster, checkpoint, tmp_path):
    killed = []

    pids = {}

    def kill_at_step_1(dispatcher, step, chunks):
        if step == 0:
            pids.update(ray.get(dispatcher.actors.rollouts[0].info.remote()))
        if step == 1 and not killed:  # SIGKILL right after its rollout chunk was submitted: it dies in flight
            os.kill(pids["pid"], signal.SIGKILL)
            killed.append(pids["pid"])

    cfg = tiny_config(checkpoint, str(tmp_path), steps=3, max_tokens=24)
    t0 = time.perf_counter()
    run = RLRun(cfg, on_submitted=kill_at_step_1, log=lambda m: print(f"{time.perf_counter() - t0:.2f} {m}"))
    submit = run.dispatcher.submit

    def stop_then_submit(step):
        if step == 1 and not killed:  # stopped first: its chunk cannot run before the kill (SIGKILL)
            os.kill(pids["pid"], signal.SIGSTOP)
        return submit(step)

    run.dispatcher.submit = stop_then_submit
    summary = run.run()
    assert killed and summary["restarts"] >= 1 and summary["version"] == 3
    baseline, *lines = [json.loads(x) for x in (tmp_path / "t" / "metrics.jsonl").read_text().splitlines()]
    assert baseline == {"step": 0, "eval": summary["evals"][0]}  # the baseline evaluation, stored
    assert lines[0]["restarts"] == 0 and lines[1]["restarts"] >= 1  # detected while collecting step 2
    assert [x["step"] for x in lines] == [1, 2, 3]
    # the killed actor's prompts of step 2 (index 1) were re-issued and completed: every prompt, G samples each
    assert lines[1]["prompts"] == sorted(run.dispatcher.prompts_for(1)) and lines[1]["num_samples"] == 4 * 2
    assert lines[1]["staleness_max"] == 0  # re-synced before re-issue
    assert {p.name for p in (tmp_path / "t").glob("checkpoint_*")} == {
        "checkpoint_000002",
        "checkpoint_000003",
    }

    # same --out / --run-name: resumes from checkpoint_000003 with its optimizer state
    resumed = RLRun(tiny_config(checkpoint, str(tmp_path), steps=4, max_tokens=24)).run()
    assert resumed["start_step"] == 3 and resumed["version"] == 4
    lines = [json.loads(x) for x in (tmp_path / "t" / "metrics.jsonl").read_text().splitlines()]
    assert [x["step"] for x in lines] == [0, 1, 2, 3, 4]
    # the run's evaluations, not this invocation's alone ([4]): the baseline (step 0) and step 3's are read
    # back, so the speedrun's "pass@1 before -> after" of a resumed RL stage starts at the baseline
    assert resumed["evals"][:2] == summary["evals"] and [e["step"] for e in resumed["evals"]] == [0, 3, 4]


def restart(actor, timeout_s: float = 120) -> tuple[dict, dict]:
    """SIGKILL a rollout actor's process and wait until Ray has restarted it; (info before, info after)."""
    before = ray.get(actor.info.remote())
    os.kill(before["pid"], signal.SIGKILL)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            after = ray.get(actor.info.remote(), timeout=10)
            if after["pid"] != before["pid"]:
                return before, after
        except (ActorUnavailableError, RayActorError, ray.exceptions.GetTimeoutError):
            pass
        time.sleep(0.2)
    raise AssertionError(f"rollout actor {before['worker']} did not restart within {timeout_s} s")


@pytest.mark.parametrize("weight_sync", ["object_store", "collective"])
def test_an_actor_restarted_after_a_sync_is_resynced_before_it_generates(
    ray_cluster, checkpoint, tmp_path, weight_sync
):
    """Rollout actor 0 acks version 2, then dies and restarts (holding the checkpoint's weights, version 0)
    before step 3's rollouts are issued. Without the version check its samples would be trained at
    staleness 2; with it the actor generates nothing, is re-synced (collective: the gloo group is rebuilt)
    and the prompts are issued again: every sample trained is on-policy."""
    cfg = tiny_config(checkpoint, str(tmp_path), steps=3, weight_sync=weight_sync, checkpoint_every=100)
    run = RLRun(cfg, log=print)
    submit, seen = run.dispatcher.submit, {}

    def kill_then_submit(step):
        if step == 2:
            seen["before"], seen["after"] = restart(run.actors.rollouts[0])
        return submit(step)

    run.dispatcher.submit = kill_then_submit
    summary = run.run()
    assert (seen["before"]["version"], seen["after"]["version"]) == (2, 0)  # synced, then restarted
    _, *lines = [json.loads(x) for x in (tmp_path / "t" / "metrics.jsonl").read_text().splitlines()]  # step 0
    assert [x["staleness_max"] for x in lines] == [0, 0, 0]  # no sample of older weights trained
    assert lines[2]["num_samples"] == 4 * 2 and lines[2]["prompts"] == sorted(run.dispatcher.prompts_for(2))
    # one chunk refused (nothing generated: its 2 prompts x 2 samples dropped), then re-issued after the re-sync
    assert (summary["stale_chunks"], summary["dropped_samples"], summary["version"]) == (1, 4, 3)
    assert [x["stale_chunks"] for x in lines] == [0, 0, 1]


def test_samples_older_than_the_bound_are_dropped_and_their_prompts_reissued(ray_cluster, checkpoint):
    """A chunk result carrying samples of version 1 where step 3 (sync mode) needs version 3: collect drops
    the chunk (its 2 prompts x G = 2 samples), re-syncs actor 0 to version 3 and issues the prompts again."""
    cfg = tiny_config(checkpoint, "unused", steps=4)
    actors = ActorGroup(cfg, rl_tasks(cfg))
    actors.start()
    try:
        sync = WeightSync(actors, "object_store", log=print)
        dispatcher = RolloutDispatcher(cfg, actors, sync, len(rl_tasks(cfg)["train"]), log=print)
        dispatcher.version = 3
        sync.publish(3)
        old = [{"version": 1, "prompt_index": i, "sample_index": 0} for i in (7, 9)]
        stale = {"samples": old, "seconds": 0.0, "completion_tokens": 0, "worker": 0, "version": 1}
        chunk = {
            "worker": 0,
            "indices": [7, 9],
            "seed": 11,
            "min_version": 3,
            "ref": ray.put(stale),
            "split": "train",
        }
        (result,) = dispatcher.collect([chunk])
    finally:
        actors.stop()
    assert (dispatcher.stale_chunks, dispatcher.dropped_samples) == (1, 4)  # 2 prompts x G = 2, made again
    assert result["version"] == 3 and [(s["prompt_index"], s["version"]) for s in result["samples"]] == [
        (7, 3), (7, 3), (9, 3), (9, 3)
    ]  # fmt: skip


def test_collective_broadcast_path_with_gloo(ray_cluster, checkpoint):
    """The broadcast sync (the NCCL path on GPUs) run with the gloo backend on CPU: same hash everywhere."""
    cfg = rl_config(init_from=checkpoint, task_examples=8, eval_examples=2, max_operand=9)
    learner = LearnerActor.options(num_cpus=0.5).remote(checkpoint, cfg)
    rollouts = [RolloutActor.options(num_cpus=0.5).remote(checkpoint, rl_tasks(cfg), i) for i in range(2)]
    batch = [{"tokens": [1, 5, 9, 20], "mask": [0, 0, 1, 1], "advantage": 1.0}]
    ray.get(learner.step.remote(batch))
    expected = ray.get(learner.weights_hash.remote())
    create_collective_group(learner, rollouts, "gloo", "test-bcast")
    sent = learner.broadcast.remote("test-bcast")
    acks = ray.get([w.receive_broadcast.remote("test-bcast", 1) for w in rollouts])
    assert ray.get(sent)["hash"] == expected
    assert [(a["version"], a["hash"]) for a in acks] == [(1, expected), (1, expected)]
    with pytest.raises(ValueError, match="backend"):
        create_collective_group(learner, rollouts, "mpi", "x")
    for a in [learner, *rollouts]:
        ray.kill(a)


def test_async_mode_records_staleness_within_k(ray_cluster, checkpoint, tmp_path, monkeypatch):
    monkeypatch.setattr(rl_dispatcher, "EVAL_QUIET_S", 0.0)  # every evaluation long enough for progress lines
    cfg = tiny_config(
        checkpoint, str(tmp_path), steps=3, mode="async", max_staleness=1, checkpoint_every=100, eval_every=0,
        max_slots=2,
    )  # fmt: skip
    logged = []
    summary = RLRun(cfg, log=logged.append).run()
    assert [e["step"] for e in summary["evals"]] == [0, 3]  # --eval-every 0: only at step 0 and the end
    # each evaluation's 4 problems x 2 samples in 4 chunks of one --max-slots 2 batch (2 a rollout actor, queued
    # behind the async rollouts): a progress line as each comes back but the last
    progress = [re.sub(r"in \S+, eta \S+$", "", m) for m in logged if re.match(r"eval step \d+: ", m)]
    assert progress == [
        f"eval step {s}: {n}/4 held-out problems ({25 * n}%) " for s in (0, 3) for n in (1, 2, 3)
    ], logged
    _, *lines = [json.loads(x) for x in (tmp_path / "t" / "metrics.jsonl").read_text().splitlines()]  # step 0
    # step 1 trains on version-0 samples at learner version 0; later steps on samples one version old
    assert [x["staleness_max"] for x in lines] == [0, 1, 1] and summary["version"] == 3
    assert all(x["mode"] == "async" and x["normalization"] == "token" for x in lines)
    # each step's spread: lengths in order, advantages spread exactly when some prompt's samples differ, the
    # policy's entropy a positive number of nats (of the tiny model, near the uniform ln(vocab) at its start)
    assert all(x["response_len_min"] <= x["response_len_mean"] <= x["response_len_max"] for x in lines), lines
    assert all((x["advantage_std"] == 0) == (x["zero_advantage_frac"] == 1) for x in lines), lines
    assert all(0 < x["entropy"] < 20 and x["reward_std"] >= 0 for x in lines), lines
    # the share of prompts without a learning signal, each step; one warning when all 3 steps had none
    assert all(4 * x["zero_advantage_frac"] in (0, 1, 2, 3, 4) for x in lines), lines  # of 4 prompts a step
    warned = [m for m in logged if m.startswith("warning: no learning signal in the first 3 steps")]
    assert len(warned) == all(x["zero_advantage_frac"] == 1.0 for x in lines), logged


def test_a_local_rl_run_starts_ray_with_the_dashboards_metrics_files(checkpoint, tmp_path):
    """`raychat rl` started its local cluster without the dashboard, so Ray wrote neither its Prometheus service
    discovery file nor session_latest/metrics (docs/deployment.md section 5 found nothing for a local RL run),
    unlike pretrain and sft. It starts one as they do (its own cluster, in a child process: the feature is how
    a local run starts Ray), and prints what --init-from resolved to."""
    ray_tmp = str(short_temp_dir("rl-"))
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "RAYCHAT_THREADS")}
    env.update(RAY_TMPDIR=ray_tmp, RAY_AUTH_MODE="disabled")
    cmd = [sys.executable, "-m", "raychat.cli", "rl", "--preset", "tiny", "--init-from", checkpoint,
           "--storage-path", str(tmp_path), "--run-name", "local", "--max-operand", "9"]  # fmt: skip
    try:
        done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
        temp = os.path.join(ray_tmp, "ray")  # Ray's temp dir under $RAY_TMPDIR
        assert os.path.isfile(os.path.join(temp, "prom_metrics_service_discovery.json"))
        assert os.path.isdir(os.path.join(temp, "session_latest", "metrics", "prometheus"))
        assert done.stdout.startswith(f"init from: {checkpoint} (test checkpoint, step 0)\n")
    finally:
        shutil.rmtree(ray_tmp, ignore_errors=True)
