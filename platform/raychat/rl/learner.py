"""Learner: policy-gradient updates on rollout samples, data parallel over a group of Ray actors.

Each of the W learner actors holds a full model replica and its optimizers (raychat.train.optim:
Muon for hidden matrices, AdamW for the rest) and gets a contiguous shard of the step's samples. With W > 1
they form a torch.distributed group (gloo on CPU, nccl on GPU) and train through DistributedDataParallel.
One step:
  1. the step's sampled-token count N and sequence count S are summed over micro-batches and all-reduced;
  2. every micro-batch backpropagates W x its share of the normalized step loss (raychat.rl.objective);
     DDP averages the gradients over the W ranks in the last micro-batch's backward (no_sync before), so
     the gradient is exactly d(step loss), the sum of the ranks' shares;
  3. the trainer's optimizer step (raychat.train.step: clip, step, clear), and the version increases by one.
Checkpoints: the trainer's Checkpointer (rank 0 the model, meta and the one optimizer state), uploaded by each
rank into the run's CheckpointManager, which the driver commits (raychat.rl.loop).
"""

from __future__ import annotations

import contextlib
import os
import socket
import tempfile
import time

import ray
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from raychat.checkpoint import load_model
from raychat.checkpoint_manager import CheckpointManager, resolve_checkpoint
from raychat.config import RLConfig, to_dict
from raychat.rl.objective import collate, normalized_loss, per_token_loss, token_logprobs
from raychat.rl.weights import collective_broadcast, leave_collective_group, publish, weights_hash
from raychat.train.checkpointer import Checkpointer
from raychat.train.optim import build_optimizers
from raychat.train.step import optimizer_step


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("", 0))
        return s.getsockname()[1]


class Learner:
    """One data-parallel rank. Usable in-process (tests, W = 1) or as a Ray actor (`LearnerActor`).

    Args:
        checkpoint: chat checkpoint directory to start from.
        cfg: the run's RLConfig (optim, objective, rollout temperature).
        rank, world_size: this rank and the group size; world_size > 1 needs init_group() on every rank.
        device: "cpu" or "cuda" (nccl when world_size > 1).
    """

    def __init__(
        self, checkpoint: str, cfg: RLConfig, rank: int = 0, world_size: int = 1, device: str = "cpu",
        num_threads: int | None = None,
    ):  # fmt: skip
        if num_threads:
            torch.set_num_threads(int(num_threads))
        self.cfg, self.rank, self.world_size, self.device = cfg, rank, world_size, torch.device(device)
        model, self.tokenizer, _ = load_model(checkpoint, device=device)
        self.model = model.train()
        # one learner has nothing to shard Muon over; its torch.distributed group, if any, is the gloo
        # weight-broadcast group with the rollout actors (raychat.rl.weights), which must not carry it
        self.optimizers = build_optimizers(self.model, cfg.optim, shard=world_size > 1)
        self.checkpointer = Checkpointer("rl", to_dict(cfg), self.tokenizer)
        self.ddp: DistributedDataParallel | None = None
        self.version = 0

    def address(self) -> tuple[str, int]:
        """(node IP, free port) for rank 0's rendezvous."""
        return (ray.util.get_node_ip_address() if ray.is_initialized() else "127.0.0.1"), free_port()

    def init_group(self, master_addr: str, master_port: int) -> str:
        """Join the learners' torch.distributed group (call on every rank at once when world_size > 1).

        Returns the backend: "nccl" on GPU, "gloo" on CPU.
        """
        backend = "nccl" if self.device.type == "cuda" else "gloo"
        dist.init_process_group(
            backend,
            init_method=f"tcp://{master_addr}:{master_port}",
            rank=self.rank,
            world_size=self.world_size,
        )
        self.ddp = DistributedDataParallel(self.model, broadcast_buffers=False)
        return backend

    def _all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        if self.world_size > 1:
            dist.all_reduce(t, op=dist.ReduceOp.SUM)
        return t

    # ---- the update ----------------------------------------------------------------------------------
    def step(self, samples: list[dict]) -> dict:
        """One optimizer step on this rank's shard (each sample: tokens, mask, advantage, optional
        behavior_logprobs). Returns stats: loss (the step loss, summed over ranks), grad_norm (before
        clipping), num_tokens N, num_sequences S, ratio_mean, clip_frac, step_s, version (after the step),
        normalization."""
        t0 = time.perf_counter()
        cfg = self.cfg
        mb = cfg.objective.micro_batch_size
        batches = [collate(samples[i : i + mb]) for i in range(0, len(samples), mb)]
        counts = torch.tensor(
            [sum(int(b["loss_mask"].sum()) for b in batches), len(samples)],
            dtype=torch.int64,
            device=self.device,
        )
        num_tokens, num_sequences = (int(x) for x in self._all_reduce(counts))
        stats = torch.zeros(4, dtype=torch.float64, device=self.device)  # loss, ratio sum, clipped, tokens
        for p in self.model.parameters():
            p.grad = None
        for i, b in enumerate(batches):
            b = {k: v.to(self.device) for k, v in b.items()}
            sync = i == len(batches) - 1 or self.ddp is None
            with contextlib.nullcontext() if sync else self.ddp.no_sync():
                logits = (self.ddp or self.model)(b["input_ids"])
                logp = token_logprobs(logits, b["labels"], cfg.rollout.temperature)
                loss_tok, ratio = per_token_loss(
                    logp, b["advantages"], b.get("behavior_logprobs"), cfg.objective.clip_eps
                )
                loss = normalized_loss(
                    loss_tok, b["loss_mask"], cfg.objective.normalization, num_tokens, num_sequences,
                    cfg.denominator_length,
                )  # fmt: skip
                # DDP averages gradients over ranks; the step loss is their sum, so each rank scales by W
                (loss * self.world_size).backward()
            m = b["loss_mask"]
            clipped = ((ratio - 1).abs() > cfg.objective.clip_eps) & m
            stats += torch.tensor(
                [loss.item(), float(ratio[m].sum()), float(clipped.sum()), float(m.sum())],
                dtype=torch.float64, device=self.device,
            )  # fmt: skip
        self._all_reduce(stats)
        grad_norm = optimizer_step(
            self.model.parameters(), self.optimizers, cfg.optim.grad_clip, self.version + 1
        )
        self.version += 1
        loss_sum, ratio_sum, clipped, tokens = stats.tolist()
        return {
            "loss": loss_sum,
            "grad_norm": grad_norm,
            "num_tokens": num_tokens,
            "num_sequences": num_sequences,
            "ratio_mean": ratio_sum / max(tokens, 1),
            "clip_frac": clipped / max(tokens, 1),
            "step_s": time.perf_counter() - t0,
            "version": self.version,
            "normalization": cfg.objective.normalization,
        }

    # ---- weights out ---------------------------------------------------------------------------------
    def publish(self) -> tuple[list, str, float]:
        """Object-store sync: ([ObjectRef of the CPU state dict], weights hash, put seconds). Rank 0 only."""
        return publish(self.model)

    def broadcast(self, group_name: str) -> dict:
        """Collective sync, sender side (rank 0 of the group)."""
        seconds = collective_broadcast(self.model, group_name)
        return {"hash": weights_hash(self.model.state_dict()), "put_s": seconds}

    def leave_collective(self, group_name: str) -> None:
        """Leave the broadcast group (raychat.rl.weights.leave_collective_group), so it can be rebuilt."""
        leave_collective_group(group_name)

    def weights_hash(self) -> str:
        return weights_hash(self.model.state_dict())

    # ---- checkpoints ---------------------------------------------------------------------------------
    def save(self, checkpoints: CheckpointManager, step: int, metrics: dict | None = None) -> dict[str, dict]:
        """Upload this rank's part of checkpoint `step` (the trainer's Checkpointer: rank 0 the model, meta
        (stage "rl", version) and the optimizer state, the same on every DDP rank; every rank its RNG state
        and the policy version); returns its files for the driver's commit."""
        with tempfile.TemporaryDirectory() as tmp:
            self.checkpointer.write(
                tmp, self.rank, self.world_size, step, self.model, self.optimizers,
                {"version": self.version}, metrics=metrics, version=self.version,
            )  # fmt: skip
            return checkpoints.upload(tmp, step)

    def restore(self, checkpoint: str) -> dict:
        """Load weights, optimizer and RNG state of this rank from a committed RL checkpoint (a local path or
        URI, fetched when remote); returns the data state."""
        directory = resolve_checkpoint(checkpoint)
        model, _, _ = load_model(directory, device=self.device)
        self.model.load_state_dict(model.state_dict())
        state = self.checkpointer.restore(directory, self.rank, self.optimizers)[self.rank]
        self.version = int(state["version"])
        return state

    def pid(self) -> int:
        return os.getpid()


LearnerActor = ray.remote(Learner)
