"""Rollout scheduling: which prompts a step samples, how they are split over the rollout actors, and what
happens when an actor dies.

Prompts: step s takes prompts s*P .. s*P+P-1 of a seeded permutation of the training split (so a resumed run
continues with the same prompts); a chunk's sampling seed derives from (seed, step, chunk), so a re-issued
chunk samples the same completions under the same weights. A chunk whose actor died is re-issued after the
restarted actor is re-synced to the current weights (or moved to the next live actor).

Staleness bound: step s trains at policy version s (version = optimizer steps done), so its samples must come
from version >= s - bound, bound = 0 in sync mode (on-policy) and --max-staleness in async mode. Every chunk
is issued with that min_version: an actor holding older weights (restarted between a weight sync and its
rollout, so it holds the checkpoint's weights, version 0) generates nothing, and collect drops any sample
older than the bound, re-syncs the actor and issues the chunk again. `stale_chunks` counts such chunks and
`dropped_samples` their samples (prompts x samples a prompt, each generated again, whether the actor
generated them or refused to).

A rollout actor that raises (its own error, not its death: a bug, a prompt the engine refuses) is not
retried: the same prompts and seeds would raise again; collect raises StepFailed naming it (the run stops). A
sample whose Task.reward (or, in an evaluation, Task.is_correct) raises is scored 0 and counted
(`reward_errors`, one line per step that had any), unless every sample of the step or evaluation raised: that is
a broken reward function, not a bad sample, and StepFailed stops the run.

Deadline: the driver waits for a chunk raychat.rl.actors.rollout_deadline, ROLLOUT_FACTOR x the longest chunk of
its kind (training rollout or evaluation) completed so far in the run (of a kind none of which has completed yet:
its completion budget at FIRST_TOKENS_PER_S), summed over the chunks its actor runs before it (those issued there
before it and not yet collected), at least ROLLOUT_MIN_S; past it, ActorTimeout naming the actor and its prompts:
the run restarts its actor group within --max-failures (raychat.rl.loop). A weight sync's call on an actor queues
behind the chunks issued to it before (in async mode, the rollouts in flight): its deadline adds theirs (ahead,
which the dispatcher gives its WeightSync: raychat.rl.sync).

Evaluation goes the same way: its chunks (split "test", min_version = the current version, a seed per part
of the held-out prompts) are collected, re-synced and re-issued like a step's, so an actor lost during an
evaluation costs a re-run of its chunk, with the same result. Each actor's part is issued in about
EVAL_CHUNKS / actors chunks of whole --max-slots batches, each prompt sampled as in one call of the part (the
engine's seed_offset), so that a long evaluation reports its progress (EvalProgress) as its chunks come back.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Callable
from itertools import zip_longest

import numpy as np
from ray.exceptions import ActorUnavailableError, RayActorError, RayTaskError

from raychat.config import RLConfig
from raychat.log import TenthsProgress, duration, log, plural
from raychat.rl.actors import ActorGroup, ActorsLost, StepFailed, rollout_deadline
from raychat.rl.sync import WeightSync
from raychat.tasks.pass_at_k import pass_at_k
from raychat.train.launch import error_line

# an evaluation is issued in about this many chunks (at least one an actor): the steps of its progress lines
EVAL_CHUNKS = 10
EVAL_QUIET_S = 30.0  # an evaluation that has run for less prints no progress line (a tiny run's take seconds)


def chunk_seed(seed: int, step: int, chunk: int) -> int:
    return int.from_bytes(hashlib.sha256(f"rl:{seed}:{step}:{chunk}".encode()).digest()[:4], "little")


def split_even(items: list, n: int) -> list[list]:
    """n contiguous parts whose sizes differ by at most one (empty parts dropped)."""
    k, r = divmod(len(items), n)
    parts, start = [], 0
    for i in range(n):
        end = start + k + (i < r)
        parts.append(items[start:end])
        start = end
    return [p for p in parts if p]


def split_batches(part: list, per_batch: int, pieces: int) -> list[tuple[int, list]]:
    """(offset in `part`, its items) of at most `pieces` contiguous chunks of `part`, each of ceil(batches /
    pieces) whole batches of `per_batch` items but the last (so the batches are those of one call of the whole
    part): split_batches(list(range(10)), 2, 3) -> [(0, [0, 1, 2, 3]), (4, [4, 5, 6, 7]), (8, [8, 9])]."""
    batches = -(-len(part) // per_batch)
    size = -(-batches // max(1, min(pieces, batches))) * per_batch
    return [(o, part[o : o + size]) for o in range(0, len(part), size)]


class EvalProgress:
    """The progress lines of one evaluation of `total` held-out problems, logged as its chunks are collected
    (add): once it has run EVAL_QUIET_S and the problems done have reached another tenth of `total`, and not at
    the end (the evaluation's own line follows), e.g. "eval step 10: 120/400 held-out problems (30%) in 1m02s, eta
    2m25s". The ETA is the evaluation's mean rate so far x the problems left: its chunks come back in rounds, one
    from each rollout actor at about the same time, so the time between two collected chunks (StepClock's step)
    is not a chunk's time. `clock`: seconds (time.perf_counter); raychat.log.TenthsProgress says when."""

    def __init__(
        self,
        label: str,
        total: int,
        log: Callable[[str], None] = log,
        clock: Callable[[], float] = time.perf_counter,
    ):
        self.label, self.total, self.log = label, total, log
        self.done, self.pace = 0, TenthsProgress(total, EVAL_QUIET_S, clock)

    def add(self, problems: int) -> None:
        """`problems` more held-out problems evaluated: logs a line when one is due (above)."""
        self.done += problems
        due = None if self.done >= self.total else self.pace.due(self.done)
        if due is None:
            return
        elapsed, eta = due
        self.log(
            f"{self.label}: {self.done:,}/{plural(self.total, 'held-out problem')} "
            f"({100 * self.done // self.total}%) in {duration(elapsed)}, eta {duration(eta)}"
        )


class RolloutDispatcher:
    """Submits and collects the rollout chunks of each step and of each evaluation (module doc); `restarts`
    counts dead actors met, `reward_errors` the samples whose reward or checker raised (scored 0); `longest`:
    {split: seconds of its longest chunk completed so far} (the actor's wall time of the call), which sizes the
    deadlines (module doc).

    on_submitted(dispatcher, step, chunks): optional hook after a step's chunks are submitted;
    on_evaluating(dispatcher, chunks): optional hook before an evaluation's chunks are issued (tests kill an
    actor there: killed after, it could finish its part before the kill landed).
    """

    def __init__(
        self,
        cfg: RLConfig,
        actors: ActorGroup,
        sync: WeightSync,
        num_prompts: int,
        on_submitted=None,
        log=log,
        on_evaluating=None,
    ):
        self.cfg, self.actors, self.sync, self.log = cfg, actors, sync, log
        self.on_submitted, self.on_evaluating = on_submitted, on_evaluating
        self.order = np.random.default_rng(cfg.run.seed).permutation(num_prompts)
        self.version = 0  # the policy version the rollout actors hold (re-syncs load this one)
        self.bound = cfg.asynchrony.max_staleness if cfg.asynchrony.mode == "async" else 0
        self.restarts = self.stale_chunks = self.dropped_samples = self.reward_errors = 0
        self.longest: dict[str, float] = {}  # kept across actor group restarts: the run's chunks
        self.queued: dict[int, list[dict]] = {}  # worker -> its chunks issued and not yet collected, in order
        if sync is not None:  # a sync's call on an actor waits behind the chunks issued to it before
            sync.ahead = self.ahead

    def reset(self) -> None:
        """Forget the chunks issued to the actors of a stopped actor group (the run restarts it)."""
        self.queued = {}

    @property
    def device(self) -> str:
        """ "cuda" with --use-gpu, else "cpu": the rate of a first chunk's deadline (rollout_deadline)."""
        return "cuda" if self.cfg.layout.use_gpu else "cpu"

    def ahead(self, w: int) -> tuple[float, str] | None:
        """rollout_deadline (seconds, how sized) of the chunks issued to rollout actor w and not yet collected,
        what a call issued to it now waits behind (a weight sync's: raychat.rl.actors.sync_deadline); None when
        there are none."""
        queue = self.queued.get(w)
        if not queue:
            return None
        return rollout_deadline(self.longest, [self._work(c) for c in queue], self.device, own=False)

    @property
    def eval_samples(self) -> int:
        """Samples per held-out prompt: --eval-samples (1 at a greedy --eval-temperature: RLConfig refuses more)."""
        return self.cfg.eval.eval_samples

    def prompts_for(self, step: int) -> list[int]:
        P, n = self.cfg.rollout.prompts_per_step, len(self.order)
        return [int(self.order[(step * P + i) % n]) for i in range(P)]

    def chunks_for(self, step: int) -> list[dict]:
        """Step `step`'s rollout chunks, not yet issued: its prompts (prompts_for) split_even over the rollout
        actors, chunk c to actor c, sampled with seed chunk_seed(seed, step, c). The number of actors thus
        decides which prompt gets which seed (--rollout-workers is in RL's resume check: raychat.rl.loop)."""
        n = len(self.actors.rollouts)
        return [{"worker": c % n, "indices": idx, "seed": chunk_seed(self.cfg.run.seed, step, c), "ref": None,
                 "min_version": max(0, step - self.bound), "split": "train"}
                for c, idx in enumerate(split_even(self.prompts_for(step), n))]  # fmt: skip

    def submit(self, step: int) -> list[dict]:
        chunks = self.chunks_for(step)
        for chunk in chunks:
            self._issue(chunk)
        if self.on_submitted:
            self.on_submitted(self, step, chunks)
        return chunks

    def _issue(self, chunk: dict) -> None:
        r = self.cfg.rollout
        actor = self.actors.rollouts[chunk["worker"]]
        self._unqueue(chunk)  # re-issued: off its former actor's queue, last in its new one's
        self.queued.setdefault(chunk["worker"], []).append(chunk)
        if chunk["split"] == "test":
            chunk["ref"] = actor.evaluate.remote(
                chunk["indices"], self.eval_samples, r.max_tokens, self.cfg.eval.eval_temperature, chunk["seed"],
                chunk["min_version"], chunk["offset"],
            )  # fmt: skip
            return
        chunk["ref"] = actor.rollout.remote(
            chunk["indices"], r.samples_per_prompt, r.max_tokens, r.temperature, chunk["seed"], "train",
            self.cfg.asynchrony.mode == "async", chunk["min_version"],
        )  # fmt: skip

    def collect(self, chunks: list[dict], progress: EvalProgress | None = None) -> list[dict]:
        """Results of every chunk (training or evaluation), in the order of `chunks`, all from policy versions
        within the bound (module doc); a chunk whose actor died, or whose weights were too old, is re-issued after
        a re-sync. `progress` is told the prompts of each chunk as it is collected.

        Raises ActorsLost when a chunk fails --max-restarts + 2 times or no rollout actor is alive; StepFailed
        when an actor raised (not retried) or every sample's reward or checker raised (module doc); ActorTimeout
        when a chunk did not return within its deadline (_wait)."""
        tries = self.cfg.layout.max_restarts + 2
        out = []
        for chunk in chunks:
            for attempt in range(tries):
                try:
                    result = self._wait(chunk)
                except RayTaskError as e:
                    what = "evaluation of held-out" if chunk["split"] == "test" else "rollout of"
                    raise StepFailed(
                        f"rollout actor {chunk['worker']} raised in its {what} prompts {chunk['indices']}",
                        getattr(e, "cause", None) or e,
                        e,
                        why="the same prompts and seeds would raise again",
                        fix="fix what raised (its traceback is logged above)",
                    ) from e
                except (RayActorError, ActorUnavailableError) as e:
                    self.restarts += 1
                    self.log(
                        f"rollout actor {chunk['worker']} died ({type(e).__name__}); re-issuing its "
                        f"{'evaluation ' if chunk['split'] == 'test' else ''}prompts"
                    )
                    self._recover(chunk, attempt)
                    continue
                if result["version"] >= chunk["min_version"]:
                    out.append(result)
                    kind = chunk["split"]
                    self.longest[kind] = max(self.longest.get(kind, 0.0), result["wall_s"])
                    self._unqueue(chunk)
                    if progress is not None:
                        progress.add(len(chunk["indices"]))
                    break
                dropped = len(chunk["indices"]) * self._samples_per_prompt(chunk)
                self.stale_chunks += 1
                self.dropped_samples += dropped
                self.log(
                    f"rollout actor {chunk['worker']} held version {result['version']} < "
                    f"{chunk['min_version']} (restarted?): {plural(dropped, 'sample')} dropped; "
                    f"re-syncing it to version {self.version} and re-issuing its prompts"
                )
                self._recover(chunk, attempt)
            else:
                raise ActorsLost(
                    f"prompts {chunk['indices']} failed after {tries} tries (--max-restarts + 2)"
                )
        self._count_reward_errors(out, chunks[0]["split"] if chunks else "train")
        return out

    def _wait(self, chunk: dict) -> dict:
        """The chunk's result (ray.get), waited for raychat.rl.actors.rollout_deadline of the chunks queued on its
        actor ahead of it (issued there before it, not yet collected) and its own (module doc); its actor's death
        or error is raised as soon as it is found.

        Raises ActorTimeout naming the actor, its prompts, the seconds waited and how they were sized."""
        w, queue = chunk["worker"], self.queued.get(chunk["worker"], [])
        ids = [id(c) for c in queue]
        ahead = queue[: ids.index(id(chunk))] if id(chunk) in ids else []
        timeout_s, budget = rollout_deadline(
            self.longest, [self._work(c) for c in [*ahead, chunk]], self.device
        )
        what = "evaluation of held-out" if chunk["split"] == "test" else "rollout of"
        fix = (
            "see what its process does (py-spy dump: a deadlock, a stuck device or node); a healthy chunk that "
            f"needs longer: more {self.actors.option('rollout_workers')}, fewer prompts each"
        )
        call = f"its {what} prompts {chunk['indices']}"
        return self.actors.wait_for([chunk["ref"]], [f"rollout actor {w}"], call, timeout_s, budget, fix)[0]

    def _work(self, chunk: dict) -> tuple[str, int]:
        """(its kind: the split, its completion budget in tokens: prompts x samples x --max-tokens)."""
        samples = len(chunk["indices"]) * self._samples_per_prompt(chunk)
        return chunk["split"], samples * self.cfg.rollout.max_tokens

    def _samples_per_prompt(self, chunk: dict) -> int:
        """--eval-samples for an evaluation's chunk (split "test"), else --samples-per-prompt."""
        return self.eval_samples if chunk["split"] == "test" else self.cfg.rollout.samples_per_prompt

    def _unqueue(self, chunk: dict) -> None:
        for w, queue in self.queued.items():
            self.queued[w] = [c for c in queue if c is not chunk]

    def _count_reward_errors(self, results: list[dict], split: str) -> None:
        """Count and log the samples of `results` whose reward (split "train") or checker ("test") raised, each
        scored 0 by the actor (raychat.rl.rollout.ScoreErrors).

        Raises StepFailed when every sample's did (a broken reward function: the run stops)."""
        raised = sum(r.get("reward_errors", 0) for r in results)
        if not raised:
            return
        scored = sum(r["scored"] for r in results)
        first = next(r for r in results if r.get("reward_errors"))
        fn = "reward" if split == "train" else "checker (is_correct)"
        what = f"the {self.cfg.task.task} task's {fn}"
        of = "the step's rollouts" if split == "train" else "the evaluation"
        if raised == scored:
            raise StepFailed(
                f"{what} raised on all {plural(scored, 'sample')} of {of}", first["reward_error"],
                first["reward_traceback"], why="no sample could be scored: the function is broken, not a sample",
                fix=f"fix {what}",
            )  # fmt: skip
        self.reward_errors += raised
        error = first["reward_error"]
        self.log(
            f"{what} raised on {raised} of {plural(scored, 'sample')} of {of}, "
            f"{'scored 0' if split == 'train' else 'counted incorrect'} ({self.reward_errors} in all so far; "
            f"first: {error_line(error)}, on prompt {first['reward_error_prompt']})"
        )

    def _recover(self, chunk: dict, attempt: int) -> None:
        """Re-sync the (restarting) actor to the current weights and re-issue the chunk; after a failed re-sync
        (the actor is out of restarts) move the chunk to the next actor."""
        n = len(self.actors.rollouts)
        for k in range(n):
            w = (chunk["worker"] + k + (attempt > 0)) % n
            if self.sync.resync(w, self.version):
                chunk["worker"] = w
                self._issue(chunk)
                return
        raise ActorsLost("no rollout actor is alive")

    def eval_chunks(self, test_size: int) -> list[dict]:
        """The chunks of an evaluation of held-out prompts 0..test_size-1, not yet issued: split_even over the
        rollout actors, part i seeded (seed, -1, i) whichever actor runs it, and each part split_batches into
        about EVAL_CHUNKS / actors chunks of whole --max-slots batches (--max-slots // eval_samples prompts),
        chunk k of a part at "offset" k's first prompt in it (the engine's seed_offset: sampled as in one call of
        the part). Ordered round by round (every part's first chunk, then every part's second...), as the actors
        return them."""
        parts = split_even(list(range(test_size)), len(self.actors.rollouts))
        per_batch, pieces = (
            self.cfg.rollout.max_slots // self.eval_samples,
            -(-EVAL_CHUNKS // max(1, len(parts))),
        )
        by_part = [
            [{"worker": i, "indices": idx, "seed": chunk_seed(self.cfg.run.seed, -1, i), "offset": offset,
              "ref": None, "min_version": self.version, "split": "test"}
             for offset, idx in split_batches(part, per_batch, pieces)]
            for i, part in enumerate(parts)
        ]  # fmt: skip
        return [c for round_ in zip_longest(*by_part) for c in round_ if c is not None]

    def evaluate(self, test_size: int, progress: EvalProgress | None = None) -> dict:
        """pass@k (k = 1..eval_samples) over the held-out prompts 0..test_size-1 (test split), from the current
        policy version, in eval_chunks' chunks (`progress`: told each one's prompts as it is collected). Each
        prompt is sampled from its part's seed and its place in the part whichever actor runs its chunk, so an
        evaluation whose actor died is re-run (collect: re-synced restarted actor, or the next live one) with the
        same result as an undisturbed one."""
        chunks = self.eval_chunks(test_size)
        if self.on_evaluating:
            self.on_evaluating(self, chunks)
        for chunk in chunks:
            self._issue(chunk)
        results = sorted(zip(chunks, self.collect(chunks, progress)), key=lambda cr: cr[0]["indices"][0])
        correct = [c for _, result in results for c in result["correct"]]  # in the prompts' order
        n = self.eval_samples
        return {f"pass@{k}": float(np.mean([pass_at_k(n, c, k) for c in correct])) for k in range(1, n + 1)}
