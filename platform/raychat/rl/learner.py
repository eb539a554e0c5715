"""Learner: policy-gradient updates on rollout samples, data parallel over a group of Ray actors.

Each of the W learner actors holds a full model replica and its optimizers (raychat.train.optim:
Muon for hidden matrices, AdamW for the rest) and gets a contiguous shard of the step's samples. With W > 1
they form a torch.distributed group (gloo on CPU, nccl on GPU) and train through DistributedDataParallel.
The model runs like the Trainer's: FP8 Linear layers (--fp8), torch.compile (--compile), bf16 autocast on
CUDA. One step is the Trainer's (raychat.train.step):
  1. forward_backward with the policy-gradient loss component (raychat.rl.objective.PolicyGradientLoss): the
     step's sampled-token count N and sequence count S summed over micro-batches and ranks, every micro-batch
     backpropagating W x its share of the normalized step loss, DDP's gradient all-reduce in the last
     micro-batch's backward only, so the gradient is exactly d(step loss), the sum of the ranks' shares;
  2. optimizer_step (clip, step, clear), and the version increases by one.
Checkpoints: the trainer's Checkpointer (rank 0 the model, meta and the one optimizer state), uploaded by each
rank into the run's CheckpointManager, which the driver commits (raychat.rl.loop).
"""

from __future__ import annotations

import os
import tempfile
import time

import ray
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from raychat.checkpoint import document_masking, load_model
from raychat.checkpoint_manager import CheckpointManager, resolve_checkpoint
from raychat.config import RLConfig, to_dict
from raychat.ports import free_ports
from raychat.rl.objective import PolicyGradientLoss, collate
from raychat.rl.weights import collective_broadcast, leave_collective_group, publish, weights_hash
from raychat.train.checkpointer import Checkpointer
from raychat.train.fp8 import convert_to_fp8
from raychat.train.optim import build_optimizers
from raychat.train.step import autocast_for, forward_backward, optimizer_step


class Learner:
    """One data-parallel rank. Usable in-process (tests, W = 1) or as a Ray actor (`LearnerActor`).

    Args:
        checkpoint: chat checkpoint directory to start from.
        cfg: the run's RLConfig (model: fp8 / compile, optim, objective, rollout temperature).
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
        model, self.tokenizer, meta = load_model(checkpoint, device=device)
        self.model = model.train()
        if cfg.model.fp8:
            convert_to_fp8(self.model, cfg.model.fp8_recipe)
        # one learner has nothing to shard Muon over; its torch.distributed group, if any, is the gloo
        # weight-broadcast group with the rollout actors (raychat.rl.weights), which must not carry it
        self.optimizers = build_optimizers(self.model, cfg.optim, shard=world_size > 1)
        # what the step calls (compiled, and DDP-wrapped by init_group); self.model holds the weights
        self.train_model = torch.compile(self.model) if cfg.model.compile else self.model
        self.autocast = autocast_for(self.device)
        self.loss = PolicyGradientLoss(
            cfg.objective.normalization,
            cfg.rollout.temperature,
            cfg.objective.clip_eps,
            cfg.denominator_length,
        )
        # the model's setting, which RL's config has no option for: eval scores it as its training did
        extra = {"document_masking": document_masking(meta)}
        self.checkpointer = Checkpointer("rl", to_dict(cfg), self.tokenizer, extra)
        self.version = 0

    def address(self) -> tuple[str, int]:
        """(node IP, free port) for rank 0's rendezvous."""
        return (ray.util.get_node_ip_address() if ray.is_initialized() else "127.0.0.1"), free_ports(1)[0]

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
        self.train_model = DistributedDataParallel(self.train_model, broadcast_buffers=False)
        return backend

    # ---- the update ----------------------------------------------------------------------------------
    def step(self, samples: list[dict]) -> dict:
        """One optimizer step on this rank's shard (each sample: tokens, mask, advantage, optional
        behavior_logprobs). Returns stats: loss (the step loss, summed over ranks), grad_norm (before
        clipping), num_tokens N, num_sequences S, ratio_mean, clip_frac, entropy (the policy's before the update,
        at the rollout temperature, nats a sampled token: raychat.rl.objective.entropy_sum), step_s, version
        (after the step), normalization."""
        t0 = time.perf_counter()
        mb = self.cfg.objective.micro_batch_size
        micro = [
            {k: v.to(self.device) for k, v in collate(samples[i : i + mb]).items()}
            for i in range(0, len(samples), mb)
        ]
        sums = forward_backward(self.train_model, micro, self.loss, self.autocast, self.world_size)
        grad_norm = optimizer_step(
            self.model.parameters(), self.optimizers, self.cfg.optim.grad_clip, self.version + 1
        )
        self.version += 1
        num_tokens, num_sequences = sums.totals
        loss_sum, ratio_sum, clipped, tokens, entropy_sum = sums.stats
        return {
            "loss": loss_sum,
            "grad_norm": grad_norm,
            "num_tokens": num_tokens,
            "num_sequences": num_sequences,
            "ratio_mean": ratio_sum / max(tokens, 1),
            "clip_frac": clipped / max(tokens, 1),
            "entropy": entropy_sum / max(tokens, 1),
            "step_s": time.perf_counter() - t0,
            "version": self.version,
            "normalization": self.cfg.objective.normalization,
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

    def weight_bytes(self) -> int:
        """Bytes of the state dict a weight sync moves (its tensors' elements x their sizes): what the driver
        sizes the deadlines of a sync and a checkpoint save from (raychat.rl.actors.sync_deadline)."""
        return sum(t.numel() * t.element_size() for t in self.model.state_dict().values())

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
        URI, fetched when remote); returns the data state ({"version", "step"}). The checkpoint's world may
        have had fewer learners (--learner-workers may change on resume): the data state is the same on every
        rank, so rank 0's is read, and a rank the old world lacked keeps its own RNG."""
        directory = resolve_checkpoint(checkpoint)
        model, _, _ = load_model(directory, device=self.device)
        self.model.load_state_dict(model.state_dict())
        state = self.checkpointer.restore(directory, self.rank, self.optimizers)[0]
        self.version = int(state["version"])
        return state

    def pid(self) -> int:
        return os.getpid()


LearnerActor = ray.remote(Learner)
