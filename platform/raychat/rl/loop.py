"""The RL loop: rollouts -> rewards -> advantages -> learner step -> weight sync, on the shared substrate.

Parts: ActorGroup (placement, raychat.rl.actors), WeightSync (raychat.rl.sync), RolloutDispatcher (prompts,
chunks, faults: raychat.rl.dispatcher), the learners (DDP, the trainer's optimizer step: raychat.rl.learner),
the trainer's Checkpointer and MetricsSink, and the task registry (raychat.tasks.registry).

Synchronous mode (default, on-policy): rollouts of step s use policy version s exactly (a restarted rollout
actor is re-synced before it generates; raychat.rl.dispatcher enforces the bound on every sample).
Asynchronous mode (--mode async --max-staleness k): the rollout batches of the next k steps are in flight
while the learner trains, so a sample trained at step s came from version v >= s - k; staleness s - v is
recorded per sample and the loss uses the clipped importance ratio against the behavior log-probs.

Per step (one JSON line in OUT/RUN_NAME/metrics.jsonl, and raychat_rl_* gauges): reward_mean, reward_std,
pass_at_1 (of the rollouts), zero_advantage_frac (of the prompts, those whose samples all got the same reward: no
learning signal; when every prompt of the run's first steps had none, one warning line says whether all failed or
all were solved and what to try: no_signal_warning, once a run: NoSignalWatch), advantage_mean, advantage_std,
response_len_mean/min/max (completion tokens; these: rollout_stats), rollout_tokens_per_s (completion tokens /
the slowest chunk's generation seconds), learner_step_s, learner_wait_s (the driver waiting for rollouts between learner
steps), learner_wait_frac (wait / (wait + step + sync)), staleness_mean/max
(of the samples trained), sync_time_s (put + slowest actor's fetch+load), loss, grad_norm, entropy (the
policy's, nats a sampled token, at the rollout temperature: raychat.rl.objective.entropy_sum), normalization,
restarts, stale_chunks and dropped_samples (cumulative: rollouts refused or dropped because the actor's
weights were older than the staleness bound, raychat.rl.dispatcher; all re-issued). Every --eval-every
steps, and at step 0 (the baseline): pass@k, k = 1..--eval-samples, on held-out prompts, as "eval" in the step's
line (the baseline's line, step 0, holds only it); the summary's "evals" are every evaluation of the run, those
before a resume included (read back from metrics.jsonl; so are a finished run's, whose summary has
"already_complete" true: RLRun.finished). The summary covers the whole invocation, every actor
group restart included: start_step (where this invocation started), wall_s (seconds from run()'s start: the
actor group's start, the baseline evaluation and restarts included) and learner_wait_frac (over every learner
step of every attempt, redone ones too). Checkpoints go to OUT/RUN_NAME/checkpoint_<step:06d>
on any storage root (a directory, NFS, s3://, gs://) through raychat.checkpoint_manager: every learner uploads
its part, the driver commits; a run started again with the same --storage-path and --run-name resumes from the newest
committed one, when it asks for the same --init-from, task, prompt order and --rollout-workers (which prompts
share a sampling seed; check_resume; refused before anything is written otherwise).

Faults: a rollout actor that dies during a rollout or an evaluation is restarted by Ray (--max-restarts),
re-synced and its prompts re-issued (raychat.rl.dispatcher). Any other lost actor (a learner, one lost during
weight sync, every rollout actor) stops the whole actor group; it is started again and the run resumes from the
newest committed checkpoint, redoing the steps after it, up to --max-failures times (`failures` in every
metrics.jsonl line, on the step line once above 0, and in the summary); so does a weight sync that an actor raised in or that loaded other weights (new actors and
a new publish may succeed), and a hung actor: one whose start or Learner.restore did not return within its
deadline (raychat.rl.actors.ActorTimeout, the deadline sized from the checkpoint's bytes: read_deadline_s), or
whose rollout or evaluation chunk did not (sized from the run's longest chunks: rollout_deadline), or whose
learner step (from the run's longest steps: step_deadline), checkpoint save or part of a weight sync (from the
weights' bytes: save_deadline, sync_deadline; a sync's also from the chunks queued before it) did not; every
deadline x --deadline-factor, for slower hardware. Lost
learners are found with one ping each, all sent at once and waited for raychat.rl.actors.PING_S in all
(ActorGroup.lost_learners), every one named. Past that the run gives up: RunGaveUp (raychat.log), one line
naming the lost actor or failed sync, the step, the error, the failure count, --max-failures and the checkpoint
a new start resumes from, the error logged in full above it. What a retry would meet again ends the run at once, not retried, in
RunGaveUp's one line naming the step, what failed (its error's type and first line, logged in full above),
what to fix and the checkpoint a new start resumes from, the last good one: a learner step whose loss or
gradient norm is not finite (the learning rates to lower), a rollout actor's or a learner's own error (the same
prompts, seeds and samples would raise again; the other learners, waiting for it in a DDP collective, are
waited for raychat.rl.actors.PEER_GRACE_S only: ActorGroup.learner_results), a checkpoint upload or commit
the storage refused (full, permission denied), and a task whose reward raised on every sample of a step (or whose checker did on every
sample of an evaluation). A reward that raises on some samples scores them 0 (an evaluation's checker: counted
incorrect): counted in `reward_errors` (this invocation's total so far: in every metrics.jsonl line, on the step's
stdout line once above 0 as the other fault counters, and in the summary: step_line), one line each step that had
any (raychat.rl.dispatcher). The placement group is removed on every path out (raychat.rl.actors).
"""

from __future__ import annotations

import re
import time
from collections import deque
from collections.abc import Callable

import numpy as np
from ray.exceptions import ActorUnavailableError, RayActorError, RayTaskError

from raychat.capacity import fmt_bundle
from raychat.checkpoint_manager import CheckpointManager, committed_bytes
from raychat.config import ConfigError, RLConfig, to_dict, to_yaml
from raychat.config.schema import shown
from raychat.lease import RunLease
from raychat.log import StepClock, duration, log, plural
from raychat.metrics import RLMetrics
from raychat.metrics_sink import MetricsSink, read_logged
from raychat.rl.actors import (
    ActorGroup,
    ActorsLost,
    ActorTimeout,
    LearnerRaised,
    StepFailed,
    lost_line,
    read_budget,
    read_deadline_s,
    role_bundles,
    save_deadline,
    step_deadline,
)
from raychat.rl.dispatcher import EvalProgress, RolloutDispatcher, split_even
from raychat.rl.objective import group_advantages, zero_advantage_frac
from raychat.rl.sync import WeightSync
from raychat.sigterm import SigtermAsSigint, Terminated
from raychat.storage import is_remote, open_storage, write_bytes
from raychat.tasks.registry import make_task
from raychat.train.launch import (
    COMMANDS,
    Flags,
    changed_options,
    error_line,
    finished_line,
    gave_up,
    interrupted,
    refuse_resume,
    resumable_checkpoint,
    stopped_on_error,
    stopped_on_fault,
)
from raychat.train.step import NonFiniteError
from raychat.train.trainer import due, resumed_line

MODES = ("sync", "async")  # --mode: on-policy | rollouts up to --max-staleness versions ahead
STEP_FIX = "see what its process does (py-spy dump: a deadlock, a hung all-reduce, a stuck device or node)"
# What a run's starting weights, its prompt stream (step s: prompts s*P.. of the --seed order) and its samples'
# seeds derive from: a step's prompts are split over the rollout actors, chunk c seeded (seed, step, c), so
# another --rollout-workers samples other completions for the same prompts
# (raychat.rl.dispatcher.RolloutDispatcher.chunks_for).
RESUME_OPTIONS = (
    "init_from",
    "task",
    "task_examples",
    "max_operand",
    "seed",
    "prompts_per_step",
    "rollout_workers",
)
# What a resumed run may change (not RESUME_OPTIONS): how its remaining steps sample, weigh and update, and how
# its evaluations are taken; a resume that changes any names each in one line (check_resume's), so that a
# reward or pass@k curve that moves at the resume step has its cause in the log
NOTED_OPTIONS = (
    "samples_per_prompt", "max_tokens", "temperature", "matrix_lr", "embedding_lr", "unembedding_lr",
    "scalar_lr", "weight_decay", "grad_clip", "normalization", "scale_by_std", "constant_length", "clip_eps",
    "mode", "max_staleness", "eval_examples", "eval_samples", "eval_temperature",
)  # fmt: skip
EVAL_OPTIONS = ("eval_examples", "eval_samples", "eval_temperature")


def check_resume(cfg: RLConfig, flags: Flags = COMMANDS) -> str | None:
    """Check that the run's newest committed checkpoint, if there is one, is one this run can resume: every
    file its commit marker lists is there with its size, it is an RL checkpoint, made with this run's
    RESUME_OPTIONS (--init-from as resolved), at a step no later than --steps. Reads only storage. The refusals
    name the options as `flags` does (raychat.train.launch.Flags).

    Returns the line naming each of NOTED_OPTIONS this run sets otherwise than the checkpoint was made with
    ("resuming with other settings than ...: --temperature 1 -> 0.5; ..."), None when none differs or there is
    no checkpoint.

    Raises:
        CheckpointError: a file of the checkpoint is missing or of another size (named).
        ConfigError: another stage; one line naming each option of RESUME_OPTIONS that differs, with the
            checkpoint's value and this run's; or a checkpoint past --steps (nothing to train).
    """
    checkpoints = CheckpointManager(
        open_storage(cfg.run.storage_path), cfg.run.run_name, cfg.checkpoint.keep_checkpoints
    )
    found = resumable_checkpoint(checkpoints, cfg.run.run_name, "rl", flags)
    if found is None:
        return
    _, where, meta = found
    refuse_resume(where, changed_options(meta, cfg, RESUME_OPTIONS, flags), flags)
    if meta["step"] > cfg.rollout.steps:
        raise ConfigError(
            f"{flags.option('steps')}: the run's checkpoint {where} is at step {meta['step']}, this run asks for "
            f"{cfg.rollout.steps}: nothing to train (ask for {meta['step']} or more, or use {flags.other_run})"
        )
    return resume_changes_line(where, meta["step"], changed_options(meta, cfg, NOTED_OPTIONS, flags), flags)


def resume_changes_line(
    where: str, step: int, changed: list[tuple[str, object, object]], flags: Flags
) -> str | None:
    """The line of check_resume's return for `changed` (changed_options' list), None when it is empty."""
    if not changed:
        return None
    values = ", ".join(f"{name} {shown(was)} -> {shown(now)}" for name, was, now in changed)
    line = (
        f"resuming with other settings than the run's checkpoint {where} was made with: {values}; the steps "
        f"after {step} use this run's"
    )
    if {flags.option(o) for o in EVAL_OPTIONS} & {name for name, _, _ in changed}:
        line += f", and pass@k after step {step} is not measured as before it"
    return line


def layout_line(cfg: RLConfig) -> str:
    """The run's actors by role, '1 learner x {CPU: 0.5} + 2 rollout actors x {CPU: 0.5}' (it read '3 actors
    [{'CPU': 0.5}, ...]', which said neither)."""
    learners, rollouts = role_bundles(cfg)
    return (
        f"{plural(len(learners), 'learner')} x {fmt_bundle(learners[0])} + "
        f"{plural(len(rollouts), 'rollout actor')} x {fmt_bundle(rollouts[0])}"
    )


def rl_tasks(cfg: RLConfig) -> dict:
    """{"train": Task, "test": Task} of cfg.task.task: training prompts from the train split (seeded by --seed),
    held-out prompts from the test split, the same for every --seed (seed 0), so runs compare on one set."""
    t = cfg.task
    options = {"data_dir": t.task_data_dir} | (
        {"max_operand": t.max_operand} if t.task == "calculator" else {}
    )
    return {
        "train": make_task(t.task, "train", t.task_examples, cfg.run.seed, **options),
        "test": make_task(t.task, "test", cfg.eval.eval_examples, 0, **options),
    }


def check_train_split(cfg: RLConfig, tasks: dict, option: Callable[[str], str]) -> None:
    """Refuse a --prompts-per-step above the problems of `tasks`' train split ({"train", "test": Task}):
    RLConfig compares it with --task-examples only, and a hub task's split may be smaller (a step's prompts
    then repeated). `option` names a config field as the command's lines do.

    Raises:
        ConfigError: naming --prompts-per-step, --task and the split's size.
    """
    have, asked = len(tasks["train"]), cfg.rollout.prompts_per_step
    if asked > have:
        raise ConfigError(
            f"{option('prompts_per_step')} {asked} exceeds the {plural(have, 'problem')} of {option('task')} "
            f"{cfg.task.task}'s train split: a step's prompts would repeat (one prompt in several groups); lower "
            f"{option('prompts_per_step')} to at most {have}"
        )


def rl_gauges(run_name: str):
    """stats -> the raychat_rl_* Ray gauges (raychat.metrics.RLMetrics)."""
    gauges = RLMetrics(run_name)

    def record(s: dict) -> None:
        if "reward_mean" not in s:  # the baseline evaluation's line (step 0): no rollouts, no step
            return
        gauges.record(
            s["step"], s["reward_mean"], pass_at_1=s["pass_at_1"], staleness=s["staleness_mean"],
            sync_time_s=s["sync_time_s"], rollout_tokens_per_s=s["rollout_tokens_per_s"],
            learner_wait_frac=s["learner_wait_frac"], zero_advantage_frac=s["zero_advantage_frac"],
            reward_std=s["reward_std"], advantage_std=s["advantage_std"], entropy=s["entropy"],
            response_len_mean=s["response_len_mean"], response_len_min=s["response_len_min"],
            response_len_max=s["response_len_max"],
        )  # fmt: skip

    return record


class RLRun:
    """One RL run. `RLRun(cfg).run()` -> summary dict; see the module doc. Constructing it needs no Ray and
    makes check_resume's and check_train_split's checks (their errors).

    on_submitted(dispatcher, step, chunks): optional hook after a step's rollout chunks are submitted;
    on_evaluating(dispatcher, chunks): optional hook before an evaluation's chunks are issued.
    flags: how the resume check's refusals and the finished line name the options (raychat.train.launch.Flags).
    """

    def __init__(
        self, cfg: RLConfig, on_submitted=None, log=log, on_evaluating=None, flags: Flags = COMMANDS
    ):
        if not cfg.run.init_from:
            raise ValueError("--init-from (a chat checkpoint directory) is required")
        self.resume_changes = check_resume(cfg, flags)  # printed by the command (a run with steps left)
        self.cfg, self.log, self.flags = cfg, log, flags
        self.checkpoints = CheckpointManager(
            open_storage(cfg.run.storage_path), cfg.run.run_name, cfg.checkpoint.keep_checkpoints
        )
        self.run_dir = self.checkpoints.storage.uri_of(self.checkpoints.run_path)
        self.tasks = rl_tasks(cfg)
        check_train_split(cfg, self.tasks, flags.option)
        self.actors = ActorGroup(cfg, self.tasks, flags.option)
        self.sync = WeightSync(self.actors, cfg.layout.weight_sync, log)
        self.dispatcher = RolloutDispatcher(
            cfg, self.actors, self.sync, len(self.tasks["train"]), on_submitted, log, on_evaluating
        )
        self.version = 0
        self.step = 0  # the step in progress (1-based; before the first: the step resumed from, 0 at a start)
        self.failures = 0  # learner / weight-sync failures survived (actor group restarts), <= --max-failures
        self.evals: list[dict] = []  # {"step", "pass@k"...} of this run, a redone step's once
        self.no_signal = NoSignalWatch(
            cfg, flags.option
        )  # kept across actor group restarts: one warning a run
        self.longest_step: float | None = None  # seconds of the run's longest learner step (step_deadline)
        self.warm_learners = False  # a step completed since the actor group started (step_deadline's cold)
        self._lease: RunLease | None = None

    @property
    def restarts(self) -> int:
        return self.sync.restarts + self.dispatcher.restarts

    def set_version(self, version: int) -> None:
        self.version = self.dispatcher.version = version

    # ---- checkpoints (the trainer's Checkpointer in every learner, committed here) ------------------------
    def save(self, step: int, evaluation: dict | None) -> str:
        """Every learner uploads its part of checkpoint `step`; once all have, the driver commits it.

        Raises StepFailed (not retried: the storage would refuse it again) naming the learner whose upload
        raised, or the driver's step (prepare, commit) that raised OSError; ActorTimeout (the run restarts its
        actor group) naming every learner whose Learner.save did not return within raychat.rl.actors.save_deadline
        of the weights' bytes."""
        c, storage = self.checkpoints, self.checkpoints.storage
        uri = c.uri(step)
        why = "the storage would refuse the same checkpoint again"
        fix = f"make room on {self.flags.option('storage_path')} {storage.uri} (or let this run write there)"
        try:
            c.prepare(step)
        except OSError as e:
            raise StepFailed(f"the driver could not clear checkpoint {uri}", e, why=why, fix=fix) from e
        refs = [lr.save.remote(c, step, {"eval": evaluation}) for lr in self.actors.learners]
        hung = (
            f"check that its node writes {self.flags.option('storage_path')} {storage.uri} (a hung mount, an "
            "endpoint that does not answer)"
        )
        deadline = save_deadline(self.actors.weight_bytes)
        try:  # not waiting on the peers of a learner that raised (in the checkpointer's barrier)
            parts = self.actors.learner_results(refs, f"Learner.save of {uri}", deadline, hung)
        except LearnerRaised as e:
            raise StepFailed(f"learner {e.index} could not upload its part of checkpoint {uri}", e.cause, e.error,
                             why=why, fix=fix) from e.error  # fmt: skip
        try:
            return c.commit(step, parts, "rl")
        except OSError as e:
            raise StepFailed(f"the driver could not commit checkpoint {uri}", e, why=why, fix=fix) from e

    def resume(self) -> int:
        """Restore every learner from the newest committed checkpoint; returns its step (0 when there is none:
        the learners hold --init-from's weights, version 0).

        Raises ActorTimeout (the run restarts its actor group) naming every learner whose Learner.restore did not
        return within raychat.rl.actors.read_deadline_s of the checkpoint's bytes (its commit marker's sizes)."""
        newest = self.checkpoints.newest()
        if newest is None:
            self.set_version(0)
            return 0
        uri, self.step = self.checkpoints.uri(newest.step), newest.step  # the step a hung restore is named at
        nbytes, remote = committed_bytes(newest.commit), is_remote(uri)
        learners = self.actors.learners
        where = f"{self.flags.option('storage_path')} {self.checkpoints.storage.uri}"
        states = self.actors.wait_for(
            [lr.restore.remote(uri) for lr in learners], [f"learner {i}" for i in range(len(learners))],
            f"Learner.restore of {uri}", read_deadline_s(nbytes, remote), read_budget(nbytes, remote),
            f"check that its node reads {where} (a hung mount, an endpoint that does not answer)",
        )  # fmt: skip
        self.set_version(int(states[0]["version"]))
        self.log(resumed_line(uri, int(states[0]["step"]), f"version {self.version}"))
        return int(states[0]["step"])

    # ---- one learner step ------------------------------------------------------------------------------
    def learner_step(self, results: list[dict], step: int) -> tuple[dict, dict]:
        cfg = self.cfg
        order = self.dispatcher.prompts_for(step)
        samples = sorted((s for r in results for s in r["samples"]),
                         key=lambda s: (order.index(s["prompt_index"]), s["sample_index"]))  # fmt: skip
        rewards = [s["reward"] for s in samples]
        for s, a in zip(
            samples, group_advantages(rewards, cfg.rollout.samples_per_prompt, cfg.objective.scale_by_std)
        ):
            s["advantage"] = a
        if cfg.asynchrony.mode == "sync":
            for s in samples:
                s.pop("behavior_logprobs", None)
        learners = self.actors.learners
        shards = split_even(samples, len(learners))
        shards += [[] for _ in range(len(learners) - len(shards))]
        refs = [lr.step.remote(sh) for lr, sh in zip(learners, shards)]
        t0 = time.perf_counter()
        try:  # a lost learner's RayActorError is the caller's to handle (a restart); a hung one's ActorTimeout too
            stats = self.actors.learner_results(
                refs,
                f"Learner.step (the update of step {step + 1})",
                step_deadline(self.longest_step, cold=not self.warm_learners),
                STEP_FIX,
            )[0]
        except LearnerRaised as e:
            if isinstance(e.cause, NonFiniteError):  # the caller's to handle (stopped_on_fault)
                raise e.error from None
            raise StepFailed(
                f"learner {e.index} raised in its update",
                e.cause,
                e.error,
                why="the same samples would raise again",
                fix="fix what raised (its traceback is logged above)",
            ) from e.error
        self.longest_step = max(self.longest_step or 0.0, time.perf_counter() - t0)
        self.warm_learners = True
        return stats, rollout_stats(samples, results, self.version, cfg.rollout.samples_per_prompt)

    # ---- the loop --------------------------------------------------------------------------------------
    def finished(self) -> dict | None:
        """The summary of a run whose newest committed checkpoint is at --steps (check_resume found it to be one
        this run resumes): nothing to train or evaluate, so no Ray is needed; "already_complete" true, "evals"
        the run's evaluations read back from its metrics.jsonl (as a resumed run's). None when the run has no
        checkpoint or steps left."""
        c, steps = self.checkpoints, self.cfg.rollout.steps
        newest = c.newest()
        if newest is None or newest.step != steps:
            return None
        logged = read_logged(c.storage, f"{c.run_path}/metrics.jsonl")
        evals = [x["eval"] for x in logged if isinstance(x.get("eval"), dict) and x["step"] <= steps]
        return {"steps": steps, "start_step": steps, "already_complete": True, "evals": evals,
                "run_dir": self.run_dir, "checkpoint": c.uri(steps)}  # fmt: skip

    def run(self) -> dict:
        """Run to --steps; returns the summary. The placement group and every actor are released on return
        and on every error. A finished run (finished) logs one line saying so and returns without Ray; any other
        trains under the run's lease (lease()).

        Raises ValueError before anything is written when no node type of the cluster can ever hold the
        placement group (ActorGroup.check_layout), or another live driver trains the run (LeaseHeld)."""
        if (done := self.finished()) is not None:
            self.log(finished_line(done["checkpoint"], done["steps"], self.flags.option("steps")))
            return done
        self._began, self._start_step = time.perf_counter(), None  # of this invocation, across restarts
        self._waited = self._busy = 0.0  # the learner's seconds waiting for rollouts / stepping and syncing
        if self._lease is None or self._lease.holder is None:  # raychat.rl.cli takes it before it starts Ray
            with self.lease():
                return self._run_to_a_stop()
        return self._run_to_a_stop()

    def _run_to_a_stop(self) -> dict:
        """_run with SIGTERM raising Terminated (raychat.sigterm; Ray's native handler, installed at ray.init,
        aborted the driver, its actors still running), and Ctrl-C (KeyboardInterrupt) and SIGTERM (Terminated)
        raised again, once every actor is stopped, with the line of interrupted: the checkpoint the same command
        resumes from (Ctrl-C's used to be a bare "interrupted")."""
        try:
            with SigtermAsSigint():
                return self._run()
        except (KeyboardInterrupt, Terminated) as e:
            raise type(e)(self.interrupted_line()) from None

    def interrupted_line(self) -> str:
        """The line of this run stopped before its last step (Ctrl-C, SIGTERM): the checkpoint the same command
        resumes from (raychat.train.launch.interrupted)."""
        return interrupted(self.label, self.checkpoints, self.cfg.rollout.steps, flags=self.flags)

    def lease(self) -> RunLease:
        """The run's lease (raychat.lease), held while it is in a `with` block: run() trains under it, taking it
        itself unless the caller holds it (raychat.rl.cli, which takes it before it starts Ray). Raises
        LeaseHeld (a ValueError) as it is entered when another live driver trains the run."""
        self._lease = RunLease(
            self.checkpoints.storage, self.checkpoints.run_path, other_run=self.flags.other_run
        )
        return self._lease

    def _run(self) -> dict:
        capacity = self.actors.check_layout()
        self.log(f"layout: {layout_line(self.cfg)} on {capacity.describe()}")
        c = self.checkpoints
        write_bytes(c.storage, f"{c.run_path}/config.yaml", to_yaml(self.cfg, "rl").encode())
        metrics = MetricsSink(self.run_dir, rl_gauges(self.cfg.run.run_name), self.cfg.run.tracker,
                              self.cfg.run.run_name, to_dict(self.cfg))  # fmt: skip
        try:
            return self._run_within_budget(metrics)
        finally:
            metrics.close()
            self.actors.stop()

    def _run_within_budget(self, metrics: MetricsSink) -> dict:
        """Start the actor group and run the loop; when an actor is lost beyond what the rollout dispatcher recovers
        in place (a learner, weight sync, every rollout actor) or hung (ActorTimeout), or the weight sync fails,
        stop everything, start again and resume from the newest committed checkpoint, up to --max-failures times.

        Raises RunGaveUp (raychat.log) once the budget is spent: one line naming the lost actor or the failed
        sync, the step, the error, the failure count and --max-failures, and the checkpoint a new start resumes
        from; the error (its __cause__) logged in full above it. What a retry would meet again ends the run at
        once, RunGaveUp of one line naming the step and that checkpoint: a learner's non-finite loss or gradient
        norm (NonFiniteError: the learning rates to lower; raychat.train.launch.stopped_on_fault), an actor's own
        error (a rollout, evaluation or learner update that raised), a checkpoint the storage refused, every
        sample's reward raising (raychat.train.launch.stopped_on_error: what failed, its error's type and first
        line, why it is not retried, what to fix)."""
        budget = self.cfg.layout.max_failures
        while True:
            try:
                self.actors.start()
                self.warm_learners = False
                return self._loop(metrics)
            except (
                StepFailed,
                RayActorError,
                ActorUnavailableError,
                ActorsLost,
                ActorTimeout,
                RayTaskError,
            ) as e:
                lost, error, full = self._restartable(e)
                self.actors.stop()
                self.sync.reset()
                self.dispatcher.reset()
                if self.failures >= budget:
                    raise gave_up(
                        self.label,
                        lost,
                        error,
                        self.failures + 1,
                        budget,
                        self.flags,
                        self.newest_uri(),
                        full,
                        log=self.log,
                    ) from e
                self.failures += 1
                self.log(
                    f"{lost} ({error_line(error)}); restart {self.failures} of "
                    f"{self.flags.option('max_failures')} {budget}: starting every actor again and resuming from "
                    "the newest committed checkpoint"
                )

    @property
    def label(self) -> str:
        """How the run's last lines name it: "rl run 't'"."""
        return f"rl run {self.cfg.run.run_name!r}"

    def _restartable(self, e: BaseException) -> tuple[str, BaseException, object]:
        """(what failed and at which step, its error, what to log in full: None for the error) of a failure the
        run restarts its actor group for: a lost actor (a learner: also when the error is its DDP peer's; every
        lost learner named), a hung one (ActorTimeout), a failed weight sync (StepFailed.restart).

        Raises RunGaveUp for one it stops on at once: a non-finite step (stopped_on_fault), any other StepFailed
        (stopped_on_error: an actor's own error, a checkpoint the storage refused, a broken reward function) and
        any other actor's own error (a Ray task error; named by its method, "Learner.restore")."""
        at = f"at step {self.step}"
        if isinstance(e, StepFailed):
            if e.restart:
                return f"{e.failed} {at}", e.error, e.full
            raise stopped_on_error(
                self.label, self.step, e.failed, e.error, e.why, e.fix, self.newest_uri(), e.full, self.log
            ) from e
        if isinstance(fault := getattr(e, "cause", None), NonFiniteError):  # a learner's step
            raise stopped_on_fault(self.label, fault, self.cfg.optim, self.newest_uri(), self.flags) from e
        if isinstance(e, RayTaskError):
            # a surviving DDP rank raises its own error (gloo: the peer closed the connection) when a learner
            # is lost: a restart then too; any other task error is the actor's own and ends the run
            if lost := self.actors.lost_learners():
                return f"{lost_line(lost)} {at}", e, None
            method = re.search(r"ray::(\w+\.\w+)\(", str(e))
            raise stopped_on_error(
                self.label,
                self.step,
                f"{method.group(1) if method else 'an actor'} raised",
                fault or e,
                "it would raise again",
                "fix what raised (its traceback is logged above)",
                self.newest_uri(),
                e,
                self.log,
            ) from e
        if isinstance(e, ActorsLost):
            return f"the rollout actors were lost {at}", e, None
        if isinstance(e, ActorTimeout):
            return f"{e.named} hung {at}", e, None
        return f"{self.actors.name_of(getattr(e, 'actor_id', None))} was lost {at}", e, None

    def evaluate(self, step: int) -> dict:
        """{"step": step, "pass@1": ..., ...}: pass@k on the held-out problems from the current weights, with
        progress lines while it runs long (raychat.rl.dispatcher.EvalProgress: "eval step 10: 120/400 held-out
        problems (30%) in 1m02s, eta 2m25s")."""
        total = len(self.tasks["test"])
        progress = EvalProgress(f"eval step {step}", total, self.log)
        return {"step": step, **self.dispatcher.evaluate(total, progress)}

    def eval_line(self, evaluation: dict) -> str:
        """An evaluation's stdout line: 'eval step 5 (16 held-out problems x 4 samples): pass@1=0.25 ...'."""
        samples = self.dispatcher.eval_samples
        return (
            f"eval step {evaluation['step']} ({plural(len(self.tasks['test']), 'held-out problem')} x "
            f"{plural(samples, 'sample')}): {_fmt({k: v for k, v in evaluation.items() if k != 'step'})}"
        )

    def newest_uri(self) -> str | None:
        """The URI of the run's newest committed checkpoint (None: none was committed)."""
        newest = self.checkpoints.newest()
        return self.checkpoints.uri(newest.step) if newest else None

    def _loop(self, metrics: MetricsSink) -> dict:
        cfg, steps, is_async = self.cfg, self.cfg.rollout.steps, self.cfg.asynchrony.mode == "async"
        start = self.resume()
        self.step = start
        self._start_step = start if self._start_step is None else self._start_step
        metrics.resume_at(start if start else -1)  # a fresh start redoes the baseline evaluation (step 0) too
        sync = self.sync.publish(self.version)
        self.log(f"rl: {cfg.asynchrony.mode} mode, normalization={cfg.objective.normalization}, version "
                 f"{self.version}, initial sync {sync['sync_time_s']:.3f}s hash {sync['hash']}")  # fmt: skip
        evals = self.evals
        # the run's evaluations up to `start`, stored with their steps' lines (a restart, in this process or
        # another, redoes the steps after it): a resumed run's summary has them all, the baseline first
        evals[:] = [x["eval"] for x in metrics.logged() if isinstance(x.get("eval"), dict)]
        if start == 0:
            evals.append(self.evaluate(0))
            metrics.log({"step": 0, "eval": evals[-1]})
            self.log(self.eval_line(evals[-1]))
        inflight: deque = deque()
        ahead = cfg.asynchrony.max_staleness if is_async else 0
        next_submit = start
        clock = StepClock()
        for step in range(start, steps):
            self.step = step + 1
            while next_submit <= min(step + ahead, steps - 1):
                inflight.append(self.dispatcher.submit(next_submit))
                next_submit += 1
            t0 = time.perf_counter()
            results = self.dispatcher.collect(inflight.popleft())
            wait_s = time.perf_counter() - t0
            last_ack = self.sync.drain() if is_async else None
            stats, rollout = self.learner_step(results, step)
            self.set_version(stats["version"])
            t1 = time.perf_counter()
            sync = self.sync.publish(self.version, block=not is_async) or last_ack
            sync_wall = time.perf_counter() - t1
            self._waited += wait_s
            self._busy += stats["step_s"] + sync_wall
            line = {
                "step": step + 1, "version": self.version, "mode": cfg.asynchrony.mode, **rollout, **stats,
                "learner_step_s": stats["step_s"], "learner_wait_s": wait_s,
                "learner_wait_frac": wait_s / max(wait_s + stats["step_s"] + sync_wall, 1e-9),
                "sync_time_s": sync["sync_time_s"] if sync else None, "restarts": self.restarts,
                "failures": self.failures,
                "stale_chunks": self.dispatcher.stale_chunks, "dropped_samples": self.dispatcher.dropped_samples,
                "reward_errors": self.dispatcher.reward_errors,
            }  # fmt: skip
            if due(cfg.eval.eval_every, step + 1, steps):
                evals.append(self.evaluate(step + 1))
                line["eval"] = evals[-1]
            eta_s = clock.tick() * (steps - step - 1)
            self.log(step_line(line, steps, eta_s))
            if "eval" in line:
                self.log(self.eval_line(evals[-1]))
            metrics.log(line)
            if warning := self.no_signal.add(step + 1, rollout):
                self.log(warning)
            if due(cfg.checkpoint.checkpoint_every, step + 1, steps):
                metrics.flush()  # every committed step's line stored first (object storage PUTs at intervals)
                self.save(step + 1, evals[-1] if evals else None)
        self.sync.drain()
        newest = self.checkpoints.newest()
        return {
            "steps": steps, "start_step": self._start_step, "already_complete": False, "version": self.version,
            "restarts": self.restarts,
            "failures": self.failures,
            "stale_chunks": self.dispatcher.stale_chunks, "dropped_samples": self.dispatcher.dropped_samples,
            "reward_errors": self.dispatcher.reward_errors, "evals": evals, "learner_wait_frac": self._waited / max(self._waited + self._busy, 1e-9),
            "wall_s": time.perf_counter() - self._began, "run_dir": self.run_dir,
            "checkpoint": self.checkpoints.uri(newest.step) if newest else None,
        }  # fmt: skip


def rollout_stats(samples: list[dict], results: list[dict], version: int, group_size: int) -> dict:
    """A step's rollout fields of its metrics.jsonl line, from its `samples` (prompt-major, as the learner
    trains them: each with "reward", "advantage", "completion_tokens", "version", "prompt_index") and the
    rollout chunks' `results` ("completion_tokens", "seconds"); `version`: the policy's, that the step trains.

    reward_mean, reward_std (population std over the step's samples; TRL's reward_std is its groups' mean std),
    pass_at_1 (the share with reward > 0), zero_advantage_frac (raychat.rl.objective), advantage_mean and
    advantage_std (population, over the samples: verl's critic/advantages; the advantage is
    raychat.rl.objective.group_advantages', A_i = r_i - mean(group), GRPO (Shao et al. 2024) with its /std,
    Dr. GRPO (Liu et al. 2025) without, so advantage_mean is 0 up to rounding, and without --scale-by-std
    advantage_std is the root mean within-group variance of the rewards, the step's learning signal),
    response_len_mean, response_len_min, response_len_max (completion tokens a sample, tool output included;
    verl's response_length/mean, min, max), rollout_tokens_per_s (completion tokens / the slowest chunk's
    generation seconds), rollout_tokens, staleness_mean, staleness_max (version - each sample's), num_samples,
    prompts (their indices in the task's train split). The policy's entropy is the learner's (Learner.step's
    stats); there is no KL: no reference model is loaded."""
    rewards = np.array([s["reward"] for s in samples], dtype=np.float64)
    advantages = np.array([s["advantage"] for s in samples], dtype=np.float64)
    lengths = [s["completion_tokens"] for s in samples]
    staleness = [version - s["version"] for s in samples]
    tokens = sum(r["completion_tokens"] for r in results)
    return {
        "reward_mean": float(rewards.mean()),
        "reward_std": float(rewards.std()),
        "pass_at_1": float(np.mean(rewards > 0)),
        "zero_advantage_frac": zero_advantage_frac(rewards.tolist(), group_size),
        "advantage_mean": float(advantages.mean()),
        "advantage_std": float(advantages.std()),
        "response_len_mean": float(np.mean(lengths)),
        "response_len_min": int(min(lengths)),
        "response_len_max": int(max(lengths)),
        "rollout_tokens_per_s": tokens / max(max(r["seconds"] for r in results), 1e-9),
        "rollout_tokens": tokens,
        "staleness_mean": float(np.mean(staleness)),
        "staleness_max": int(max(staleness)),
        "num_samples": len(samples),
        "prompts": sorted({s["prompt_index"] for s in samples}),
    }


# Steps without a learning signal that no_signal_warning waits for: with the default 8 prompts x 8 samples, 5
# steps are 40 groups, and a policy that solves 5% of its samples leaves all 40 without a signal with probability
# (0.95^8)^40 < 1e-7; one that solves 1% with 4%. Fewer steps than that rarely mean anything; many more are
# wasted rollouts.
NO_SIGNAL_STEPS = 5


def no_signal_warning(
    rollouts: list[dict], cfg: RLConfig, steps: int, option: Callable[[str], str] = COMMANDS.option
) -> str | None:
    """The one warning line for a run whose first min(NO_SIGNAL_STEPS, steps) steps (`rollouts`: their
    learner_step rollout dicts, in order; `steps`: the run's --steps) all had zero_advantage_frac 1, every
    prompt's samples rewarded alike: every advantage, so the policy gradient, was 0 and nothing was learned.
    Its advice follows from the rewards (pass_at_1, the share of samples solved): all failed (the task is too
    hard for this policy), all solved (too easy), or some prompts each, naming the options as `option` does
    (Flags.option: "--temperature", the speedrun's "rl.temperature"). None otherwise, and for any other number
    of rollouts, so that it is printed once."""
    if len(rollouts) != min(NO_SIGNAL_STEPS, steps) or any(r["zero_advantage_frac"] < 1 for r in rollouts):
        return None
    g, task = cfg.rollout.samples_per_prompt, f"{option('task')} {cfg.task.task}"
    reward = float(np.mean([r["reward_mean"] for r in rollouts]))
    solved = {r["pass_at_1"] for r in rollouts}
    head = f"warning: no learning signal in the first {plural(len(rollouts), 'step')}: "
    zero = "so every advantage and the policy gradient were 0"
    more = (
        f"more {option('samples_per_prompt')} (now {g}) or a higher {option('temperature')} "
        f"(now {cfg.rollout.temperature:g})"
    )
    start = option("init_from")  # the speedrun's: "the SFT checkpoint", which it lays out
    stronger = f"a stronger {start}" if start.startswith("--") else f"a stronger start than {start}"
    if solved == {0.0}:
        return (
            f"{head}all {g} samples of every prompt failed (mean reward {reward:.4g}), {zero}; try {stronger} "
            f"(a checkpoint that solves some {task} prompts), {more}"
        )
    if solved == {1.0}:
        harder = (
            f"a larger {option('max_operand')} (now {cfg.task.max_operand}) or "
            if cfg.task.task == "calculator"
            else ""
        )
        return (
            f"{head}all {g} samples of every prompt were solved (mean reward {reward:.4g}), {zero}: {task} "
            f"is too easy for this policy; give it harder prompts ({harder}another {option('task')}) or stop "
            f"here. A {stronger[2:]} cannot help, and {more} only finds a rare failure to learn from"
        )
    return (
        f"{head}the {g} samples of each prompt got the same reward (mean reward {reward:.4g}: some prompts all "
        f"failed, the others all solved), {zero}; try {more}, so that a prompt's samples differ"
    )


class NoSignalWatch:
    """Prints no_signal_warning once per run: over the run's first NO_SIGNAL_STEPS steps, as this invocation
    ran them. A step redone after an actor group restart replaces its first record; an invocation that
    resumed from a checkpoint did not see step 1 and prints nothing (the one that ran the steps did)."""

    def __init__(self, cfg: RLConfig, option: Callable[[str], str] = COMMANDS.option):
        self.cfg, self.option = cfg, option
        self.first: dict[int, dict] = {}  # step (1-based) -> its learner_step rollout dict
        self.warned = False

    def add(self, step: int, rollout: dict) -> str | None:
        """Record step `step` (1-based); returns the warning line the first time it is due, else None."""
        if self.warned or step > NO_SIGNAL_STEPS:
            return None
        self.first[step] = rollout
        window = range(1, min(NO_SIGNAL_STEPS, self.cfg.rollout.steps) + 1)
        if any(s not in self.first for s in window):
            return None
        warning = no_signal_warning(
            [self.first[s] for s in window], self.cfg, self.cfg.rollout.steps, self.option
        )
        self.warned = warning is not None
        return warning


_LOG_KEYS = (
    "step", "reward_mean", "reward_std", "zero_advantage_frac", "advantage_std", "response_len_mean",
    "response_len_min", "response_len_max", "loss", "grad_norm", "entropy", "rollout_tokens_per_s",
    "learner_step_s", "learner_wait_s", "learner_wait_frac", "sync_time_s", "staleness_mean", "restarts", "failures",
    "stale_chunks", "dropped_samples", "reward_errors",
)  # fmt: skip
# async mode's off-policy samples: the largest staleness, their mean importance ratio and the share of tokens
# --clip-eps clipped (PPO's clipfrac), after staleness_mean; on-policy (sync) the ratio is 1 and none is clipped
_ASYNC_KEYS = ("staleness_max", "ratio_mean", "clip_frac")
# cumulative fault counters: on the line only once nonzero, so that a fault stands out (metrics.jsonl has all)
_FAULT_KEYS = ("restarts", "failures", "stale_chunks", "dropped_samples", "reward_errors")


def step_line(line: dict, steps: int, eta_s: float) -> str:
    """A step's stdout line: the _LOG_KEYS of its metrics.jsonl `line` (those set, and of the _FAULT_KEYS those
    above 0; with "mode" "async" also _ASYNC_KEYS after staleness_mean), its step out of the run's `steps` as
    pretraining's line counts them ("step=15/50"), then its ETA of `eta_s` seconds as pretraining's line shows it
    ("eta=42s", "eta=12m05s", "eta=3h07m": raychat.log.duration). Floats have 4 significant
    digits, those of 10,000 or more are rounded to whole numbers ("rollout_tokens_per_s=16286", not
    "1.629e+04")."""
    keys = list(_LOG_KEYS)
    if line.get("mode") == "async":
        at = keys.index("staleness_mean") + 1
        keys[at:at] = _ASYNC_KEYS
    shown = {k: line[k] for k in keys if line.get(k) is not None and not (k in _FAULT_KEYS and line[k] == 0)}
    shown |= {"step": f"{line['step']}/{steps}"}
    return _fmt(shown) + f" eta={duration(eta_s)}"


def _fmt(d: dict) -> str:
    return " ".join(f"{k}={_number(v)}" if isinstance(v, float) else f"{k}={v}" for k, v in d.items())


def _number(v: float) -> str:
    return f"{v:.0f}" if abs(v) >= 1e4 else f"{v:.4g}"
