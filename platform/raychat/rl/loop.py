"""`raychat rl`: the RL loop -- rollout actors -> rewards -> advantages -> learner step -> weight sync.

Topology: one placement group (PACK) with W learner bundles then R rollout bundles (sizes from flags).
Synchronous mode (default, on-policy): rollouts of step s use policy version s exactly.
Asynchronous mode (--mode async --max-staleness k): the rollout batches of the next k steps are in flight
while the learner trains, so a sample trained at step s came from version v >= s - k; staleness s - v is
recorded per sample and the loss uses the clipped importance ratio against the behavior log-probs.

Prompts: step s takes prompts s*P .. s*P+P-1 of a seeded permutation of the training split (so a resumed run
continues with the same prompts); a chunk's sampling seed derives from (seed, step, chunk), so a re-issued
chunk samples the same completions under the same weights.

Per step (one JSON line in OUT/RUN_NAME/metrics.jsonl, and raychat_rl_* gauges through RLMetrics):
reward_mean, pass_at_1 (of the rollouts), response_len_mean (completion tokens), rollout_tokens_per_s
(completion tokens / the slowest chunk's generation seconds), learner_step_s, learner_wait_s (the driver
waiting for rollouts between learner steps), learner_wait_frac (wait / (wait + step + sync), and cumulative
in the summary), staleness_mean/max, sync_time_s (put + slowest actor's fetch+load), loss, grad_norm,
normalization, restarts. Every --eval-every steps: pass@k, k = 1..--eval-samples, on held-out prompts.

Faults: rollout actors have max_restarts; a chunk whose actor died is re-issued (after the restarted actor is
re-synced to the current weights, or to another live actor). Checkpoints (model + every rank's optimizer
state) go to OUT/RUN_NAME/checkpoint_<step> via a temporary directory renamed when complete; a run started
again with the same --out and --run-name resumes from the newest one.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import sys
import time
from collections import deque
from pathlib import Path

import numpy as np
import ray
from ray.exceptions import ActorUnavailableError, RayActorError
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from raychat.checkpoint import latest_checkpoint
from raychat.config import RLConfig, add_flags, from_args, to_dict, to_yaml
from raychat.metrics import RLMetrics
from raychat.rl.learner import LearnerActor
from raychat.rl.objective import group_advantages, pass_at_k
from raychat.rl.rollout import RolloutActor
from raychat.rl.weights import check_acks, create_collective_group


def build_tasks(cfg: RLConfig) -> dict:
    """{"train": Task, "test": Task} for cfg.task.task: training prompts from the train split (seeded by --seed),
    held-out prompts from the test split (a disjoint set of problems)."""
    if cfg.task.task == "calculator":
        from raychat.tasks import Calculator

        return {
            "train": Calculator(
                "train", size=cfg.task.task_examples, seed=cfg.run.seed, max_operand=cfg.task.max_operand
            ),
            # the held-out set is the same for every --seed (seed 0), so runs compare on the same prompts
            "test": Calculator("test", size=cfg.eval.eval_examples, seed=0, max_operand=cfg.task.max_operand),
        }
    raise ValueError(f"task must be one of ['calculator'], got {cfg.task.task!r}")


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


class RLRun:
    """One RL run. `RLRun(cfg).run()` -> summary dict; see the module docstring.

    on_submitted(run, step, chunks): optional hook called after a step's rollout chunks are submitted
    (tests use it to kill an actor mid-run).
    """

    def __init__(self, cfg: RLConfig, on_submitted=None, log=print):
        if not cfg.run.init_from:
            raise ValueError("--checkpoint (a chat checkpoint directory) is required")
        self.cfg, self.on_submitted, self.log = cfg, on_submitted, log
        self.run_dir = Path(cfg.run.storage_path) / cfg.run.run_name
        self.tasks = build_tasks(cfg)
        self.order = np.random.default_rng(cfg.run.seed).permutation(len(self.tasks["train"]))
        self.metrics = RLMetrics(cfg.run.run_name)
        self.restarts = 0
        self.version = 0
        self.weights_refs: list | None = None
        self.pending_acks: deque = deque()

    # ---- topology --------------------------------------------------------------------------------
    def start(self) -> None:
        cfg = self.cfg
        gpu = 1 if cfg.topology.use_gpu else 0
        bundles = [
            {"CPU": cfg.topology.cpus_per_learner, **({"GPU": 1} if gpu else {})}
        ] * cfg.topology.learner_workers
        bundles += [
            {"CPU": cfg.topology.cpus_per_rollout, **({"GPU": 1} if gpu else {})}
        ] * cfg.topology.rollout_workers
        self.pg = placement_group(bundles, strategy="PACK")
        ray.get(self.pg.ready(), timeout=120)
        device = "cuda" if gpu else "cpu"
        threads = lambda c: max(1, int(c))  # noqa: E731

        def opts(i, cpus, **kw):
            strategy = PlacementGroupSchedulingStrategy(self.pg, placement_group_bundle_index=i)
            return {"num_cpus": cpus, "num_gpus": gpu, "scheduling_strategy": strategy, **kw}

        self.learners = [
            LearnerActor.options(**opts(r, cfg.topology.cpus_per_learner)).remote(
                cfg.run.init_from,
                cfg,
                r,
                cfg.topology.learner_workers,
                device,
                threads(cfg.topology.cpus_per_learner),
            )
            for r in range(cfg.topology.learner_workers)
        ]
        if cfg.topology.learner_workers > 1:
            addr, port = ray.get(self.learners[0].address.remote())
            ray.get([lr.init_group.remote(addr, port) for lr in self.learners])
        self.rollouts = [
            RolloutActor.options(
                **opts(cfg.topology.learner_workers + i, cfg.topology.cpus_per_rollout, max_restarts=cfg.topology.max_restarts,
                       max_task_retries=0)
            ).remote(cfg.run.init_from, self.tasks, i, device, threads(cfg.topology.cpus_per_rollout))
            for i in range(cfg.topology.rollout_workers)
        ]  # fmt: skip
        ray.get([w.info.remote() for w in self.rollouts] + [lr.pid.remote() for lr in self.learners])
        if cfg.topology.weight_sync == "collective":
            create_collective_group(
                self.learners[0], self.rollouts, "nccl" if gpu else "gloo", self.group_name
            )

    @property
    def group_name(self) -> str:
        return f"raychat-rl-{self.cfg.run.run_name}"

    def stop(self) -> None:
        for a in getattr(self, "rollouts", []) + getattr(self, "learners", []):
            ray.kill(a, no_restart=True)
        if getattr(self, "pg", None) is not None:
            remove_placement_group(self.pg)
            self.pg = None

    # ---- weights ---------------------------------------------------------------------------------
    def sync(self, block: bool = True) -> dict | None:
        """Publish the learner's weights as self.version to every rollout actor (module docstring)."""
        t0 = time.perf_counter()
        if self.cfg.topology.weight_sync == "collective":
            sent = self.learners[0].broadcast.remote(self.group_name)
            acks = [w.receive_broadcast.remote(self.group_name, self.version) for w in self.rollouts]
            s = ray.get(sent)
            return check_acks(ray.get(acks), s["hash"], self.version, s["put_s"], time.perf_counter() - t0)
        refs, digest, put_s = ray.get(self.learners[0].publish.remote())
        self.weights_refs, self.weights_digest = refs, digest
        acks = [w.set_weights.remote(refs, self.version) for w in self.rollouts]
        if not block:  # async: acks arrive after the rollout chunks queued before them
            self.pending_acks.append((acks, digest, self.version, put_s, t0))
            return None
        return check_acks(self._get_acks(acks), digest, self.version, put_s, time.perf_counter() - t0)

    def _get_acks(self, acks: list) -> list[dict]:
        """Acks of set_weights; an actor that died meanwhile is waited for (restart) and re-synced."""
        out = []
        for w, ref in enumerate(acks):
            try:
                out.append(ray.get(ref))
            except (RayActorError, ActorUnavailableError):
                self.restarts += 1
                self.log(f"rollout actor {w} died during weight sync; re-syncing after its restart")
                if not self._resync(w):
                    raise RuntimeError(f"rollout actor {w} is dead (max_restarts exhausted)") from None
                out.append(ray.get(self.rollouts[w].info.remote()) | {"apply_s": 0.0})
        return out

    def _drain_acks(self) -> dict | None:
        last = None
        while self.pending_acks:
            acks, digest, version, put_s, t0 = self.pending_acks.popleft()
            try:
                last = check_acks(ray.get(acks), digest, version, put_s, time.perf_counter() - t0)
            except (RayActorError, ActorUnavailableError):
                continue  # an actor restarted; it is re-synced when its chunk is re-issued
        return last

    # ---- rollouts --------------------------------------------------------------------------------
    def prompts_for(self, step: int) -> list[int]:
        P, n = self.cfg.rollout.prompts_per_step, len(self.order)
        return [int(self.order[(step * P + i) % n]) for i in range(P)]

    def submit(self, step: int) -> list[dict]:
        cfg = self.cfg
        chunks = []
        for c, idx in enumerate(split_even(self.prompts_for(step), len(self.rollouts))):
            w = c % len(self.rollouts)
            chunks.append(
                {"worker": w, "indices": idx, "seed": chunk_seed(cfg.run.seed, step, c), "ref": None}
            )
            self._issue(chunks[-1])
        if self.on_submitted:
            self.on_submitted(self, step, chunks)
        return chunks

    def _issue(self, chunk: dict) -> None:
        cfg = self.cfg
        chunk["ref"] = self.rollouts[chunk["worker"]].rollout.remote(
            chunk["indices"], cfg.rollout.samples_per_prompt, cfg.rollout.max_tokens, cfg.rollout.temperature, chunk["seed"],
            "train", cfg.asynchrony.mode == "async",
        )  # fmt: skip

    def collect(self, chunks: list[dict]) -> list[dict]:
        """Results of every chunk; a chunk whose actor died is re-issued (see module docstring)."""
        out = []
        for chunk in chunks:
            for attempt in range(self.cfg.topology.max_restarts + 2):
                try:
                    out.append(ray.get(chunk["ref"]))
                    break
                except (RayActorError, ActorUnavailableError) as e:
                    self.restarts += 1
                    self.log(
                        f"rollout actor {chunk['worker']} died ({type(e).__name__}); re-issuing its prompts"
                    )
                    self._recover(chunk, attempt)
            else:
                raise RuntimeError(
                    f"prompts {chunk['indices']} failed after {self.cfg.topology.max_restarts + 2} tries"
                )
        return out

    def _recover(self, chunk: dict, attempt: int) -> None:
        """Re-sync the (restarting) actor to the current weights and re-issue the chunk; after a failed
        re-sync (the actor is out of restarts) move the chunk to the next actor."""
        for k in range(len(self.rollouts)):
            w = (chunk["worker"] + k + (attempt > 0)) % len(self.rollouts)
            if self.cfg.topology.weight_sync == "collective":
                raise NotImplementedError("re-syncing a restarted actor needs --weight-sync object_store")
            if self._resync(w):
                chunk["worker"] = w
                self._issue(chunk)
                return
        raise RuntimeError("no rollout actor is alive")

    def _resync(self, w: int, timeout_s: float = 120.0) -> bool:
        """Load the current weights into rollout actor w, waiting while it restarts; False if it is dead."""
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                ack = ray.get(self.rollouts[w].set_weights.remote(self.weights_refs, self.version))
                return ack["version"] == self.version and ack["hash"] == self.weights_digest
            except ActorUnavailableError:
                if time.monotonic() > deadline:
                    return False
                time.sleep(0.2)
            except RayActorError:
                return False

    # ---- evaluation ------------------------------------------------------------------------------
    def evaluate(self) -> dict:
        """pass@k (k = 1..eval_samples) over the held-out prompts (test split)."""
        cfg = self.cfg
        n = 1 if cfg.eval.eval_temperature == 0 else cfg.eval.eval_samples
        idx = list(range(len(self.tasks["test"])))
        parts = split_even(idx, len(self.rollouts))
        refs = [
            self.rollouts[i].evaluate.remote(
                p, n, cfg.rollout.max_tokens, cfg.eval.eval_temperature, chunk_seed(cfg.run.seed, -1, i)
            )
            for i, p in enumerate(parts)
        ]
        correct = [c for part in ray.get(refs) for c in part]
        return {f"pass@{k}": float(np.mean([pass_at_k(n, c, k) for c in correct])) for k in range(1, n + 1)}

    # ---- checkpoints -----------------------------------------------------------------------------
    def save(self, step: int, extra: dict) -> Path:
        final = self.run_dir / f"checkpoint_{step:06d}"
        tmp = self.run_dir / f".tmp_checkpoint_{step:06d}"
        shutil.rmtree(tmp, ignore_errors=True)
        ray.get(
            [
                lr.save.remote(str(tmp), step, {"rl_config": to_dict(self.cfg), **extra})
                for lr in self.learners
            ]
        )
        shutil.rmtree(final, ignore_errors=True)
        os.replace(tmp, final)
        done = sorted(self.run_dir.glob("checkpoint_*"))
        for old in done[: -self.cfg.eval.keep_checkpoints]:
            shutil.rmtree(old, ignore_errors=True)
        return final

    def resume(self) -> int:
        ckpt = latest_checkpoint(self.run_dir)
        if ckpt is None:
            return 0
        states = ray.get([lr.restore.remote(str(ckpt)) for lr in self.learners])
        self.version = int(states[0]["version"])
        self.log(f"resumed from {ckpt} at step {states[0]['step']} (version {self.version})")
        return int(states[0]["step"])

    # ---- the loop --------------------------------------------------------------------------------
    def learner_step(self, results: list[dict], step: int) -> tuple[dict, dict]:
        cfg = self.cfg
        samples = [s for r in results for s in r["samples"]]
        samples.sort(key=lambda s: (self.prompts_for(step).index(s["prompt_index"]), s["sample_index"]))
        rewards = [s["reward"] for s in samples]
        for s, a in zip(
            samples, group_advantages(rewards, cfg.rollout.samples_per_prompt, cfg.objective.scale_by_std)
        ):
            s["advantage"] = a
        if cfg.asynchrony.mode == "sync":
            for s in samples:
                s.pop("behavior_logprobs", None)
        shards = split_even(samples, len(self.learners))
        shards += [[] for _ in range(len(self.learners) - len(shards))]
        stats = ray.get([lr.step.remote(sh) for lr, sh in zip(self.learners, shards)])[0]
        staleness = [self.version - s["version"] for s in samples]
        tokens = sum(r["completion_tokens"] for r in results)
        rollout = {
            "reward_mean": float(np.mean(rewards)),
            "pass_at_1": float(np.mean([r > 0 for r in rewards])),
            "response_len_mean": float(np.mean([s["completion_tokens"] for s in samples])),
            "rollout_tokens_per_s": tokens / max(max(r["seconds"] for r in results), 1e-9),
            "rollout_tokens": tokens,
            "staleness_mean": float(np.mean(staleness)),
            "staleness_max": int(max(staleness)),
            "num_samples": len(samples),
            "prompts": sorted({s["prompt_index"] for s in samples}),
        }
        return stats, rollout

    def run(self) -> dict:
        cfg = self.cfg
        self.run_dir.mkdir(parents=True, exist_ok=True)
        (self.run_dir / "config.yaml").write_text(to_yaml(cfg, "rl"))
        self.start()
        try:
            return self._loop()
        finally:
            self.stop()

    def _loop(self) -> dict:
        cfg = self.cfg
        start = self.resume()
        sync = self.sync()
        self.log(f"rl: {cfg.asynchrony.mode} mode, normalization={cfg.objective.normalization}, version {self.version}, "
                 f"initial sync {sync['sync_time_s']:.3f}s hash {sync['hash']}")  # fmt: skip
        evals = []
        if start == 0:
            evals.append({"step": 0, **self.evaluate()})
            self.log(f"eval step 0: {_fmt(evals[-1])}")
        log_path = self.run_dir / "metrics.jsonl"
        t_loop = time.perf_counter()
        total_wait = total_busy = 0.0
        inflight: deque = deque()
        ahead = cfg.asynchrony.max_staleness if cfg.asynchrony.mode == "async" else 0
        next_submit = start
        for step in range(start, cfg.rollout.steps):
            while next_submit <= min(step + ahead, cfg.rollout.steps - 1):
                inflight.append(self.submit(next_submit))
                next_submit += 1
            t0 = time.perf_counter()
            results = self.collect(inflight.popleft())
            wait_s = time.perf_counter() - t0
            last_ack = self._drain_acks() if cfg.asynchrony.mode == "async" else None
            stats, rollout = self.learner_step(results, step)
            self.version = stats["version"]
            t1 = time.perf_counter()
            sync = self.sync(block=cfg.asynchrony.mode == "sync") or last_ack
            sync_wall = time.perf_counter() - t1
            total_wait += wait_s
            total_busy += stats["step_s"] + sync_wall
            line = {
                "step": step + 1, "version": self.version, "mode": cfg.asynchrony.mode, **rollout, **stats,
                "learner_step_s": stats["step_s"], "learner_wait_s": wait_s,
                "learner_wait_frac": wait_s / max(wait_s + stats["step_s"] + sync_wall, 1e-9),
                "sync_time_s": sync["sync_time_s"] if sync else None, "restarts": self.restarts,
            }  # fmt: skip
            self.metrics.record(
                step + 1, line["reward_mean"], pass_at_1=line["pass_at_1"], staleness=line["staleness_mean"],
                sync_time_s=line["sync_time_s"], rollout_tokens_per_s=line["rollout_tokens_per_s"],
                learner_wait_frac=line["learner_wait_frac"],
            )  # fmt: skip
            if (step + 1) % cfg.eval.eval_every == 0 or step + 1 == cfg.rollout.steps:
                evals.append({"step": step + 1, **self.evaluate()})
                line["eval"] = evals[-1]
            self.log(_fmt({k: line[k] for k in _LOG_KEYS if line.get(k) is not None}))
            if "eval" in line:
                self.log(f"eval step {step + 1}: {_fmt(evals[-1])}")
            with open(log_path, "a") as f:
                f.write(json.dumps(line) + "\n")
            if (step + 1) % cfg.eval.checkpoint_every == 0 or step + 1 == cfg.rollout.steps:
                self.save(step + 1, {"eval": evals[-1] if evals else None})
        self._drain_acks()
        wall = time.perf_counter() - t_loop
        return {
            "steps": cfg.rollout.steps, "start_step": start, "version": self.version, "restarts": self.restarts,
            "evals": evals, "learner_wait_frac": total_wait / max(total_wait + total_busy, 1e-9),
            "wall_s": wall, "run_dir": str(self.run_dir),
        }  # fmt: skip


_LOG_KEYS = (
    "step", "reward_mean", "response_len_mean", "loss", "grad_norm", "rollout_tokens_per_s", "learner_step_s",
    "learner_wait_frac", "sync_time_s", "staleness_mean", "restarts",
)  # fmt: skip


def _fmt(d: dict) -> str:
    return " ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in d.items())


# ---- CLI ------------------------------------------------------------------------------------------
def add_cli(subparsers) -> None:
    parser = subparsers.add_parser(
        "rl",
        help="reinforcement learning of a chat checkpoint on a task (rollout actors + learner on Ray)",
        description="GRPO-style RL: rollout actors sample --samples-per-prompt completions per prompt with tool "
        "use, Task.reward scores them, advantages are reward minus the group mean, the learner takes a "
        "policy-gradient step over sampled tokens only, and the new weights are published to every rollout "
        "actor. Writes OUT/RUN_NAME/{config.yaml,metrics.jsonl,checkpoint_<step>}; running again with the "
        "same --out and --run-name resumes. Example: raychat rl --checkpoint runs/sft/checkpoint_000400 "
        "--task calculator --steps 50",
    )
    add_flags(parser, RLConfig, preset="none", preset_aliases=("--config",))
    parser.add_argument("--address", default=None, help="Ray cluster address (default: start a local one)")
    parser.set_defaults(func=_main)


def config_for(args) -> RLConfig:
    """The command's RLConfig: flags > --config/--preset (its rl section, or the whole file) > defaults."""
    return from_args(args, RLConfig, "rl", where="rl settings")


def _main(args) -> int:
    try:
        cfg = config_for(args)
        if not cfg.run.init_from:
            raise ValueError("--checkpoint (a chat checkpoint directory) is required")
        from raychat.checkpoint import read_meta

        read_meta(cfg.run.init_from)  # a clear error before any Ray cluster starts
    except (ValueError, FileNotFoundError) as e:
        print(f"raychat rl: {e}", file=sys.stderr)
        return 2
    started = not ray.is_initialized()
    if started:
        ray.init(address=args.address, include_dashboard=False)
    try:
        summary = RLRun(cfg).run()
    finally:
        if started:
            ray.shutdown()
    print(json.dumps({k: v for k, v in summary.items()}, default=str))
    return 0
