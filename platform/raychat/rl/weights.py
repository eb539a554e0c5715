"""Weight sync from the learner to the rollout actors, and the weights hash that proves it happened.

Object store path (CPU default): the learner's rank 0 calls `publish(state_dict)` -- ONE `ray.put` of the
whole CPU state dict -- and every rollout actor receives the same ObjectRef (wrapped in a list so the actor
fetches it itself and the fetch is timed) in one `set_weights` call. Never one remote call per parameter.

Collective path (GPUs): the learner's rank 0 and the rollout actors form a `ray.util.collective` group
(rank 0 = learner, ranks 1..R = rollout actors) and every tensor of the state dict, in `state_dict()` order,
is broadcast from rank 0 in place. Backend "nccl" on GPUs; "gloo" (torch.distributed under the hood) works on
CPU only when the learner process has no torch.distributed group of its own (one learner worker). A restarted
rollout actor cannot rejoin a group: every member leaves it and the group is declared again under the next
name (raychat.rl.actors.ActorGroup.rebuild_collective_group).

sync time = time of the put (or of the broadcasts on the sender) + the slowest actor's fetch-and-load time.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Mapping

import ray
import ray.util.collective as col
import torch
import torch.distributed as dist
from ray.util.collective.types import Backend


def weights_hash(state_dict: Mapping[str, torch.Tensor]) -> str:
    """First 16 hex digits of sha256 over (name, dtype, shape, raw bytes) of every tensor, sorted by name."""
    h = hashlib.sha256()
    for name in sorted(state_dict):
        t = state_dict[name].detach().to("cpu").contiguous()
        h.update(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode())
        h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()[:16]


def cpu_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().to("cpu").contiguous() for k, v in model.state_dict().items()}


def publish(model: torch.nn.Module) -> tuple[list, str, float]:
    """One ray.put of the model's CPU state dict. Returns ([ObjectRef], weights hash, put seconds)."""
    state = cpu_state_dict(model)
    digest = weights_hash(state)
    t0 = time.perf_counter()
    ref = ray.put(state)
    return [ref], digest, time.perf_counter() - t0


def load_published(model: torch.nn.Module, refs: list) -> tuple[str, float]:
    """Fetch the published state dict (refs = [ObjectRef]) and load it into `model`.

    Returns (weights hash of the model after loading, seconds spent fetching and loading).
    """
    t0 = time.perf_counter()
    state = ray.get(refs[0])
    model.load_state_dict(state)
    seconds = time.perf_counter() - t0
    return weights_hash(model.state_dict()), seconds


def collective_broadcast(model: torch.nn.Module, group_name: str) -> float:
    """Broadcast (rank 0) or receive (others) every tensor of model.state_dict() in place. Returns seconds.

    Every member must call this with the same group_name; tensors must live on the group's device (GPU for
    nccl). The state dict order is the module registration order, identical in every member.
    """
    t0 = time.perf_counter()
    with torch.no_grad():
        for tensor in model.state_dict().values():
            col.broadcast(tensor, src_rank=0, group_name=group_name)
    return time.perf_counter() - t0


def create_collective_group(learner, rollouts: list, backend: str, group_name: str) -> None:
    """Declare the broadcast group: learner rank 0 -> rank 0, rollout actor i -> rank i + 1.

    Raises ValueError for a backend other than "nccl" or "gloo".
    """
    if backend not in ("nccl", "gloo"):
        raise ValueError(f"collective backend must be 'nccl' or 'gloo', got {backend!r}")
    actors = [learner, *rollouts]
    col.create_collective_group(
        actors, world_size=len(actors), ranks=list(range(len(actors))), backend=backend.upper(),
        group_name=group_name,
    )  # fmt: skip


def leave_collective_group(group_name: str) -> None:
    """End this process's membership of the broadcast group `group_name` (nothing when it is not a member:
    a restarted actor), and with gloo also the torch.distributed default group that ray.util.collective
    creates under it (one per process). Every live member leaves before the group is declared again, under
    a new name, with a restarted member: a gloo or NCCL group cannot take a new process in place of a dead
    one."""
    if not col.is_group_initialized(group_name):
        return
    gloo = col.get_group_handle(group_name).backend() == Backend.GLOO
    col.destroy_collective_group(group_name)
    if gloo and dist.is_initialized():
        dist.destroy_process_group()


class SyncResult(dict):
    """{"version", "hash", "put_s", "apply_s" (max over actors), "sync_time_s", "wall_s"}."""


def sync_object_store(learner, rollouts: list, version: int) -> SyncResult:
    """Publish from `learner` (an actor with publish()) and load into every rollout actor; blocks.

    Raises RuntimeError when a rollout actor reports a different hash or version.
    """
    t0 = time.perf_counter()
    refs, digest, put_s = ray.get(learner.publish.remote())
    acks = ray.get([w.set_weights.remote(refs, version) for w in rollouts])
    return check_acks(acks, digest, version, put_s, time.perf_counter() - t0)


def check_acks(acks: list[dict], digest: str, version: int, put_s: float, wall_s: float) -> SyncResult:
    """Verify every actor's (version, hash) ack; return the SyncResult."""
    bad = [a for a in acks if a["hash"] != digest or a["version"] != version]
    if bad:
        raise RuntimeError(f"weight sync to version {version} failed: expected hash {digest}, got {bad}")
    apply_s = max((a["apply_s"] for a in acks), default=0.0)
    return SyncResult(
        version=version, hash=digest, put_s=put_s, apply_s=apply_s, sync_time_s=put_s + apply_s, wall_s=wall_s
    )
