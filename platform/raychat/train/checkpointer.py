"""The checkpointer every training stage shares (pretraining, SFT, RL): one directory layout
(raychat.checkpoint), meta in the config's words, and two ways to publish a finished directory.

  meta.json: {"stage", "step", "world_size", "metrics", "config" (the run's config, nested), ...stage extras
             ("plan", "version"), "model_config", "tokenizer_version"}
  optim.pt:  the optimizer state, written once by rank 0 (it is the same on every data-parallel rank)
  rank state: {"step", ...the stage's data position: "rows" (pretrain/SFT) or "version" (RL)}

Resuming reads model, meta, the one optimizer file, this rank's RNG and the data states of ALL ranks of the
old world: `restore_rows` hands them to the row source, which re-deals them to the new world (whose size may
differ) through `load_state_dicts`.

RayTrainPublisher hands the directory to Ray Train (`ray.train.report`: Ray copies it to
storage_path/run_name/checkpoint_*, keeps the newest keep_checkpoints); RunDirectory renames a staged
directory into OUT/RUN_NAME/checkpoint_<step> and prunes (RL, whose actors are not a Ray Train group).
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import ray.train
import torch

from raychat.checkpoint import (
    load_optimizers,
    load_rank_states,
    load_rng,
    save_model,
    save_optimizers,
    save_rank_state,
)
from raychat.storage import newest_checkpoint, open_storage
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


def restore_rows(row_source, states: list[dict], rank: int, world_size: int) -> None:
    """Resume `row_source` from the "rows" states of all ranks of the checkpoint's world.

    A row source with `load_state_dicts(states)` re-deals them to this rank of the new world (any size);
    one with only `load_state_dict(state)` resumes the same world size, rank by rank.

    Raises:
        ValueError: the world size changed and the row source cannot re-deal its state.
    """
    rows = [s["rows"] for s in states]
    if hasattr(row_source, "load_state_dicts"):
        row_source.load_state_dicts(rows)
    elif len(rows) == world_size:
        row_source.load_state_dict(rows[rank])
    else:
        raise ValueError(
            f"the checkpoint was written by {len(rows)} workers and this run has {world_size}: "
            f"{type(row_source).__name__} resumes only on the same number of workers (--num-workers "
            f"{len(rows)})"
        )


class RayTrainPublisher:
    """Publishes a written directory through ray.train.report (with the step's metrics)."""

    def publish(self, directory: str, report: dict) -> None:
        ray.train.report(report, checkpoint=ray.train.Checkpoint.from_directory(directory))


class RunDirectory:
    """OUT/RUN_NAME/checkpoint_<step:06d> directories: staged under a temporary name, renamed when complete,
    the oldest pruned beyond `keep`."""

    def __init__(self, run_dir: str | os.PathLike, keep: int):
        self.run_dir, self.keep = Path(run_dir), keep

    def staging_path(self, step: int) -> Path:
        return self.run_dir / f".tmp_checkpoint_{step:06d}"

    def staging(self, step: int) -> Path:
        """The temporary directory to write checkpoint `step` into, emptied."""
        shutil.rmtree(self.staging_path(step), ignore_errors=True)
        return self.staging_path(step)

    def commit(self, step: int) -> Path:
        """Rename the staged directory into place and prune; returns the checkpoint's path."""
        final = self.run_dir / f"checkpoint_{step:06d}"
        shutil.rmtree(final, ignore_errors=True)
        os.replace(self.staging_path(step), final)
        for old in sorted(self.run_dir.glob("checkpoint_*"))[: -self.keep]:
            shutil.rmtree(old, ignore_errors=True)
        return final

    def latest(self) -> Path | None:
        """The newest complete checkpoint_* (raychat.storage's rule: the highest meta.json step), or None."""
        storage = open_storage(self.run_dir)
        newest = newest_checkpoint(storage, storage.path)
        return Path(newest) if newest else None
