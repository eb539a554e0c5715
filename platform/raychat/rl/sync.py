"""Driver side of weight sync: publish the learner's weights as policy version v to every rollout actor, check
every actor's (version, hash) ack, and bring a restarted actor back to the current weights.

Object store (default): learner rank 0 puts its CPU state dict once; each actor fetches the same ObjectRef.
In async mode the acks are collected later (`drain`): they arrive after the rollout chunks queued before them.
Collective: learner rank 0 broadcasts over a ray.util.collective group (raychat.rl.weights). A restarted
actor cannot rejoin the group: the group is declared again with every current actor process and the
current weights are broadcast to all of them (the others receive the same weights again).

An actor that raises during a sync (its own error, not its death), and acks of other weights than those
published, are StepFailed with restart set: the run starts its actor group again (new actors, a new publish)
within --max-failures (raychat.rl.loop).

Deadline: every part of a sync is waited for raychat.rl.actors.sync_deadline: the weights' bytes at a floor rate
plus a base, and for a rollout actor's part the deadline of the chunks issued to it before it and not yet
collected (`ahead`, the dispatcher's: in async mode acks queue behind the rollouts in flight; in collective mode
the learner's broadcast waits for its slowest receiver). The parts are waited for together, each for its own
deadline from the same start (raychat.rl.actors.get_each_within): past the first, ActorTimeout names every actor
late then, and the run restarts its actor group within --max-failures.
"""

from __future__ import annotations

import time
from collections import deque

import ray
from ray.exceptions import ActorUnavailableError, RayActorError, RayTaskError

from raychat.log import log
from raychat.rl.actors import PING_S, ActorGroup, ActorsLost, StepFailed, get_within, sync_deadline
from raychat.rl.weights import check_acks

WEIGHT_SYNCS = ("object_store", "collective")  # --weight-sync: one ray.put every rollout reads | a broadcast
FIX = "see what its process does (py-spy dump: a hung object store or collective, a stuck device or node)"
# an actor's death (or restart) during a sync: re-synced after it (_acks), or by the dispatcher (drain)
LOST = (RayActorError, ActorUnavailableError)


class WeightSync:
    """Publishes weights through `actors` (module doc); counts actor restarts it met in `restarts`. `ahead(w)`:
    the deadline (seconds, how sized) of the chunks issued to rollout actor w and not yet collected, None when
    none (the RolloutDispatcher sets it to its own: RolloutDispatcher.ahead)."""

    def __init__(self, actors: ActorGroup, mode: str, log=log):
        if mode not in WEIGHT_SYNCS:
            raise ValueError(f"weight_sync must be one of {list(WEIGHT_SYNCS)}, got {mode!r}")
        self.actors, self.mode, self.log = actors, mode, log
        self.refs: list | None = None
        self.digest: str | None = None
        self.pending: deque = deque()
        self.restarts = 0
        self.ahead = lambda w: None

    def reset(self) -> None:
        """Forget what was published to the actors of a stopped actor group (the run restarts it)."""
        self.refs, self.digest = None, None
        self.pending.clear()

    def publish(self, version: int, block: bool = True) -> dict | None:
        """Publish the learner's weights as `version`; returns the SyncResult (None when not blocking)."""
        t0 = time.perf_counter()
        learner, rollouts = self.actors.learners[0], self.actors.rollouts
        if self.mode == "collective":
            return self._broadcast(version, t0)
        alone = sync_deadline(self.actors.weight_bytes)  # the learner is idle: nothing queued before it
        [published] = self._parts(
            [learner.publish.remote()], ["learner 0"], "Learner.publish", version, [alone]
        )
        self.refs, self.digest, put_s = published
        deadlines = self.deadlines()  # the chunks issued before the acks, still on their actors
        acks = [w.set_weights.remote(self.refs, version) for w in rollouts]
        if not block:
            self.pending.append((acks, deadlines, self.digest, version, put_s, t0))
            return None
        return _checked(
            self._acks(acks, deadlines, version), self.digest, version, put_s, time.perf_counter() - t0
        )

    def deadlines(self) -> list[tuple[float, str]]:
        """sync_deadline (seconds, how sized) of each rollout actor's part of a sync issued now: the weights' bytes
        (ActorGroup.weight_bytes) and the chunks issued to it before it (ahead)."""
        return [
            sync_deadline(self.actors.weight_bytes, self.ahead(w)) for w in range(len(self.actors.rollouts))
        ]

    def _broadcast(self, version: int, t0: float) -> dict:
        """Learner 0's broadcast and every rollout actor's receive, waited for together (_parts): each receiver
        for its deadline, the sender, which waits for every receiver, for the slowest's."""
        name, deadlines = self.actors.group_name, self.deadlines()
        refs = [self.actors.learners[0].broadcast.remote(name)]
        refs += [w.receive_broadcast.remote(name, version) for w in self.actors.rollouts]
        method = "Learner.broadcast / RolloutActor.receive_broadcast"
        s, *got = self._parts(
            refs, ["learner 0", *self._names()], method, version, [max(deadlines), *deadlines]
        )
        self.digest = s["hash"]
        return _checked(got, s["hash"], version, s["put_s"], time.perf_counter() - t0)

    def _names(self) -> list[str]:
        return [f"rollout actor {w}" for w in range(len(self.actors.rollouts))]

    def _acks(self, acks: list, deadlines: list[tuple[float, str]], version: int) -> list[dict]:
        """Acks of set_weights (acks[w]: rollout actor w's, waited for deadlines[w], all together: _parts); an
        actor that died meanwhile is waited for (restart) and re-synced once the others' acks are in."""
        out = self._parts(acks, self._names(), "RolloutActor.set_weights", version, deadlines, LOST)
        for w, ack in enumerate(out):
            if not isinstance(ack, LOST):
                continue
            self.restarts += 1
            self.log(f"rollout actor {w} died during weight sync; re-syncing after its restart")
            if not self.resync(w, version):
                raise ActorsLost(f"rollout actor {w} is dead (out of --max-restarts)") from None
            [info] = get_within([self.actors.rollouts[w].info.remote()], [f"rollout actor {w}"],
                                "RolloutActor.info (after its re-sync)", PING_S, fix=FIX)  # fmt: skip
            out[w] = info | {"apply_s": 0.0}
        return out

    def drain(self) -> dict | None:
        """Check the acks of non-blocking publishes (each publish's waited for together: _parts); returns the
        last SyncResult (None if none)."""
        last = None
        while self.pending:
            acks, deadlines, digest, version, put_s, t0 = self.pending.popleft()
            got = self._parts(acks, self._names(), "RolloutActor.set_weights", version, deadlines, LOST)
            if any(isinstance(ack, LOST) for ack in got):
                continue  # an actor restarted; it is re-synced when its chunk is re-issued
            last = _checked(got, digest, version, put_s, time.perf_counter() - t0)
        return last

    def resync(self, w: int, version: int, timeout_s: float = 120.0) -> bool:
        """Bring rollout actor w to the current weights (`version`), waiting while it restarts; False if it is
        dead. Collective: the group is rebuilt and every actor receives the weights again.

        Raises ActorTimeout when an actor's part did not return within its deadline (deadlines)."""
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                if self.mode == "collective":
                    self.actors.rebuild_collective_group(self.deadlines(), FIX)
                    return self._broadcast(version, time.perf_counter())["version"] == version
                [ack] = self._parts(
                    [self.actors.rollouts[w].set_weights.remote(self.refs, version)],
                    [f"rollout actor {w}"],
                    "RolloutActor.set_weights",
                    version,
                    [self.deadlines()[w]],
                )
                return ack["version"] == version and ack["hash"] == self.digest
            except ActorUnavailableError:
                if time.monotonic() > deadline:
                    return False
                time.sleep(0.2)
            except RayActorError:
                return False

    def _parts(
        self, refs: list, who: list[str], method: str, version: int, deadlines: list[tuple[float, str]],
        tolerate: tuple = (),
    ) -> list:  # fmt: skip
        """The results of the parts (`method`) of the weight sync to `version`, refs[i] on the actor named who[i],
        waited for together, each for deadlines[i] (seconds, how sized: sync_deadline) x --deadline-factor from
        the same start (ActorGroup.wait_each). An actor's own error (a Ray task error) is StepFailed naming it,
        restart set, as soon as it is found; its death is returned in its result's place when of a type in
        `tolerate` (LOST), else propagates (RayActorError), for the caller to recover.

        Raises ActorTimeout naming, past the first deadline, every actor then late (get_each_within)."""
        call = f"{method} (the weight sync to version {version})"
        try:
            return self.actors.wait_each(refs, who, call, deadlines, FIX, tolerate)
        except RayTaskError as e:
            raise StepFailed(
                f"the weight sync to version {version} failed in {_raiser(refs, who)}",
                getattr(e, "cause", None) or e,
                e,
                restart=True,
            ) from e


def _raiser(refs: list, who: list[str]) -> str:
    """The name (who[i]) of the first actor whose finished call refs[i] raised a Ray task error (one did)."""
    done, _ = ray.wait(refs, num_returns=len(refs), timeout=0)
    for ref, name in zip(refs, who):
        if ref in done:
            try:
                ray.get(ref)
            except RayTaskError:
                return name
            except RayActorError:
                pass
    return "an actor of the weight sync"


def _checked(acks: list[dict], digest: str, version: int, put_s: float, wall_s: float) -> dict:
    """check_acks; acks of other weights than those published are StepFailed, restart set."""
    try:
        return check_acks(acks, digest, version, put_s, wall_s)
    except RuntimeError as e:
        raise StepFailed(f"the weight sync to version {version} was not acknowledged", e, restart=True) from e
