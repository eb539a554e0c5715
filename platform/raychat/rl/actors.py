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
from raychat.checkpoint_manager import commit_of, committed_bytes
from raychat.config import RLConfig
from raychat.config.schema import flag_name, shown
from raychat.rl.learner import LearnerActor
from raychat.rl.rollout import RolloutActor
from raychat.rl.weights import create_collective_group
from raychat.storage import is_remote


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


# Deadlines of the driver's calls on the actors that take about as long whatever the run asks of them; past one,
# ActorTimeout: the run stops its actor group and starts it again within --max-failures, as for a lost actor
# (raychat.rl.loop). A rollout or evaluation chunk has one sized from the run's own chunks (rollout_deadline), a
# learner step from the run's own steps (step_deadline), a checkpoint save and a weight sync from the weights'
# bytes (save_deadline, sync_deadline); a learner's peers, once one raised, have PEER_GRACE_S. --deadline-factor
# (default 1) multiplies every deadline but PING_S and PEER_GRACE_S (get_within): what a user on slower hardware
# than these numbers assume raises, as the ActorTimeout line says.
PING_S = 30.0  # Learner.pid, RolloutActor.info: it only answers (lost_learners)
# a call that reads a checkpoint (Learner.restore; an actor's start, --init-from): READ_BASE_S plus the
# checkpoint's bytes at READ_BYTES_PER_S, a floor of what a disk, NFS or object storage delivers (fetching a
# remote checkpoint reads it twice: the download, then its sha256 check)
READ_BASE_S = 60.0
READ_BYTES_PER_S = 10e6
# an actor's start before it reads --init-from: Ray gives up setting up its runtime env (a job's pip packages) after
# this (RuntimeEnvConfig's setup_timeout_seconds default) and raises; the DDP group's rendezvous comes after
START_S = 600.0
# A rollout or evaluation chunk takes as long as its work (its prompts x samples x --max-tokens on this model and
# device), so the driver waits for it ROLLOUT_FACTOR x the longest chunk of its kind (a training rollout, an
# evaluation) completed so far in this run, at least ROLLOUT_MIN_S. ROLLOUT_FACTOR covers what makes a healthy
# chunk slower than the longest before it: measured (bench/rl_chunk_times.py, bench/results/rl.md), at most 1.97x
# in async mode (the learner sharing the CPUs), 1.5x in sync mode, over 100 chunks of 2 runs; and completions that
# grow to --max-tokens (a chunk decodes until its longest completion ends; those runs' longest were 22-31 of 32
# tokens, a policy may go from a fifth of --max-tokens to all of it): 2 x 5. ROLLOUT_MIN_S covers a cold engine's
# warm-up: the presets' largest, gpu8's evaluation (67 prompts x 8 samples x 256 tokens an actor), is ~30 s at
# that preset's assumed 5,000 tokens/s; 10 minutes, as an actor's start (START_S), leaves 20x of room and finds a
# hung actor within minutes. A chunk of a kind none of which has completed yet (the baseline evaluation at step 0,
# the first rollout) has no chunk to be sized from, and its size is the user's (--eval-examples x --eval-samples x
# --max-tokens has no bound): it gets its completion budget (prompts x samples x --max-tokens tokens) at
# FIRST_TOKENS_PER_S of its device, so that a large one is not killed at every restart (the baseline evaluation
# comes again after each). CPU: 5 tokens/s, 2x below the wall rate of one request of a depth-8 model on a 2-core
# machine at a load average of 10-16 (11 tokens/s; 31-61 with 8-64 requests together:
# bench/results/engine_decode.md); GPU: 100 tokens/s, 50x below gpu8's assumed 5,000.
ROLLOUT_MIN_S = 600.0
ROLLOUT_FACTOR = 10.0
FIRST_TOKENS_PER_S = {"cpu": 5.0, "cuda": 100.0}
CHUNK_KINDS = {"train": "training", "test": "evaluation"}  # a chunk's split -> how its deadline names it
# A checkpoint save (Learner.save) writes the learner's part into a temporary directory, then uploads it to
# --storage-path: its bytes twice, at READ_BYTES_PER_S, plus READ_BASE_S. Its bytes are at most SAVE_STATE_X x the
# weights' (the weights, and of the optimizers AdamW's two moments a weight, Muon's one; the tokenizer, meta and
# RNG state are within READ_BASE_S), known before the first save.
SAVE_STATE_X = 3
# A weight sync (the learner's publish or broadcast, each rollout actor's set_weights or receive_broadcast) moves
# the weights' bytes once: READ_BASE_S + its bytes at READ_BYTES_PER_S, 25-50x below what the object store path
# was measured at on this machine (2-4 ms/MB end to end: bench/results/rl.md); an actor's part also waits for the
# chunks issued to it before it (in async mode the rollouts in flight): their rollout_deadline adds up.
# A learner step takes as long as its work (prompts x samples x their tokens, on this model and device), so the
# driver waits STEP_FACTOR x the longest learner step completed so far in this run (the driver's wall time of the
# call), at least STEP_MIN_S, as for a rollout chunk. STEP_FACTOR covers what makes a healthy step slower than the
# longest before it: measured (bench/rl_chunk_times.py, bench/results/rl.md), at most 1.52x in async mode (the
# rollouts sharing the CPUs), 0.82x in sync mode (the cold first step the longest), over 40 steps of 2 runs on a
# loaded 2-core machine; and samples that grow to --max-tokens (a step's work is its tokens; a policy may go from a
# fifth of --max-tokens to all of it): 2 x 5, the chunks' factor. The first step of a run has none to be sized from
# and is cold (torch.compile, the first allocations, the first all-reduce): it gets STEP_FIRST_S, 1,800 s: the tiny
# setup's first --compile step took 114 s on that loaded machine (the later ones 0.82 s), 3.9 s without --compile
# (bench/results/rl.md), a cold compile of the cpu preset's model 43 s (bench/results/train_throughput.md); a GPU
# preset's model compiles in minutes (not measured here), its step (gpu8: 16 x 16 samples of up to ~500 tokens on
# 2 GPUs) in seconds. After a restart the new learners' first step is cold again (on a node perhaps without the
# compile cache that made the run's first step fast): at least STEP_FIRST_S too.
STEP_MIN_S = 600.0
STEP_FACTOR = 10.0
STEP_FIRST_S = 1800.0


def step_deadline(longest: float | None, cold: bool = False) -> tuple[float, str]:
    """(seconds, how they were sized) the driver waits for a learner step (Learner.step on every learner), from
    the moment it starts waiting: STEP_FACTOR x `longest` (seconds of the longest learner step so far in the run,
    the driver's wall time of the call), at least STEP_MIN_S; the first step of a learner group (`cold`: none has
    completed since it started; after a restart its node may lack the compile cache the run's first step had),
    or of the run (`longest` None), at least STEP_FIRST_S. The line: "at least 600 s, else 10 x the longest
    learner step so far (1.23 s)", "1800 s for the first learner step (a cold start: torch.compile, first
    allocations)", "at least 1800 s for these learners' first step (a cold start), else 10 x ..."."""
    if longest is None:
        return (
            STEP_FIRST_S,
            f"{STEP_FIRST_S:g} s for the first learner step (a cold start: torch.compile, first allocations)",
        )
    least, why = (
        (STEP_FIRST_S, " for these learners' first step (a cold start)") if cold else (STEP_MIN_S, "")
    )
    return (
        max(least, STEP_FACTOR * longest),
        f"at least {least:g} s{why}, else {STEP_FACTOR:g} x the longest learner step so far ({longest:.3g} s)",
    )


def save_deadline(weight_bytes: int) -> tuple[float, str]:
    """(seconds, how they were sized) the driver waits for a checkpoint save (Learner.save on every learner):
    READ_BASE_S + 2 x SAVE_STATE_X x `weight_bytes` (the weights' bytes) at READ_BYTES_PER_S. The line:
    "60 s + 2 x 3 x 1.2 MB at 10 MB/s (written, then uploaded; the weights and their optimizer state)"."""
    seconds = READ_BASE_S + 2 * SAVE_STATE_X * weight_bytes / READ_BYTES_PER_S
    return seconds, (
        f"{READ_BASE_S:g} s + 2 x {SAVE_STATE_X} x {weight_bytes / 1e6:.3g} MB at {READ_BYTES_PER_S / 1e6:.3g} "
        "MB/s (written, then uploaded; the weights and their optimizer state)"
    )


def sync_deadline(weight_bytes: int, ahead: tuple[float, str] | None = None) -> tuple[float, str]:
    """(seconds, how they were sized) the driver waits for an actor's part of a weight sync: read_deadline_s of
    the weights' bytes, plus `ahead`, the deadline (seconds, how sized: rollout_deadline) of the chunks issued to
    that actor before it and not yet collected (None: none). The line: "60 s + 1.2 MB at 10 MB/s of the weights +
    the chunks queued on its actor before it (at least 600 s, else 10 x the longest training chunk so far
    (1.5 s))"."""
    seconds, budget = read_deadline_s(weight_bytes), f"{read_budget(weight_bytes)} of the weights"
    if ahead is None:
        return seconds, budget
    return seconds + ahead[0], f"{budget} + the chunks queued on its actor before it ({ahead[1]})"


def rollout_deadline(
    longest: dict[str, float], chunks: list[tuple[str, int]], device: str, own: bool = True
) -> tuple[float, str]:
    """(seconds, how they were sized) the driver waits for a rollout chunk, from the moment it starts waiting: at
    least ROLLOUT_MIN_S, else the sum over `chunks` of ROLLOUT_FACTOR x longest[kind], or, for a kind not in
    `longest` (none completed yet), of its tokens at FIRST_TOKENS_PER_S[device] ("cpu", "cuda").

    chunks: (kind: the split, "train" or "test"; tokens: its completion budget, prompts x samples x --max-tokens)
    of every chunk its actor runs before it returns, the chunks issued there before it and not collected yet,
    then its own (an evaluation issued in async mode waits behind the training chunks of the next --max-staleness
    steps). longest: seconds of the longest chunk of each kind completed so far in the run (its actor's wall time
    of the call). The line says how: "at least 600 s, else 10 x the longest training chunk so far (1.23 s)",
    "at least 600 s, else 16,384 tokens at 5 tokens/s (no evaluation chunk done yet: prompts x samples x
    --max-tokens)". own=False: `chunks` are those ahead of another call on their actor (a weight sync's, in async
    mode: sync_deadline), none of them its own."""
    kinds = [k for k, _ in chunks]
    counts = {k: kinds.count(k) for k in dict.fromkeys(kinds) if k in longest}
    first: dict[str, int] = {}
    for kind, tokens in chunks:
        if kind not in longest:
            first[kind] = first.get(kind, 0) + tokens
    rate = FIRST_TOKENS_PER_S[device]
    seconds = ROLLOUT_FACTOR * sum(longest[k] * n for k, n in counts.items()) + sum(first.values()) / rate
    terms = [
        f"{ROLLOUT_FACTOR:g} x "
        + ", ".join(
            f"{'' if n == 1 else f'{n} x '}the longest {CHUNK_KINDS[k]} chunk so far ({longest[k]:.3g} s)"
            for k, n in counts.items()
        )
    ] if counts else []  # fmt: skip
    terms += [
        f"{tokens:,} tokens at {rate:g} tokens/s (no {CHUNK_KINDS[k]} chunk done yet: prompts x samples x "
        "--max-tokens)"
        for k, tokens in first.items()
    ]
    what = " + ".join(terms)
    if len(chunks) > 1:
        what += f": the {len(chunks)} chunks on its actor{', this one last' if own else ''}"
    return max(ROLLOUT_MIN_S, seconds), f"at least {ROLLOUT_MIN_S:g} s, else {what}"


def read_deadline_s(nbytes: int, remote: bool = False) -> float:
    """Seconds a call that reads a checkpoint of `nbytes` bytes may take: READ_BASE_S + nbytes / READ_BYTES_PER_S,
    the bytes counted twice for a remote one (downloaded, then its sha256 checked:
    raychat.checkpoint_manager.resolve_checkpoint)."""
    return READ_BASE_S + (2 if remote else 1) * nbytes / READ_BYTES_PER_S


def read_budget(nbytes: int, remote: bool = False) -> str:
    """How read_deadline_s sized its deadline, for ActorTimeout's line: "60 s + 1.2 MB at 10 MB/s", of a remote
    checkpoint "60 s + 2 x 1.2 MB at 10 MB/s (downloaded, then checked)"."""
    twice, checked = ("2 x ", " (downloaded, then checked)") if remote else ("", "")
    return f"{READ_BASE_S:g} s + {twice}{nbytes / 1e6:.3g} MB at {READ_BYTES_PER_S / 1e6:.3g} MB/s{checked}"


class ActorTimeout(RuntimeError):
    """The driver's `call` on the actors `who` (["learner 1"]) did not return within `waited_s` seconds
    (`budget`: how the deadline was sized, "" for a fixed one; `factor`: --deadline-factor, named `flag`, which
    multiplied it, None for a deadline it does not multiply: PING_S), the actors alive, so hung (get_within);
    `fix`: what to check when it recurs. `call` and `fix` speak of one actor ("its start", "check that its node
    ..."); the line names one, two or more actors and, unless `factor` is None, ends saying how to raise the
    deadlines:
      learner 0 did not return its start within 9 s; if it recurs, check ...; on slow hardware, raise
      --deadline-factor (now 1), which multiplies every deadline
      neither rollout actor 0 nor learner 0 returned its start within 18 s (--deadline-factor 2 x (9 s ...)); if
      it recurs, for each: check ...; on slow hardware, raise --deadline-factor (now 2), ...
      none of rollout actor 0, rollout actor 1 and learner 0 returned its start within 9 s; if it recurs, for
      each: check ...; on slow hardware, ...
      rollout actor 1 did not return RolloutActor.info within 30 s; if it recurs, see ... (factor None)
    The run stops its actor group (killing them) and starts it again within --max-failures (raychat.rl.loop)."""

    def __init__(
        self, who: list[str], call: str, waited_s: float, budget: str, fix: str, factor: float | None = 1.0,
        flag: str = "--deadline-factor",
    ):  # fmt: skip
        self.who, self.call, self.waited_s = who, call, waited_s
        if factor not in (1, None):
            budget = f"{flag} {factor:g} x ({budget or f'{_seconds(waited_s / factor)} s'})"
        sized = f" ({budget})" if budget else ""
        if len(who) == 1:
            late, each = f"{who[0]} did not return", ""
        elif len(who) == 2:
            late, each = f"neither {who[0]} nor {who[1]} returned", "for each: "
        else:
            late, each = f"none of {self.named} returned", "for each: "
        line = f"{late} {call} within {_seconds(waited_s)} s{sized}; if it recurs, {each}{fix}"
        if factor is not None:
            line += f"; on slow hardware, raise {flag} (now {factor:g}), which multiplies every deadline"
        super().__init__(line)

    @property
    def named(self) -> str:
        """The actors as the line names them: "learner 0", "rollout actor 0, rollout actor 1 and learner 0"."""
        return " and ".join(filter(None, (", ".join(self.who[:-1]), self.who[-1])))


def get_within(
    refs: list, who: list[str], call: str, timeout_s: float, budget: str = "", fix: str = "",
    factor: float | None = None, flag: str = "--deadline-factor",
) -> list:  # fmt: skip
    """ray.get(refs) waiting factor x timeout_s seconds in all (refs[i]: the call on the actor named who[i];
    factor: --deadline-factor, named `flag`; None: timeout_s, a fixed deadline the flag does not multiply, whose
    ActorTimeout line does not offer it); an actor's death or error is raised as soon as it is found
    (RayActorError, RayTaskError), not after the deadline: get_each_within with one deadline for all.

    Raises ActorTimeout naming every actor whose call had not returned by the deadline."""
    return get_each_within(refs, who, call, [(timeout_s, budget)] * len(refs), fix, factor, flag)


def get_each_within(
    refs: list, who: list[str], call: str, deadlines: list[tuple[float, str]], fix: str = "",
    factor: float | None = None, flag: str = "--deadline-factor", tolerate: tuple = (),
) -> list:  # fmt: skip
    """ray.get(refs), all waited for together, refs[i] (the call on the actor named who[i]) for its own deadline
    (deadlines[i]: seconds, how they were sized) x factor (--deadline-factor, named `flag`; None: not multiplied,
    the ActorTimeout line does not offer it), every deadline counted from this call (the calls run at once, each
    on its actor). An actor's death or error is raised as soon as it is found (RayActorError, RayTaskError), not
    after a deadline; one of a type in `tolerate` (an actor's death: RayActorError) is returned in its result's
    place instead, the others still waited for.

    Each call keeps its own deadline rather than all waiting for the longest: a hung actor with nothing queued
    before its call is named at its own deadline, not at that of an actor with chunks queued ahead of its call
    (at least ROLLOUT_MIN_S more). When the first pending call passes its deadline, ActorTimeout names it with every other
    pending call of the same deadline (seconds: late at the same moment; late_calls); those of a longer one are not
    late yet.

    Raises ActorTimeout naming those actors, the seconds and how each was sized (late_budget)."""
    waits = [s if factor is None else factor * s for s, _ in deadlines]
    t0 = time.monotonic()
    index = {ref: i for i, ref in enumerate(refs)}
    out: list = [None] * len(refs)
    pending = list(refs)
    while pending:
        first = min(waits[index[r]] for r in pending)
        ready, pending = ray.wait(pending, num_returns=1, timeout=max(0.0, t0 + first - time.monotonic()))
        if not ready:
            late = late_calls([index[r] for r in pending], waits)
            budget = late_budget([who[i] for i in late], [deadlines[i][1] for i in late])
            raise ActorTimeout([who[i] for i in late], call, waits[late[0]], budget, fix, factor, flag)
        try:
            out[index[ready[0]]] = ray.get(ready[0])
        except tolerate as e:
            out[index[ready[0]]] = e
    return out


def late_calls(pending: list[int], waits: list[float]) -> list[int]:
    """The indices, in order, of the calls in `pending` (indices into `waits`: each call's seconds, all counted
    from the same start) late first: those of the shortest wait among them (get_each_within)."""
    first = min(waits[i] for i in pending)
    return sorted(i for i in pending if waits[i] == first)


def late_budget(who: list[str], budgets: list[str]) -> str:
    """How the deadline of the late calls of the actors `who` was sized, for ActorTimeout's line: their budget
    when they share one, else each actor's ("rollout actor 0: 60 s + ...; rollout actor 1: 60 s + ... + the
    chunks queued on its actor before it (...)"): the same seconds may be sized differently (ROLLOUT_MIN_S)."""
    if len(set(budgets)) == 1:
        return budgets[0]
    return "; ".join(f"{w}: {b}" for w, b in zip(who, budgets))


def lost_line(lost: dict[int, str | None]) -> str:
    """ "learner 1 was lost", "learners 0 and 2 (no answer within 30 s) were lost" of lost_learners' answer."""
    named = [f"{i}" if why is None else f"{i} ({why})" for i, why in lost.items()]
    if len(named) == 1:
        return f"learner {named[0]} was lost"
    return f"learners {', '.join(named[:-1])} and {named[-1]} were lost"


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
        self.weight_bytes = 0  # of the learner's state dict, what a weight sync moves (read at start)

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

    def wait_for(
        self, refs: list, who: list[str], call: str, timeout_s: float, budget: str = "", fix: str = ""
    ) -> list:
        """get_within with the run's --deadline-factor (named as `option` names it)."""
        return self.wait_each(refs, who, call, [(timeout_s, budget)] * len(refs), fix)

    def wait_each(
        self, refs: list, who: list[str], call: str, deadlines: list[tuple[float, str]], fix: str = "",
        tolerate: tuple = (),
    ) -> list:  # fmt: skip
        """get_each_within with the run's --deadline-factor (named as `option` names it)."""
        factor, flag = self.cfg.layout.deadline_factor, self.option("deadline_factor")
        return get_each_within(refs, who, call, deadlines, fix, factor, flag, tolerate)

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
        missing resource); ActorTimeout naming the actors not started within START_S + read_deadline_s of
        --init-from's bytes (its commit marker's sizes; twice, of a remote one); the actors' errors
        (ray.exceptions.RayActorError) as they are."""
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
        nbytes, remote = checkpoint_bytes(init), is_remote(init)
        wait_s = START_S + read_deadline_s(nbytes, remote)
        budget = f"{START_S:g} s to start + {read_budget(nbytes, remote)} of {self.option('init_from')}"
        fix = f"check that its node starts Ray workers (its raylet's log) and reads {init} (a hung mount)"
        learner_names = [f"learner {r}" for r in range(t.learner_workers)]
        self.learners = [
            LearnerActor.options(**self._options(r, t.cpus_per_learner)).remote(
                init, self.cfg, r, t.learner_workers, device, threads(t.cpus_per_learner)
            )
            for r in range(t.learner_workers)
        ]
        if t.learner_workers > 1:
            [(addr, port)] = self.wait_for([self.learners[0].address.remote()], learner_names[:1],
                                           "Learner.address (its start)", wait_s, budget, fix)  # fmt: skip
            refs = [lr.init_group.remote(addr, port) for lr in self.learners]
            self.wait_for(
                refs, learner_names, "Learner.init_group (its start, the DDP rendezvous)", wait_s, budget, fix
            )
        self.rollouts = [
            RolloutActor.options(
                **self._options(t.learner_workers + i, t.cpus_per_rollout, max_restarts=t.max_restarts,
                                max_task_retries=0)
            ).remote(init, self.tasks, i, device, threads(t.cpus_per_rollout), self.cfg.rollout.max_slots)
            for i in range(t.rollout_workers)
        ]  # fmt: skip
        refs = [w.info.remote() for w in self.rollouts] + [lr.weight_bytes.remote() for lr in self.learners]
        names = [f"rollout actor {i}" for i in range(len(self.rollouts))] + learner_names
        self.weight_bytes = self.wait_for(refs, names, "its start", wait_s, budget, fix)[len(self.rollouts)]
        if t.weight_sync == "collective":
            create_collective_group(self.learners[0], self.rollouts, self.backend, self.group_name)

    def rebuild_collective_group(self, deadlines: list[tuple[float, str]], fix: str = "") -> None:
        """Declare the broadcast group again with the current actor processes (after a rollout actor
        restarted): every member leaves the old group, the new one has the next generation's name. Every
        actor must be alive (a restarting one: ActorUnavailableError, for the caller to retry).

        Raises ActorTimeout naming the members that did not leave within their deadline x --deadline-factor
        (wait_each; deadlines[i]: rollout actor i's, seconds and how sized: sync_deadline; learner 0's the
        longest of them)."""
        members = [self.learners[0], *self.rollouts]
        who = ["learner 0", *(f"rollout actor {i}" for i in range(len(self.rollouts)))]
        refs = [a.leave_collective.remote(self.group_name) for a in members]
        call = "leave_collective (the broadcast group's rebuild)"
        self.wait_each(refs, who, call, [max(deadlines), *deadlines], fix)
        forget_group(self.group_name)
        self.generation += 1
        create_collective_group(self.learners[0], self.rollouts, self.backend, self.group_name)

    def lost_learners(self) -> dict[int, str | None]:
        """{index: None (dead) or "no answer within PING_S s"} of every learner that is dead or does not answer a
        ping (Learner.pid, all sent at once, waited for PING_S in all); {} when every learner answers: tells a
        learner's own error from the one its DDP peers raise when it is lost."""
        refs = [lr.pid.remote() for lr in self.learners]
        ready, _ = ray.wait(refs, num_returns=len(refs), timeout=PING_S)
        lost: dict[int, str | None] = {}
        for i, ref in enumerate(refs):
            if ref not in ready:
                lost[i] = f"no answer within {PING_S:g} s"
                continue
            try:
                ray.get(ref)
            except (ray.exceptions.RayActorError, ray.exceptions.ActorUnavailableError):
                lost[i] = None
        return lost

    def name_of(self, actor_id: str | None) -> str:
        """ "learner i" or "rollout actor i" of the actor whose id is `actor_id` (hex, as Ray's actor errors
        carry it), "an actor of the run" for any other."""
        for role, actors in (("learner", self.learners), ("rollout actor", self.rollouts)):
            for i, a in enumerate(actors):
                if a._actor_id.hex() == actor_id:
                    return f"{role} {i}"
        return "an actor of the run"

    def learner_results(self, refs: list, call: str, deadline: tuple[float, str], fix: str) -> list:
        """ray.get of one call on each learner (refs[i]: learners[i]'s, `call`: what it is, "Learner.step (the
        update of step 3)") that does not wait out a collective: once a learner's call raised, its DDP peers wait
        in the group's all-reduce or barrier for it until the backend's timeout (gloo's: 30 minutes), so the
        others are waited for PEER_GRACE_S more only, within which a lost learner's call fails (RayActorError),
        telling a learner that raised on its own from the peer of a lost one. Until one raises, the calls are
        waited for `deadline` (seconds, how they were sized: step_deadline, save_deadline) x --deadline-factor in
        all, as get_within. The caller stops the group, killing the waiting peers.

        Raises:
            RayActorError: a learner died (the first found).
            LearnerRaised: learner i's call raised (the first to), no learner died.
            ActorTimeout: no learner raised or died, and these did not return within the deadline (`fix`: what
                to check when it recurs).
        """
        factor, flag = self.cfg.layout.deadline_factor, self.option("deadline_factor")
        index = {ref: i for i, ref in enumerate(refs)}
        waited_s = factor * deadline[0]
        pending, raised, until = list(refs), None, time.monotonic() + waited_s
        while pending:
            ready, pending = ray.wait(pending, num_returns=1, timeout=max(0.0, until - time.monotonic()))
            if not ready and raised is None:  # hung: no learner raised, the late ones alive
                late = [f"learner {i}" for i in sorted(index[r] for r in pending)]
                raise ActorTimeout(late, call, waited_s, deadline[1], fix, factor, flag)
            if not ready:  # the peers of the learner that raised, waiting for it in a collective
                break
            try:
                ray.get(ready[0])
            except RayTaskError as e:
                if raised is None:
                    raised, until = LearnerRaised(index[ready[0]], e), time.monotonic() + PEER_GRACE_S
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


def checkpoint_bytes(checkpoint: str) -> int:
    """The bytes of the files the commit marker of `checkpoint` (a local directory or a remote URI) lists: one small
    read; 0 when it cannot be read (the actors that read the checkpoint raise their own error)."""
    try:
        return committed_bytes(commit_of(checkpoint))
    except (OSError, ValueError):
        return 0


def threads(cpus: float) -> int:
    """torch intra-op threads of an actor that reserved `cpus` CPUs (at least 1)."""
    return max(1, int(cpus))


def _summed(bundles: list[dict]) -> dict:
    """{resource: its sum over `bundles`}."""
    return {k: sum(b.get(k, 0) for b in bundles) for k in {k for b in bundles for k in b}}


def _seconds(s: float) -> str:
    """Seconds as a line reads them: 3 significant digits ("61.2"), whole ones from 1,000 ("1,800")."""
    return f"{s:.3g}" if s < 999.5 else f"{s:,.0f}"  # 999.6 s reads "1,000", not "1e+03"
