"""The checkpointer every training stage shares (pretraining, SFT, RL): one directory layout
(raychat.checkpoint), meta in the config's words, and one way to publish it (raychat.checkpoint_manager).

  meta.json: {"stage", "step", "world_size", "metrics", "config" (the run's config, nested), ...stage extras
             ("plan", "version"), "model_config", "tokenizer_version"}
  optim.pt:  the optimizer state, written once by rank 0 (it is the same on every data-parallel rank)
  rank state: {"step", ...the stage's data position: "rows" (pretrain/SFT) or "version" (RL)}

Resuming reads model, meta, the one optimizer file, this rank's RNG and the data states of ALL ranks of the
old world: `restore_rows` hands them to the row source (raychat.data.loader.row_source.RowSource), which re-deals
them to the new world (whose size may differ) through `load_state_dicts`.

Publishing: each rank writes its part into a local directory, then `commit_ranks` (a torch.distributed
group: the Ray Train workers) uploads every rank's files to <storage>/<run>/checkpoint_<step:06d> and rank 0
commits it once all are in place; RL's driver does the same steps with its learner actors.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

import torch
import torch.distributed as dist

from raychat.checkpoint import (
    load_optimizers,
    load_rank_states,
    load_rng,
    save_model,
    save_optimizers,
    save_rank_state,
)
from raychat.checkpoint_manager import CheckpointManager
from raychat.data.loader.row_source import RowSource
from raychat.tokenizer import Tokenizer


class Checkpointer:
    """Writes this rank's part of a checkpoint directory and restores it.

    Args:
        stage: "pretrain" | "sft" | "rl" (meta["stage"]).
        config: the run's config as a nested dict (meta["config"]).
        tokenizer: saved beside the model.
        extra_meta: more meta keys of the stage (e.g. {"plan": ...}).
    """

    def __init__(self, stage: str, config: dict, tokenizer: Tokenizer, extra_meta: dict | None = None):
        self.stage, self.config, self.tokenizer, self.extra_meta = stage, config, tokenizer, extra_meta or {}

    def write(
        self,
        directory: str | os.PathLike,
        rank: int,
        world_size: int,
        step: int,
        model: torch.nn.Module,
        optimizers: list,
        state: dict,
        metrics: dict | None = None,
        **meta,
    ) -> None:
        """Rank 0: model + tokenizer + meta + the optimizer state; every rank: its RNG and `state` (with
        "step" added)."""
        if rank == 0:
            meta = {
                "stage": self.stage, "step": step, "world_size": world_size, "metrics": metrics or {},
                **self.extra_meta, **meta,
            }  # fmt: skip
            save_model(directory, model, self.tokenizer, {**meta, "config": self.config})
            save_optimizers(directory, optimizers)
        save_rank_state(directory, rank, {**state, "step": step})

    def restore(self, directory: str | os.PathLike, rank: int, optimizers: list) -> list[dict]:
        """Load the optimizer state in place and this rank's RNG (a rank the old world did not have keeps
        its own); returns the data state of every rank of the old world, by rank (see write)."""
        load_optimizers(directory, optimizers)
        load_rng(directory, rank)
        return load_rank_states(directory)


def restore_rows(row_source: RowSource, states: Sequence[dict]) -> None:
    """Resume `row_source` from the "rows" states of all ranks of the checkpoint's world (the list
    Checkpointer.restore returns): it re-deals them to this rank of the new world, whose size may differ.

    Raises:
        ValueError: the states were made from another stream, or are not those of one whole world.
    """
    row_source.load_state_dicts([s["rows"] for s in states])


def commit_ranks(
    manager: CheckpointManager, directory: str, step: int, rank: int, world: int, stage: str
) -> str:
    """Publish checkpoint `step` from every rank of a torch.distributed group (call on all ranks): rank 0
    clears the name, every rank uploads its part from the local `directory`, rank 0 writes the commit marker
    once all uploads returned. Returns the checkpoint's URI."""
    if rank == 0:
        manager.prepare(step)
    if world > 1:
        dist.barrier()
    files = manager.upload(directory, step)
    every = [files] * world
    if world > 1:
        dist.all_gather_object(every, files)
    if rank == 0:
        manager.commit(step, every, stage)
    if world > 1:
        dist.barrier()
    return manager.uri(step)
