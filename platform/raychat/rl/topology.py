"""Placement of an RL run: one placement group (PACK) of W learner bundles then R rollout bundles, and the
actors in them. Learners form a torch.distributed group when W > 1 (DDP); with --weight-sync collective,
learner rank 0 and the rollout actors form a ray.util.collective broadcast group."""

from __future__ import annotations

import ray
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from raychat.config import RLConfig
from raychat.rl.learner import LearnerActor
from raychat.rl.rollout import RolloutActor
from raychat.rl.weights import create_collective_group


class Topology:
    """The learner and rollout actors of one run: `start()`, then `.learners` and `.rollouts`; `stop()`."""

    def __init__(self, cfg: RLConfig, tasks: dict):
        self.cfg, self.tasks = cfg, tasks
        self.pg = None
        self.learners: list = []
        self.rollouts: list = []

    @property
    def group_name(self) -> str:
        return f"raychat-rl-{self.cfg.run.run_name}"

    @property
    def gpu(self) -> int:
        return 1 if self.cfg.topology.use_gpu else 0

    def _options(self, bundle: int, cpus: float, **kw) -> dict:
        strategy = PlacementGroupSchedulingStrategy(self.pg, placement_group_bundle_index=bundle)
        return {"num_cpus": cpus, "num_gpus": self.gpu, "scheduling_strategy": strategy, **kw}

    def start(self) -> None:
        t, gpu = self.cfg.topology, self.gpu
        bundles = [{"CPU": t.cpus_per_learner, **({"GPU": 1} if gpu else {})}] * t.learner_workers
        bundles += [{"CPU": t.cpus_per_rollout, **({"GPU": 1} if gpu else {})}] * t.rollout_workers
        self.pg = placement_group(bundles, strategy="PACK")
        ray.get(self.pg.ready(), timeout=120)
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
            ).remote(init, self.tasks, i, device, threads(t.cpus_per_rollout))
            for i in range(t.rollout_workers)
        ]  # fmt: skip
        ray.get([w.info.remote() for w in self.rollouts] + [lr.pid.remote() for lr in self.learners])
        if t.weight_sync == "collective":
            create_collective_group(
                self.learners[0], self.rollouts, "nccl" if gpu else "gloo", self.group_name
            )

    def stop(self) -> None:
        for a in self.rollouts + self.learners:
            ray.kill(a, no_restart=True)
        if self.pg is not None:
            remove_placement_group(self.pg)
            self.pg = None


def threads(cpus: float) -> int:
    """torch intra-op threads of an actor that reserved `cpus` CPUs (at least 1)."""
    return max(1, int(cpus))
