"""Placement of an RL run: one placement group (PACK) of W learner bundles then R rollout bundles, and the
actors in them. Learners form a torch.distributed group when W > 1 (DDP); with --weight-sync collective,
learner rank 0 and the rollout actors form a ray.util.collective broadcast group, declared again (the next
generation's name) when a rollout actor restarted."""

from __future__ import annotations

import time
from collections.abc import Callable

import ray
from ray.exceptions import GetTimeoutError, RayTaskError
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from raychat.capacity import (
    Capacity,
    WaitReporter,
    check_bundles,
    fmt_bundle,
    free_capacity,
    missing_resources,
    read_capacity,
)
from raychat.config import RLConfig
from raychat.config.schema import flag_name, shown
from raychat.rl.learner import LearnerActor
from raychat.rl.rollout import RolloutActor
from raychat.rl.weights import create_collective_group


def role_bundles(cfg: RLConfig) -> tuple[list[dict], list[dict]]:
    """(the W learners' bundles, the R rollout actors'): {"CPU": c} each, + {"GPU": 1} with --use-gpu."""
    t, gpu = cfg.layout, {"GPU": 1} if cfg.layout.use_gpu else {}
    learners = [{"CPU": t.cpus_per_learner, **gpu}] * t.learner_workers
    return learners, [{"CPU": t.cpus_per_rollout, **gpu}] * t.rollout_workers


def layout_parts(cfg: RLConfig, option: Callable[[str], str] = flag_name) -> list[tuple[str, list[dict]]]:
    """(the flags that size it, its bundles) of each part of the placement group in the order they are checked:
    the learners (--learner-workers x --cpus-per-learner), the rollout actors (--rollout-workers x
    --cpus-per-rollout), then both together; each option named by `option` (raychat.train.launch.Flags.option:
    the speedrun's are its preset's keys, 'rl.rollout_workers')."""
    t = cfg.layout
    on_gpu = f" {option('use_gpu')}" if t.use_gpu else ""
    learners = (
        f"{option('learner_workers')} {t.learner_workers} x {option('cpus_per_learner')} "
        f"{shown(t.cpus_per_learner)}{on_gpu}"
    )
    rollouts = (
        f"{option('rollout_workers')} {t.rollout_workers} x {option('cpus_per_rollout')} "
        f"{shown(t.cpus_per_rollout)}{on_gpu}"
    )
    learner_bundles, rollout_bundles = role_bundles(cfg)
    both = (f"{learners} + {rollouts}", learner_bundles + rollout_bundles)
    return [(learners, learner_bundles), (rollouts, rollout_bundles), both]


def check_layout(cfg: RLConfig, capacity: Capacity, option: Callable[[str], str] = flag_name) -> None:
    """Refuse a placement group of `cfg` that `capacity` can never hold, naming the flags of the part that does
    not fit (layout_parts, in order, its options named by `option`).

    Raises ValueError: one line naming those flags, the need and the largest node (raychat.capacity.check_bundles).
    """
    for flags, bundles in layout_parts(cfg, option):
        check_bundles(bundles, capacity, flags)


def unplaced_part(
    cfg: RLConfig, capacity: Capacity, free: Capacity, option: Callable[[str], str] = flag_name
) -> tuple[str, list[dict]]:
    """The part of cfg's placement group (layout_parts, its options named by `option`) that waits in vain: the
    first that `capacity` cannot hold, else the first that what the nodes have free now (`free`:
    raychat.capacity.free_capacity) cannot, else both together."""
    parts = layout_parts(cfg, option)
    for where in (capacity, free):
        for flags, bundles in parts:
            try:
                check_bundles(bundles, where, flags)
            except ValueError:
                return flags, bundles
    return parts[-1]


class ActorsLost(RuntimeError):
    """Rollout actors are gone for good (out of --max-restarts, or none alive): the run restarts its actor group
    within --max-failures (raychat.rl.loop)."""


class StepFailed(RuntimeError):
    """A part of an RL step failed without losing an actor: an actor raised (a Ray task error), the weight sync
    was refused, or the task scored none of a step's samples (raychat.rl.rollout.ScoreErrors). `failed` says
    which actor and what it did ("rollout actor 1 raised in its rollout of prompts [3, 7]"); `error` is the
    exception raised there (a Ray task error's cause), `full` what to log in full (the Ray error with the actor's
    traceback, or a traceback's text; default `error`); `why` why a retry would not help and `fix` what to do
    before starting again. `restart`: the run restarts its actor group within --max-failures (the weight sync:
    new actors, a new publish) instead of stopping at once (raychat.rl.loop)."""

    def __init__(self, failed: str, error: BaseException, full=None, why: str = "", fix: str = "",
                 restart: bool = False):  # fmt: skip
        super().__init__(f"{failed} ({type(error).__name__}: {error})")
        self.failed, self.error, self.full, self.why, self.fix = failed, error, full, why, fix
        self.restart = restart


# Seconds the driver waits for the other learners once one learner's call raised: a learner that died fails its
# call within them (Ray marks the actor dead as its process exits), while the peers of one that raised would wait
# for it in a collective until the backend's timeout.
PEER_GRACE_S = 10.0


class LearnerRaised(RuntimeError):
    """Learner `index`'s call raised `error` (a RayTaskError; `cause` its cause, the learner's own exception),
    and no learner was lost (ActorGroup.learner_results)."""

    def __init__(self, index: int, error: RayTaskError):
        self.index, self.error = index, error
        self.cause = getattr(error, "cause", None) or error
        super().__init__(f"learner {index} raised ({type(self.cause).__name__}: {self.cause})")


class ActorGroup:
    """The learner and rollout actors of one run: `start()`, then `.learners` and `.rollouts`; `stop()`.
    `option` names the options in its refusals (layout_parts; the speedrun's name its preset's keys)."""

    def __init__(self, cfg: RLConfig, tasks: dict, option: Callable[[str], str] = flag_name):
        self.cfg, self.tasks, self.option = cfg, tasks, option
        self.pg = None
        self.learners: list = []
        self.rollouts: list = []
        self.generation = 0  # of the collective group: +1 at every rebuild

    @property
    def group_name(self) -> str:
        return f"raychat-rl-{self.cfg.run.run_name}-{self.generation}"

    @property
    def backend(self) -> str:
        return "nccl" if self.gpu else "gloo"

    @property
    def gpu(self) -> int:
        return 1 if self.cfg.layout.use_gpu else 0

    def _options(self, bundle: int, cpus: float, **kw) -> dict:
        strategy = PlacementGroupSchedulingStrategy(self.pg, placement_group_bundle_index=bundle)
        return {"num_cpus": cpus, "num_gpus": self.gpu, "scheduling_strategy": strategy, **kw}

    @property
    def bundles(self) -> list[dict]:
        """The placement group's bundles: W learners then R rollout actors, {"CPU": c} (+ {"GPU": 1})."""
        learners, rollouts = role_bundles(self.cfg)
        return learners + rollouts

    def check_layout(self) -> Capacity:
        """Refuse, before any actor starts, a placement group no node type of the cluster can ever hold
        (raychat.capacity.check_bundles: the autoscaler's node types, not only the alive nodes); returns the
        Capacity read.

        Raises ValueError: as check_layout."""
        capacity = read_capacity()
        check_layout(self.cfg, capacity, self.option)
        return capacity

    def start(self, ready_timeout_s: float | None = None) -> None:
        """Reserve the placement group and start every actor in it (module doc). While the group waits for
        nodes (the autoscaler adding them), a line every few seconds says what it waits for and for how long.
        On any failure (the group not placed within ready_timeout_s, default --schedule-timeout-s; an actor
        constructor that raises) everything started so far is stopped and the placement group removed before
        the error propagates.

        Raises ValueError when the group is not placed in time (one line naming the flags that size it and the
        missing resource); the actors' errors (ray.exceptions.RayActorError) as they are."""
        try:
            self._start(self.cfg.layout.schedule_timeout_s if ready_timeout_s is None else ready_timeout_s)
        except BaseException:
            self.stop()
            raise

    def _start(self, ready_timeout_s: float) -> None:
        t, gpu, bundles = self.cfg.layout, self.gpu, self.bundles
        self.pg = placement_group(bundles, strategy="PACK")
        reporter = WaitReporter(f"the RL placement group {bundles}", lambda: "pending").start()
        placed = False
        try:
            ray.get(self.pg.ready(), timeout=ready_timeout_s)
            placed = True
        except GetTimeoutError:
            capacity, free = read_capacity(), free_capacity()
            flags, part = unplaced_part(self.cfg, capacity, free, self.option)
            missing = "; ".join(dict.fromkeys(filter(None, (missing_resources(b, capacity) for b in part))))
            raise ValueError(
                f"{flags}: the RL placement group {bundles} was not placed within {self.option('schedule_timeout_s')} "
                f"{ready_timeout_s:g}; missing: {missing or f'room for {fmt_bundle(_summed(part))} ({free.describe()})'}"
            ) from None
        finally:
            reporter.stop(placed)
        device = "cuda" if gpu else "cpu"
        init = self.cfg.run.init_from
        self.learners = [
            LearnerActor.options(**self._options(r, t.cpus_per_learner)).remote(
                init, self.cfg, r, t.learner_workers, device, threads(t.cpus_per_learner)
            )
            for r in range(t.learner_workers)
        ]
        if t.learner_workers > 1:
            addr, port = ray.get(self.learners[0].address.remote())
            ray.get([lr.init_group.remote(addr, port) for lr in self.learners])
        self.rollouts = [
            RolloutActor.options(
                **self._options(t.learner_workers + i, t.cpus_per_rollout, max_restarts=t.max_restarts,
                                max_task_retries=0)
            ).remote(init, self.tasks, i, device, threads(t.cpus_per_rollout), self.cfg.rollout.max_slots)
            for i in range(t.rollout_workers)
        ]  # fmt: skip
        ray.get([w.info.remote() for w in self.rollouts] + [lr.pid.remote() for lr in self.learners])
        if t.weight_sync == "collective":
            create_collective_group(self.learners[0], self.rollouts, self.backend, self.group_name)

    def rebuild_collective_group(self) -> None:
        """Declare the broadcast group again with the current actor processes (after a rollout actor
        restarted): every member leaves the old group, the new one has the next generation's name. Every
        actor must be alive (a restarting one is waited for by the caller's ray.get)."""
        members = [self.learners[0], *self.rollouts]
        ray.get([a.leave_collective.remote(self.group_name) for a in members])
        forget_group(self.group_name)
        self.generation += 1
        create_collective_group(self.learners[0], self.rollouts, self.backend, self.group_name)

    def lost_learner(self, timeout_s: float = 30.0) -> int | None:
        """The index of the first learner that is dead or does not answer within timeout_s; None when every
        learner answers: tells a learner's own error from the one its DDP peers raise when it is lost."""
        for i, lr in enumerate(self.learners):
            try:
                ray.get(lr.pid.remote(), timeout=timeout_s)
            except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
                return i
        return None

    def name_of(self, actor_id: str | None) -> str:
        """ "learner i" or "rollout actor i" of the actor whose id is `actor_id` (hex, as Ray's actor errors
        carry it), "an actor of the run" for any other."""
        for role, actors in (("learner", self.learners), ("rollout actor", self.rollouts)):
            for i, a in enumerate(actors):
                if a._actor_id.hex() == actor_id:
                    return f"{role} {i}"
        return "an actor of the run"

    def learner_results(self, refs: list) -> list:
        """ray.get of one call on each learner (refs[i]: learners[i]'s) that does not wait out a collective:
        once a learner's call raised, its DDP peers wait in the group's all-reduce or barrier for it until the
        backend's timeout (gloo's: 30 minutes), so the others are waited for PEER_GRACE_S more only, within
        which a lost learner's call fails (RayActorError), telling a learner that raised on its own from the peer
        of a lost one. The caller stops the group, killing the waiting peers.

        Raises:
            RayActorError: a learner died (the first found).
            LearnerRaised: learner i's call raised (the first to), no learner died.
        """
        index = {ref: i for i, ref in enumerate(refs)}
        pending, raised, deadline = list(refs), None, None
        while pending:
            wait_s = None if deadline is None else max(0.0, deadline - time.monotonic())
            ready, pending = ray.wait(pending, num_returns=1, timeout=wait_s)
            if not ready:  # the peers of the learner that raised, waiting for it in a collective
                break
            try:
                ray.get(ready[0])
            except RayTaskError as e:
                if raised is None:
                    raised, deadline = LearnerRaised(index[ready[0]], e), time.monotonic() + PEER_GRACE_S
        if raised is not None:
            raise raised
        return ray.get(refs)

    def stop(self) -> None:
        """Kill every actor, forget the broadcast group and remove the placement group (safe to call again, and
        after a failed start). The next start() declares the broadcast group under the next generation's name."""
        for a in self.rollouts + self.learners:
            ray.kill(a, no_restart=True)
        self.rollouts, self.learners = [], []
        if self.cfg.layout.weight_sync == "collective":
            forget_group(self.group_name)
            self.generation += 1
        if self.pg is not None:
            remove_placement_group(self.pg)
            self.pg = None


def forget_group(group_name: str) -> None:
    """Kill the detached actor in which ray.util.collective declared `group_name` (if it is still there), so
    the name can be declared again by a later run."""
    try:
        ray.kill(ray.get_actor(f"info_{group_name}"))
    except ValueError:
        pass


def threads(cpus: float) -> int:
    """torch intra-op threads of an actor that reserved `cpus` CPUs (at least 1)."""
    return max(1, int(cpus))


def _summed(bundles: list[dict]) -> dict:
    """{resource: its sum over `bundles`}."""
    return {k: sum(b.get(k, 0) for b in bundles) for k in {k for b in bundles for k in b}}
