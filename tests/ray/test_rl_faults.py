"""RL survives its actors, on a local Ray cluster: a rollout actor lost during an evaluation (the evaluation is
re-run with the same result), a learner lost mid-run (the run resumes from its last committed checkpoint
within --max-failures, and fails naming the option past it), a learner hung in its restore (named within the
restore's deadline, the run restarted), a rollout actor hung mid-run (named within its chunk's deadline, the run
restarted), a learner hung in its step (named within the step's deadline x --deadline-factor, the run restarted), lost learners pinged at once and every one named, a weight sync's hung acks named together at their own
deadline, and an actor group start that fails (no placement group is left behind)."""

import json
import re
import shutil
import time
from pathlib import Path

import pytest
import ray
from ray.exceptions import ActorUnavailableError, GetTimeoutError, RayActorError
from ray.util import placement_group_table
from support import rl_fixtures
from support.rl_fixtures import BadTask, FullDisk, tiny_checkpoint, tiny_config

from raychat.capacity import read_capacity
from raychat.log import RunGaveUp
from raychat.rl import actors as rl_actors
from raychat.rl.actors import ActorGroup, ActorTimeout, get_within, lost_line
from raychat.rl.dispatcher import RolloutDispatcher
from raychat.rl.loop import RLRun, rl_tasks
from raychat.rl.sync import WeightSync
from raychat.speedrun import speedrun_flags
from raychat.storage import open_storage
from raychat.train.step import NonFiniteError

pytestmark = pytest.mark.ray
ray.cloudpickle.register_pickle_by_value(rl_fixtures)  # BadTask, FullDisk: the actors cannot import tests/

# evaluations long enough that a kill lands while they run: 8 prompts x 16 samples x up to 24 tokens, 1,536
# tokens for each of the 2 actors (with 4 samples, under `make test`'s 2 workers, actor 1 once finished its part
# before the kill reached it); an evaluation after each step (steps 0, 1 and 2): one run kills an actor in two
EVAL = dict(steps=2, max_tokens=24, eval_examples=8, eval_samples=16, checkpoint_every=100, eval_every=1)
SLOW = "on slow hardware, raise --deadline-factor (now 1), which multiplies every deadline"


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory, small_tokenizer):
    return tiny_checkpoint(tmp_path_factory.mktemp("rl") / "ck", small_tokenizer, seed=1)


def kill_and_wait(actor, timeout_s: float = 60) -> None:
    """ray.kill(actor) (a kill -9), returning once the actor is dead: ray.kill only asks the actor's raylet,
    so a call made right after could still run (under CI's load a learner killed as step 2's rollouts were
    submitted still took step 2). Calls are made until one fails."""
    ray.kill(actor)
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            ray.get(actor.pid.remote(), timeout=timeout_s)
        except RayActorError:
            return
        assert time.monotonic() < deadline, "the killed actor still answers"
        time.sleep(0.05)


def kill_and_wait_rollout(actor, no_restart: bool, timeout_s: float = 120) -> None:
    """ray.kill(actor, no_restart=no_restart), returning once the kill has landed: the actor's calls fail
    (no_restart) or Ray has restarted it (a new pid), so no call made after it runs in the old process."""
    pid = ray.get(actor.info.remote(), timeout=timeout_s)["pid"]
    ray.kill(actor, no_restart=no_restart)
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            if ray.get(actor.info.remote(), timeout=10)["pid"] != pid:
                return
        except (ActorUnavailableError, GetTimeoutError):  # restarting (a RayActorError too): ask again
            pass
        except RayActorError:  # the call meets the killed process: the actor is dead, or restarts
            if no_restart:
                return
        assert time.monotonic() < deadline, f"rollout actor not {'dead' if no_restart else 'restarted'}"
        time.sleep(0.05)


def live_placement_groups() -> set[str]:
    return {pg_id for pg_id, pg in placement_group_table().items() if pg["state"] != "REMOVED"}


def metric_lines(run_dir) -> list[dict]:
    """The lines of the run's steps (the first line, step 0, holds only the baseline evaluation)."""
    baseline, *lines = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert list(baseline) == ["step", "eval"] and baseline["step"] == 0
    return lines


@pytest.fixture(scope="module")
def undisturbed(ray_cluster, checkpoint, tmp_path_factory):
    """The summary of a run of EVAL with no fault (evaluations at steps 0, 1 and 2)."""
    return RLRun(
        tiny_config(checkpoint, str(tmp_path_factory.mktemp("undisturbed")), **EVAL), log=print
    ).run()


def test_a_rollout_actor_lost_during_evaluation_is_replaced_and_the_evaluation_rerun(
    ray_cluster, checkpoint, tmp_path, undisturbed
):
    """Rollout actor 1 is killed (ray.kill) right before an evaluation's chunks are issued, and they are issued
    once the kill has landed (ray.kill only asks: under load its part once ran before the kill); the two kills
    share one run. At step 1's evaluation Ray restarts it: its part meets the dead actor (RayActorError) or the
    checkpoint's weights (version 0 < 1): either way it is re-synced to version 1 and run again. At step 2's
    (the final) evaluation it is gone for good: its part meets the dead actor and runs on actor 0. Every
    evaluation covers every held-out prompt with the same seeds and weights: the same pass@k as the undisturbed
    run."""
    calls, logs, marks = [], [], []

    def kill_during_evals(dispatcher, chunks):
        calls.append([c["indices"] for c in chunks])
        marks.append(len(logs))  # the log lines of evaluation i start at marks[i]
        if len(calls) > 1:  # step 1's: restarted; step 2's: gone
            kill_and_wait_rollout(dispatcher.actors.rollouts[1], no_restart=len(calls) == 3)

    cfg = tiny_config(checkpoint, str(tmp_path), **EVAL)
    before = live_placement_groups()
    summary = RLRun(cfg, log=logs.append, on_evaluating=kill_during_evals).run()
    print("\n".join(logs))
    assert calls == [[[0, 1, 2, 3], [4, 5, 6, 7]]] * 3  # every evaluation, every held-out prompt
    restarted, gone = logs[marks[1] : marks[2]], logs[marks[2] :]
    recovered = [
        m for m in restarted
        if ("rollout actor 1 died" in m and "re-issuing its evaluation prompts" in m)
        or ("rollout actor 1 held version 0 < 1" in m and "re-issuing its prompts" in m)
    ]  # fmt: skip
    assert recovered, restarted
    assert any("rollout actor 1 died" in m and "re-issuing its evaluation prompts" in m for m in gone), gone
    # at least one recovery each: the restarted actor's (a dead actor met or a stale chunk), the gone one's
    assert summary["restarts"] >= 1 and summary["restarts"] + summary["stale_chunks"] >= 2
    assert summary["failures"] == 0 and summary["version"] == 2
    assert [e["step"] for e in summary["evals"]] == [0, 1, 2]
    assert summary["evals"] == undisturbed["evals"]
    for evaluation in summary["evals"]:
        assert set(evaluation) == {"step", *(f"pass@{k}" for k in range(1, 17))}
    assert live_placement_groups() == before


@pytest.mark.parametrize("learners", [1, 2])
def test_a_lost_learner_resumes_from_the_last_committed_checkpoint(
    ray_cluster, checkpoint, tmp_path, learners
):
    """4 steps, checkpoints at 2 and 4, one rollout actor (the learners are what is lost); the last learner is
    killed when step 4's rollouts are submitted (step 3 done, not checkpointed); with 2 learners the surviving
    rank may raise its own error (its DDP peer is gone). The run stops every actor, starts them again, resumes
    from checkpoint_000002 and redoes steps 3 and 4: the redone step 3 has the same rewards and loss as the
    first (same state, prompts and seeds), one failure is counted and the run completes at version 4. The
    summary covers the whole invocation (its start_step, wall_s and learner_wait_frac were the restarted
    attempt's alone: start_step 2)."""
    logs, killed = [], []

    def kill_learner_at_step_4(dispatcher, step, chunks):
        if step == 3 and not killed:
            killed.append(time.perf_counter())
            kill_and_wait(dispatcher.actors.learners[-1])

    cfg = tiny_config(
        checkpoint, str(tmp_path), steps=4, checkpoint_every=2, max_failures=1, learner_workers=learners,
        rollout_workers=1,
    )  # fmt: skip
    before = live_placement_groups()
    began = time.perf_counter()
    summary = RLRun(cfg, on_submitted=kill_learner_at_step_4, log=logs.append).run()
    ended = time.perf_counter()
    print("\n".join(logs))
    assert len(killed) == 1
    # the summary covers the invocation: it started at step 0 (the restart resumed at 2), its wall time began
    # before the kill (it was the restarted loop's alone, after it), and the learner's wait is over every
    # learner step of both attempts: the 5 step lines (1-3, then 3 and 4 redone), busy = wait / frac - wait
    assert (summary["failures"], summary["start_step"], summary["version"]) == (1, 0, 4)
    assert ended - killed[0] < summary["wall_s"] <= ended - began
    steps = [dict(re.findall(r"(\w+)=(\S+)", m)) for m in logs if m.startswith("step=")]
    assert [s["step"] for s in steps] == ["1/4", "2/4", "3/4", "3/4", "4/4"]
    waited = sum(float(s["learner_wait_s"]) for s in steps)
    spent = sum(float(s["learner_wait_s"]) / float(s["learner_wait_frac"]) for s in steps)
    assert summary["learner_wait_frac"] == pytest.approx(waited / spent, rel=2e-3)
    restart = next(i for i, m in enumerate(logs) if "restart 1 of --max-failures 1" in m)
    # 2 learners: whichever error reaches the driver first, the dead rank's or its DDP peer's own
    assert "ActorDiedError" in logs[restart] or (learners == 2 and "RayTaskError" in logs[restart])
    resumed = [m for m in logs[restart:] if m.startswith("resumed from ")]
    assert resumed == [
        f"resumed from {summary['run_dir']}/checkpoint_000002 (step 2, version 2): goes on at step 3"
    ]

    step_3 = [dict(re.findall(r"(\w+)=(\S+)", m)) for m in logs if m.startswith("step=3/4 ")]
    assert len(step_3) == 2  # done, then redone after the restart
    assert step_3[0]["reward_mean"] == step_3[1]["reward_mean"]
    assert float(step_3[1]["loss"]) == pytest.approx(float(step_3[0]["loss"]), rel=1e-5, abs=1e-7)
    # the step line shows a fault counter only once it is nonzero (metrics.jsonl has it on every line)
    assert (step_3[0].get("failures"), step_3[1]["failures"]) == (None, "1")
    # the tiny model solves nothing: the run's 4 steps (1-3, then 3 and 4 redone) had no signal, warned once over
    # them (the restarted loop warned over its own 2 steps, as if they were the run's first)
    warned = [m for m in logs if m.startswith("warning: no learning signal")]
    assert [m.split(": all ")[0] for m in warned] == ["warning: no learning signal in the first 4 steps"]

    lines = metric_lines(tmp_path / "t")
    assert [(x["step"], x["failures"], x["version"]) for x in lines] == [
        (1, 0, 1),
        (2, 0, 2),
        (3, 1, 3),
        (4, 1, 4),
    ]
    assert {p.name for p in (tmp_path / "t").glob("checkpoint_*")} == {
        "checkpoint_000002",
        "checkpoint_000004",
    }
    assert live_placement_groups() == before


def test_past_max_failures_the_run_gives_up_in_one_line_and_releases_its_placement_group(
    ray_cluster, checkpoint, tmp_path
):
    """The learner is killed (ray.kill, as a kill -9) as step 2's rollouts are submitted, with --max-failures 0.
    `raychat rl` ended in ~50 lines of two chained tracebacks; now RunGaveUp is one line (`raychat` prints it
    last: tests/unit/test_cli.py) naming the actor, the error, the failure count and budget and the checkpoint a
    new start resumes from, the error logged once in full above it. One rollout actor: the learner is what is
    lost."""

    def kill_learner_at_step_2(dispatcher, step, chunks):
        if step == 1:
            kill_and_wait(dispatcher.actors.learners[0])

    cfg = tiny_config(checkpoint, str(tmp_path), steps=2, max_failures=0, rollout_workers=1)
    before = live_placement_groups()
    logs = []
    run = RLRun(cfg, on_submitted=kill_learner_at_step_2, log=logs.append)
    with pytest.raises(RunGaveUp) as e:
        run.run()
    print("\n".join(logs))
    assert str(e.value) == (
        "rl run 't' gave up: learner 0 was lost at step 2 (ActorDiedError: The actor died unexpectedly before "
        "finishing this task.), failure 1 where --max-failures 0 allows 0 failures; started again (a higher --max-failures "
        f"survives more), it resumes from its newest committed checkpoint {tmp_path}/t/checkpoint_000001"
    )
    full = [
        m for m in logs if m.startswith("rl run 't': the failure that ended it, in full:\nActorDiedError: ")
    ]
    assert len(full) == 1 and "class_name: Learner\n" in full[0], logs
    assert run.failures == 0 and run.actors.pg is None and run.actors.learners == []
    assert live_placement_groups() == before
    assert [x["step"] for x in metric_lines(tmp_path / "t")] == [1]  # step 1 done and checkpointed


def test_a_failed_topology_start_leaves_no_placement_group(ray_cluster, checkpoint, tmp_path, monkeypatch):
    """An actor constructor that raises (a checkpoint directory that does not exist), a placement group no
    node can hold (a GPU on a CPU-only cluster) and actors not started by their deadline: start() raises, and
    the group is removed every way (the constructors that raise: one learner, one rollout actor)."""
    before = live_placement_groups()
    cfg = tiny_config(str(tmp_path / "missing"), str(tmp_path), rollout_workers=1)
    actors = ActorGroup(cfg, rl_tasks(cfg))
    with pytest.raises(RayActorError, match="missing"):
        actors.start()
    assert actors.pg is None and (actors.learners, actors.rollouts) == ([], [])
    assert live_placement_groups() == before

    cfg = tiny_config(checkpoint, str(tmp_path), use_gpu=True)
    actors = ActorGroup(cfg, rl_tasks(cfg))
    with pytest.raises(
        ValueError,
        match=r"^--learner-workers 1 x --cpus-per-learner 0.5 --use-gpu: the RL placement group .* was not "
        r"placed within --schedule-timeout-s 2; missing: GPU \(need 1, the most a node has is 0\)$",
    ):
        actors.start(ready_timeout_s=2)
    assert actors.pg is None and live_placement_groups() == before

    # actors that do not start within START_S + READ_BASE_S + --init-from's bytes at READ_BYTES_PER_S (here
    # 0.1 + 0.2 + 0.2 s: a process and torch take longer) are named, not waited for for ever
    nbytes = sum(
        f["size"] for f in json.loads((Path(checkpoint) / "commit.json").read_text())["files"].values()
    )
    for name, value in (("START_S", 0.1), ("READ_BASE_S", 0.2), ("READ_BYTES_PER_S", nbytes / 0.2)):
        monkeypatch.setattr(rl_actors, name, value)
    cfg = tiny_config(checkpoint, str(tmp_path))
    actors = ActorGroup(cfg, rl_tasks(cfg))
    with pytest.raises(ActorTimeout) as e:
        actors.start()
    mb, who = f"{nbytes / 1e6:.3g}", e.value.who
    assert who and set(who) <= {"rollout actor 0", "rollout actor 1", "learner 0"}
    late, each = {
        1: (f"{who[0]} did not return", ""),
        2: (f"neither {who[0]} nor {who[1]} returned", "for each: "),
        3: (f"none of {who[0]}, {who[1]} and {who[2]} returned", "for each: "),
    }[len(who)]
    assert str(e.value) == (
        f"{late} its start within 0.5 s (0.1 s to start + 0.2 s + {mb} MB at {nbytes / 0.2 / 1e6:.3g} MB/s of "
        f"--init-from); if it recurs, {each}check that its node starts Ray workers (its raylet's log) and reads "
        f"{checkpoint} (a hung mount); {SLOW}"
    )
    assert actors.pg is None and live_placement_groups() == before


def test_a_placement_timeout_names_the_part_that_found_no_room(ray_cluster, checkpoint, tmp_path):
    """The timeout named all five layout flags whatever waited; with 1.5 of the 2 CPUs held by another
    placement group, the learner (0.5) has room and the 2 rollout actors (1 CPU) do not: they are named."""
    other = ray.util.placement_group([{"CPU": 1.5}])
    ray.get(other.ready(), timeout=30)
    try:
        cfg = tiny_config(checkpoint, str(tmp_path))
        actors = ActorGroup(cfg, rl_tasks(cfg))
        with pytest.raises(ValueError) as e:
            actors.start(ready_timeout_s=2)
    finally:
        ray.util.remove_placement_group(other)
    node = ray.get_runtime_context().get_node_id()[:8]
    assert str(e.value) == (
        "--rollout-workers 2 x --cpus-per-rollout 0.5: the RL placement group [{'CPU': 0.5}, {'CPU': 0.5}, "
        "{'CPU': 0.5}] was not placed within --schedule-timeout-s 2; missing: room for {CPU: 1} (free now: "
        f"node {node} {{CPU: 0.5}} x 1)"
    )
    assert actors.pg is None


class PoisonedRewards(RLRun):
    """A run whose step 2 (0-based 1) rewards are NaN: so are its advantages, its loss and its gradient norm."""

    def learner_step(self, results, step):
        if step == 1:
            for r in results:
                for sample in r["samples"]:
                    sample["reward"] = float("nan")
        return super().learner_step(results, step)


def test_a_non_finite_learner_step_ends_the_run_in_one_line(ray_cluster, checkpoint, tmp_path):
    """The learner's NonFiniteError (a NaN gradient norm at step 2) came out of `raychat rl` as a RayTaskError
    traceback. Now the run ends at once in RunGaveUp's one line (not retried, though --max-failures allows one:
    the same samples would fail again), naming the step, what was not finite, the learning rates to lower and the
    checkpoint a new start resumes from (step 1's); its placement group is released. One rollout actor: the
    learner's step is what fails."""
    before = live_placement_groups()
    run = PoisonedRewards(
        tiny_config(checkpoint, str(tmp_path), max_failures=1, rollout_workers=1), log=print
    )
    with pytest.raises(RunGaveUp) as e:
        run.run()
    assert str(e.value) == (
        "rl run 't' stopped at step 2: its grad norm was nan, so that update was skipped and the run not retried "
        "(the same step would fail again); lower the learning rates (now --matrix-lr 0.0002, --embedding-lr "
        "0.001, --unembedding-lr 0.001, --scalar-lr 0.001) and start it again: it resumes from its newest "
        f"committed checkpoint {tmp_path}/t/checkpoint_000001"
    )
    assert isinstance(e.value.__cause__.cause, NonFiniteError)
    assert run.failures == 0 and run.actors.pg is None and live_placement_groups() == before
    assert [x["step"] for x in metric_lines(tmp_path / "t")] == [1]


def test_the_speedrun_names_its_rl_layout_by_its_preset_keys(ray_cluster, checkpoint, tmp_path):
    """The speedrun's RL stage refused a layout naming `raychat rl`'s flags (--rollout-workers ...), which the
    speedrun does not have, as pretraining and SFT no longer do: the run's refusals (the check before any actor
    starts, the placement timeout) name the keys of its preset (speedrun_flags: rl.rollout_workers)."""
    flags = speedrun_flags("tiny", "rl")
    run = RLRun(tiny_config(checkpoint, str(tmp_path), cpus_per_rollout=5), flags=flags)
    with pytest.raises(ValueError) as e:
        run.run()
    assert str(e.value) == (
        "rl.rollout_workers 2 x rl.cpus_per_rollout 5: one of them needs {CPU: 5}; no node type has room: CPU (need "
        f"5, the most a node has is 2); largest node type: {read_capacity().largest().describe()}"
    )
    cfg = tiny_config(checkpoint, str(tmp_path), use_gpu=True)
    actors = ActorGroup(cfg, rl_tasks(cfg), flags.option)
    with pytest.raises(ValueError) as e:
        actors.start(ready_timeout_s=2)
    assert re.fullmatch(
        r"rl\.learner_workers 1 x rl\.cpus_per_learner 0\.5 rl\.use_gpu: the RL placement group .* was not "
        r"placed within rl\.schedule_timeout_s 2; missing: GPU \(need 1, the most a node has is 0\)",
        str(e.value),
    ), str(e.value)


def test_a_reward_raising_on_some_samples_scores_them_0_and_on_every_sample_stops_the_run(
    ray_cluster, checkpoint, tmp_path
):
    """A reward function that raised on one sample ended `raychat rl` in a RayTaskError traceback. Now a sample
    whose reward raises scores 0 and is counted: step 1's first prompt (2 samples of 8) is, in one line and in
    reward_errors; a reward that raises on every sample of a step (step 2's prompts) is broken, not a sample's
    fault, and ends the run in one line, not retried, the traceback logged in full above it. Two rollout actors:
    the step's samples and reward errors are counted over both actors' chunks."""
    before = live_placement_groups()
    logs = []
    run = RLRun(tiny_config(checkpoint, str(tmp_path), max_failures=1), log=logs.append)
    step_1, step_2 = run.dispatcher.prompts_for(0), run.dispatcher.prompts_for(1)
    train = run.tasks["train"]
    run.tasks["train"] = BadTask(train, bad_reward=[step_1[0], *step_2])  # the dict the actors are given
    with pytest.raises(RunGaveUp) as e:
        run.run()
    print("\n".join(logs))
    first = train[step_1[0]]["id"]
    assert [m for m in logs if "task's reward raised" in m] == [
        "the calculator task's reward raised on 2 of 8 samples of the step's rollouts, scored 0 (2 in all so far; "
        f"first: ValueError: no reward for {first}, on prompt {step_1[0]})"
    ]
    assert str(e.value) == (
        "rl run 't' stopped at step 2: the calculator task's reward raised on all 8 samples of the step's rollouts "
        f"(ValueError: no reward for {train[step_2[0]]['id']}), not retried (no sample could be scored: the "
        "function is broken, not a sample); fix the calculator task's reward and start it again: it resumes from "
        f"its newest committed checkpoint {tmp_path}/t/checkpoint_000001"
    )
    full = [m for m in logs if m.startswith("rl run 't': the failure that ended it, in full:\nTraceback")]
    assert len(full) == 1 and "ValueError: no reward for" in full[0], logs
    [line] = metric_lines(tmp_path / "t")
    assert (line["step"], line["reward_errors"], line["failures"]) == (1, 2, 0)
    assert run.failures == 0 and live_placement_groups() == before


def test_a_rollout_actor_that_raises_stops_the_run_in_one_line(ray_cluster, checkpoint, tmp_path):
    """A prompt that raises inside a rollout actor (here: its conversation does not parse) came out of
    `raychat rl` as a RayTaskError traceback. Now one line names the step, the actor and its prompts, the error,
    that it was not retried (the same prompts and seeds would raise again) and the checkpoint a new start
    resumes from; the Ray error, with the actor's traceback, is logged in full above it."""
    before = live_placement_groups()
    logs = []
    run = RLRun(tiny_config(checkpoint, str(tmp_path), max_failures=1), log=logs.append)
    step_2 = run.dispatcher.prompts_for(1)
    run.tasks["train"] = BadTask(run.tasks["train"], unreadable=[step_2[3]])  # actor 1's part: prompts 3, 4
    with pytest.raises(RunGaveUp) as e:
        run.run()
    print("\n".join(logs))
    assert str(e.value) == (
        f"rl run 't' stopped at step 2: rollout actor 1 raised in its rollout of prompts {step_2[2:]} (ValueError: "
        f"conversation {step_2[3]} does not parse), not retried (the same prompts and seeds would raise again); fix "
        "what raised (its traceback is logged above) and start it again: it resumes from its newest committed "
        f"checkpoint {tmp_path}/t/checkpoint_000001"
    )
    full = [m for m in logs if m.startswith("rl run 't': the failure that ended it, in full:\nRayTaskError")]
    assert len(full) == 1 and "RolloutWorker.rollout" in full[0] and "does not parse" in full[0], logs
    assert run.failures == 0 and run.actors.pg is None and live_placement_groups() == before


def test_a_checkpoint_the_storage_refuses_stops_the_run_in_one_line(ray_cluster, checkpoint, tmp_path):
    """Checkpoint 2's files cannot be written (ENOSPC, as on a full disk: FullDisk). The learner's upload error
    came out as a RayTaskError traceback; now one line names the step, the learner, the checkpoint, the error,
    that it was not retried (the storage would refuse it again), the storage root to make room on and the
    checkpoint a new start resumes from (step 1's, still the newest committed one). One rollout actor: the
    learner's upload is what fails."""
    before = live_placement_groups()
    logs = []
    cfg = tiny_config(checkpoint, str(tmp_path), max_failures=1, rollout_workers=1)
    run = RLRun(cfg, log=logs.append)
    run.checkpoints = FullDisk(open_storage(str(tmp_path)), "t", cfg.checkpoint.keep_checkpoints, full_step=2)
    with pytest.raises(RunGaveUp) as e:
        run.run()
    print("\n".join(logs))
    assert str(e.value) == (
        f"rl run 't' stopped at step 2: learner 0 could not upload its part of checkpoint {tmp_path}/t/"
        "checkpoint_000002 (OSError: [Errno 28] No space left on device), not retried (the storage would refuse the "
        f"same checkpoint again); make room on --storage-path {tmp_path} (or let this run write there) and start "
        f"it again: it resumes from its newest committed checkpoint {tmp_path}/t/checkpoint_000001"
    )
    assert run.failures == 0 and live_placement_groups() == before
    assert [x["step"] for x in metric_lines(tmp_path / "t")] == [1, 2]


def test_a_failed_weight_sync_restarts_the_actor_group(ray_cluster, checkpoint, tmp_path):
    """Rollout actor 1 breaks (its engine gone: its next set_weights raises AttributeError) after its step 2
    rollout. The weight sync's RayTaskError ended the run in a traceback; now it counts as a failure, like a lost
    actor: one line names the sync, the actor, the step and the error, every actor is started again (new
    processes) and the run resumes from checkpoint 1 and completes."""
    logs, broken = [], []

    def break_actor_1(dispatcher, step, chunks):
        if step == 1 and not broken:  # queued after its rollout: it raises in the sync that follows
            broken.append(
                dispatcher.actors.rollouts[1].__ray_call__.remote(lambda w: setattr(w, "engine", None))
            )

    run = RLRun(
        tiny_config(checkpoint, str(tmp_path), max_failures=1), on_submitted=break_actor_1, log=logs.append
    )
    summary = run.run()
    print("\n".join(logs))
    assert [m for m in logs if "restart 1 of" in m] == [
        "the weight sync to version 2 failed in rollout actor 1 at step 2 (AttributeError: 'NoneType' object has "
        "no attribute 'refresh_weights'); restart 1 of --max-failures 1: starting every actor again and resuming "
        "from the newest committed checkpoint"
    ]
    assert (summary["failures"], summary["version"], summary["reward_errors"]) == (1, 2, 0)
    assert [(x["step"], x["failures"]) for x in metric_lines(tmp_path / "t")] == [(1, 0), (2, 1)]


def test_a_learner_that_raises_ends_a_ddp_run_at_once_in_one_line(
    ray_cluster, checkpoint, tmp_path, monkeypatch
):
    """2 learners (DDP over gloo); learner 1 breaks after step 1 (its loss gone: its step 2 raises AttributeError
    before the step's first all-reduce), learner 0 waits in that all-reduce for it (until gloo's timeout, 30
    minutes). The driver took learner 0, which did not answer its 30 s ping, for lost: it restarted the actor
    group and redid the step (a fault that repeats: the run gave up naming the wrong learner, minutes later).
    Now it waits for the other learners PEER_GRACE_S only (10 s; a lost learner's call fails within them; 1 s
    here: none is lost, so learner 0 never answers and the grace is waited out in full) and the run ends in
    stopped_on_error's one line naming learner 1, not retried (--max-failures 1 allows one: the same
    samples would raise again), well within a minute of the break; learner 0 is killed with the actor group."""
    monkeypatch.setattr(rl_actors, "PEER_GRACE_S", 1.0)
    logs, broken = [], []

    def break_learner_1(dispatcher, step, chunks):
        if step == 1 and not broken:  # queued before its step 2 update
            broken.append(time.perf_counter())
            dispatcher.actors.learners[1].__ray_call__.remote(lambda learner: setattr(learner, "loss", None))

    cfg = tiny_config(checkpoint, str(tmp_path), learner_workers=2, rollout_workers=1, max_failures=1)
    before = live_placement_groups()
    run = RLRun(cfg, on_submitted=break_learner_1, log=lambda m: logs.append(m) or print(m))
    with pytest.raises(RunGaveUp) as e:
        run.run()
    ended = time.perf_counter()
    print(f"the run ended {ended - broken[0]:.1f} s after learner 1 broke")
    assert ended - broken[0] < 60, f"the run ended {ended - broken[0]:.0f} s after learner 1 broke"
    assert str(e.value) == (
        "rl run 't' stopped at step 2: learner 1 raised in its update (AttributeError: 'NoneType' object has no "
        "attribute 'counts'), not retried (the same samples would raise again); fix what raised (its traceback is "
        f"logged above) and start it again: it resumes from its newest committed checkpoint {tmp_path}/t/"
        "checkpoint_000001"
    )
    full = [m for m in logs if m.startswith("rl run 't': the failure that ended it, in full:\nRayTaskError")]
    assert len(full) == 1 and "Learner.step" in full[0], logs
    assert run.failures == 0 and run.actors.pg is None and live_placement_groups() == before
    assert [x["step"] for x in metric_lines(tmp_path / "t")] == [1]


def hang(actor, seconds: float = 60):
    """Keep `actor` busy for `seconds` (asleep in a call of its own), so the driver's next calls wait behind it,
    as behind a hung mount; alive, it answers no ping. The actor group's stop kills it."""
    return actor.__ray_call__.remote(lambda _: time.sleep(seconds))


class HungRestore(RLRun):
    """A run whose learner 0 hangs (hang) as its first attempt restores the newest checkpoint."""

    def resume(self):
        if not getattr(self, "hung", None) and self.checkpoints.newest() is not None:
            self.hung = (time.perf_counter(), hang(self.actors.learners[0]))
        return super().resume()


def test_a_learner_hung_in_restore_is_named_within_its_deadline_and_the_run_restarts(
    ray_cluster, checkpoint, tmp_path, undisturbed, monkeypatch
):
    """Learner.restore was a plain ray.get: a learner hung while resuming hung the run for ever. Now it has a
    deadline sized from the checkpoint (READ_BASE_S + its committed bytes at READ_BYTES_PER_S; here 2 s + its
    bytes at that many bytes a second = 3 s): the undisturbed run, resumed for a third step, has learner 0 hang
    as it restores checkpoint 2; 3 s later one line names it, the call, the checkpoint, the 3 s and how they were
    sized, and what to check, and the run starts every actor again (the hung one killed), resumes and completes."""
    shutil.copytree(undisturbed["run_dir"], tmp_path / "t")
    ck = tmp_path / "t" / "checkpoint_000002"
    nbytes = sum(f["size"] for f in json.loads((ck / "commit.json").read_text())["files"].values())
    monkeypatch.setattr(rl_actors, "READ_BASE_S", 2.0)
    monkeypatch.setattr(rl_actors, "READ_BYTES_PER_S", float(nbytes))
    logs = []
    run = HungRestore(tiny_config(checkpoint, str(tmp_path), steps=3, max_failures=1),
                      log=lambda m: logs.append((time.perf_counter(), m)))  # fmt: skip
    before = live_placement_groups()
    summary = run.run()
    print("\n".join(m for _, m in logs))
    mb = f"{nbytes / 1e6:.3g}"
    [(at, line)] = [(t, m) for t, m in logs if "restart 1 of" in m]
    assert line == (
        f"learner 0 hung at step 2 (ActorTimeout: learner 0 did not return Learner.restore of {ck} within 3 s (2 s "
        f"+ {mb} MB at {mb} MB/s); if it recurs, check that its node reads --storage-path {tmp_path} (a hung mount, "
        f"an endpoint that does not answer); {SLOW}); restart 1 of --max-failures 1: starting every actor again and "
        "resuming from the newest committed checkpoint"
    )
    assert 3 <= at - run.hung[0] < 13  # the deadline, not the 60 s learner 0 slept
    assert [m for _, m in logs if m.startswith("resumed from ")] == [
        f"resumed from {ck} (step 2, version 2): goes on at step 3"
    ]
    assert (summary["failures"], summary["start_step"], summary["version"]) == (1, 2, 3)
    assert [(x["step"], x["failures"]) for x in metric_lines(tmp_path / "t")] == [(1, 0), (2, 0), (3, 1)]
    assert live_placement_groups() == before


def test_a_rollout_actor_hung_mid_run_is_named_within_its_deadline_and_the_run_restarts(
    ray_cluster, checkpoint, tmp_path, monkeypatch
):
    """Collecting rollouts was a plain ray.get: a rollout actor hung mid-run (a deadlock in its engine) hung the
    run for ever. Now a chunk has a deadline sized from the run's own chunks: ROLLOUT_FACTOR x the longest
    training chunk so far, at least ROLLOUT_MIN_S (here 20 x step 1's longest chunk, at least 1 s). The one
    rollout actor, 0, has its engine hang from step 2 on (its generate sleeps 60 s, inside
    RolloutWorker.rollout); within the deadline one line names it, its prompts, the seconds and how they were
    sized, and the run starts every actor again (the hung one killed), resumes from checkpoint 1 and completes."""
    monkeypatch.setattr(rl_actors, "ROLLOUT_MIN_S", 1.0)
    monkeypatch.setattr(rl_actors, "ROLLOUT_FACTOR", 20.0)
    seen = {}

    def hang_actor_0(dispatcher, step, chunks):
        if step == 0 and not seen:  # queued after its step 1 rollout: its step 2 rollout hangs
            seen["armed"] = dispatcher.actors.rollouts[0].__ray_call__.remote(
                lambda w: setattr(w, "_generate", lambda *a, **k: time.sleep(60))
            )
        elif step == 1 and "at" not in seen:  # step 2's chunks submitted: step 1's sized its deadline
            seen.update(
                at=time.perf_counter(), longest=dispatcher.longest["train"], prompts=chunks[0]["indices"]
            )

    logs = []
    run = RLRun(tiny_config(checkpoint, str(tmp_path), max_failures=1, rollout_workers=1), on_submitted=hang_actor_0,
                log=lambda m: logs.append((time.perf_counter(), m)))  # fmt: skip
    before = live_placement_groups()
    summary = run.run()
    print("\n".join(m for _, m in logs))
    waited = max(1.0, 20.0 * seen["longest"])
    [(at, line)] = [(t, m) for t, m in logs if "restart 1 of" in m]
    assert line == (
        f"rollout actor 0 hung at step 2 (ActorTimeout: rollout actor 0 did not return its rollout of prompts "
        f"{seen['prompts']} within {waited:.3g} s (at least 1 s, else 20 x the longest training chunk so far "
        f"({seen['longest']:.3g} s)); if it recurs, see what its process does (py-spy dump: a deadlock, a stuck "
        "device or node); a healthy chunk that needs longer: more --rollout-workers, fewer prompts each; "
        f"{SLOW}); restart 1 of --max-failures 1: starting every actor again and resuming from the newest committed "
        "checkpoint"
    )
    assert waited - 0.01 <= at - seen["at"] < waited + 10  # the deadline, not the 60 s the engine slept
    assert [m for _, m in logs if m.startswith("resumed from ")] == [
        f"resumed from {tmp_path}/t/checkpoint_000001 (step 1, version 1): goes on at step 2"
    ]
    assert (summary["failures"], summary["version"], summary["restarts"]) == (1, 2, 0)
    assert [(x["step"], x["failures"]) for x in metric_lines(tmp_path / "t")] == [(1, 0), (2, 1)]
    assert live_placement_groups() == before


def test_a_learner_hung_in_its_step_is_named_within_its_deadline_and_the_run_restarts(
    ray_cluster, checkpoint, tmp_path, monkeypatch
):
    """A learner step was a plain wait: a learner hung in it (a deadlock, a hung all-reduce) hung the run for
    ever. Now it has a deadline sized from the run's own steps, STEP_FACTOR x the longest learner step so far, at
    least STEP_MIN_S, x --deadline-factor (here 2 x max(1 s, 2 x step 1's): step 1 is cold, STEP_FIRST_S, and
    so is step 2 redone after the restart, so only the hung step has this deadline). Learner 0 hangs (hang) as
    step 2's rollouts are submitted, so its step 2 waits behind a 60 s sleep; within the deadline one line names
    it, the step, the seconds, how they were sized (the factor too) and how to raise them, and the run starts
    every actor again (the hung one killed), resumes from checkpoint 1 and completes. One rollout actor: the
    learner is what hangs."""
    monkeypatch.setattr(rl_actors, "STEP_MIN_S", 1.0)
    monkeypatch.setattr(rl_actors, "STEP_FACTOR", 2.0)
    seen = {}

    def hang_learner_0(dispatcher, step, chunks):
        if step == 1 and not seen:  # step 1's learner step, publish and save are done: learner 0 is idle
            seen.update(at=time.perf_counter(), longest=run.longest_step)
            hang(run.actors.learners[0])

    logs = []
    run = RLRun(tiny_config(checkpoint, str(tmp_path), max_failures=1, deadline_factor=2, rollout_workers=1),
                on_submitted=hang_learner_0,
                log=lambda m: logs.append((time.perf_counter(), m)))  # fmt: skip
    summary = run.run()
    print("\n".join(m for _, m in logs))
    waited = 2.0 * max(1.0, 2.0 * seen["longest"])
    [(at, line)] = [(t, m) for t, m in logs if "restart 1 of" in m]
    assert line == (
        f"learner 0 hung at step 2 (ActorTimeout: learner 0 did not return Learner.step (the update of step 2) "
        f"within {waited:.3g} s (--deadline-factor 2 x (at least 1 s, else 2 x the longest learner step so far "
        f"({seen['longest']:.3g} s))); if it recurs, see what its process does (py-spy dump: a deadlock, a hung "
        "all-reduce, a stuck device or node); on slow hardware, raise --deadline-factor (now 2), which multiplies "
        "every deadline); restart 1 of --max-failures 1: starting every actor again and resuming from the newest "
        "committed checkpoint"
    )
    assert waited - 0.01 <= at - seen["at"] < waited + 10  # the deadline, not the 60 s learner 0 slept
    assert [m for _, m in logs if m.startswith("resumed from ")] == [
        f"resumed from {tmp_path}/t/checkpoint_000001 (step 1, version 1): goes on at step 2"
    ]
    assert (summary["failures"], summary["version"]) == (1, 2)
    assert [(x["step"], x["failures"]) for x in metric_lines(tmp_path / "t")] == [(1, 0), (2, 1)]


def test_a_queued_chunk_has_the_deadlines_ahead_of_it_and_lost_learners_are_pinged_at_once(
    ray_cluster, checkpoint, tmp_path, monkeypatch
):
    """Two hung-actor checks on one actor group (3 learners, 1 rollout actor), started once.

    An evaluation issued in async mode waits on each actor behind the next steps' rollouts, so its deadline
    adds up theirs and its own: ROLLOUT_FACTOR x the longest chunk of each kind so far (here 4 x (0.25 s + 0.5 s)
    = 3 s; ROLLOUT_MIN_S 0.5 s). The one rollout actor is hung (hang), a step's training chunk then an evaluation
    are issued to it: the evaluation is named after 3 s, the line saying how they were sized.

    The check for lost learners (a learner's error may be its DDP peer's loss) pinged them one after another,
    30 s each, and named the first: N hung learners took N x 30 s. Now one ping each, all at once, waited for
    PING_S in all (here 4 s): of 3 learners, 0 killed and 1, 2 hung, all three are named within 4 s + slack
    (one after another: 8 s)."""
    monkeypatch.setattr(rl_actors, "ROLLOUT_MIN_S", 0.5)
    monkeypatch.setattr(rl_actors, "ROLLOUT_FACTOR", 4.0)
    monkeypatch.setattr(rl_actors, "PING_S", 4.0)
    cfg = tiny_config(checkpoint, str(tmp_path), learner_workers=3, rollout_workers=1)
    actors = ActorGroup(cfg, rl_tasks(cfg))
    actors.start()
    try:
        dispatcher = RolloutDispatcher(cfg, actors, WeightSync(actors, "object_store"), 64)
        dispatcher.longest = {"train": 0.25, "test": 0.5}
        hang(actors.rollouts[0], 30)
        [chunk] = dispatcher.submit(0)
        t0 = time.perf_counter()
        with pytest.raises(ActorTimeout) as e:
            dispatcher.evaluate(2)
        took = time.perf_counter() - t0

        kill_and_wait(actors.learners[0])
        for lr in actors.learners[1:]:
            hang(lr, 30)
        t0 = time.perf_counter()
        lost = actors.lost_learners()
        pinged = time.perf_counter() - t0
    finally:
        actors.stop()
    assert str(e.value) == (
        "rollout actor 0 did not return its evaluation of held-out prompts [0, 1] within 3 s (at least 0.5 s, else "
        "4 x the longest training chunk so far (0.25 s), the longest evaluation chunk so far (0.5 s): the 2 chunks "
        "on its actor, this one last); if it recurs, see what its process does (py-spy dump: a deadlock, a stuck "
        f"device or node); a healthy chunk that needs longer: more --rollout-workers, fewer prompts each; {SLOW}"
    )
    # the 3 s deadline (ray.wait returned 0.1 ms early once), not the 30 s hang; slack for a loaded machine
    assert chunk["split"] == "train" and 2.99 <= took < 15, took

    assert lost == {0: None, 1: "no answer within 4 s", 2: "no answer within 4 s"}
    assert 3.99 <= pinged < 7.5, pinged  # (ray.wait may return 0.1 ms early: above)
    assert lost_line(lost) == "learners 0, 1 (no answer within 4 s) and 2 (no answer within 4 s) were lost"
    assert lost_line({1: None}) == "learner 1 was lost"


def test_a_syncs_acks_are_waited_for_together_each_for_its_own_deadline(ray_cluster, tmp_path, monkeypatch):
    """A weight sync's acks were waited for one after another: with rollout actors 0 and 2 hung, actor 0 was named
    alone, and actor 2's deadline would have started after actor 0's ran out. Now all are waited for from one
    start, each for its own deadline (READ_BASE_S 1 s here; actor 1's ack queued behind a 2 s chunk: 3 s):
    actors 0 and 2 are named together after 1 s, and actor 1, which acks at 1.5 s, is not named."""
    monkeypatch.setattr(rl_actors, "READ_BASE_S", 1.0)

    @ray.remote(num_cpus=0)
    class Acker:
        def set_weights(self, refs, version: int, nap: float) -> dict:
            time.sleep(nap)
            return {"version": version, "hash": "h", "apply_s": 0.0}

    actors = ActorGroup(tiny_config("ck", str(tmp_path)), {})
    actors.rollouts = [Acker.remote() for _ in range(3)]
    sync = WeightSync(actors, "object_store")
    sync.ahead = lambda w: (2.0, "a 2 s chunk") if w == 1 else None
    try:
        ray.get([a.set_weights.remote(None, 0, 0) for a in actors.rollouts], timeout=60)  # started
        acks = [a.set_weights.remote(None, 1, nap) for a, nap in zip(actors.rollouts, [30, 1.5, 30])]
        t0 = time.perf_counter()
        with pytest.raises(ActorTimeout) as e:
            sync._acks(acks, sync.deadlines(), 1)
        took = time.perf_counter() - t0
    finally:
        for a in actors.rollouts:
            ray.kill(a)
    assert str(e.value) == (
        "neither rollout actor 0 nor rollout actor 2 returned RolloutActor.set_weights (the weight sync to version "
        "1) within 1 s (1 s + 0 MB at 10 MB/s of the weights); if it recurs, for each: see what its process does "
        f"(py-spy dump: a hung object store or collective, a stuck device or node); {SLOW}"
    )
    assert 0.99 <= took < 6, took  # (ray.wait may return 0.1 ms early: above)


def test_a_fixed_wait_is_not_multiplied_nor_offers_the_factor_and_a_multiplied_one_is(ray_cluster):
    """get_within without a factor (the PING_S wait for a re-synced rollout actor's info: WeightSync._acks)
    waits its timeout and its line ends at its fix: it used to say "raise --deadline-factor (now 1)" whatever
    the run's factor, which did not lengthen that wait. With a factor (ActorGroup.wait_for: --deadline-factor 2)
    it waits twice as long and the line says so. Each call waits behind a 30 s sleep on an actor of its own."""

    @ray.remote(num_cpus=0)
    class Sleeper:
        def nap(self, seconds: float) -> None:
            time.sleep(seconds)

    fixed = "rollout actor 1 did not return RolloutActor.info within 0.5 s; if it recurs, see what it does"
    multiplied = (
        "rollout actor 1 did not return RolloutActor.info within 1 s (--deadline-factor 2 x (0.5 s)); if it "
        "recurs, see what it does; on slow hardware, raise --deadline-factor (now 2), which multiplies every deadline"
    )
    for kw, waited, line in [({}, 0.5, fixed), ({"factor": 2.0}, 1.0, multiplied)]:
        actor = Sleeper.remote()
        ray.get(actor.nap.remote(0), timeout=60)  # started
        ref = actor.nap.remote(30)
        t0 = time.perf_counter()
        with pytest.raises(ActorTimeout) as e:
            get_within([ref], ["rollout actor 1"], "RolloutActor.info", 0.5, fix="see what it does", **kw)
        took = time.perf_counter() - t0
        ray.kill(actor)
        assert str(e.value) == line
        assert waited - 0.01 <= took < waited + 5, took  # (ray.wait may return 0.1 ms early: above)
