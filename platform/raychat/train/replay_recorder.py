"""The training loop's replay records (raychat.data.replay.records): a Trainer callback on every rank.

on_step_begin (first step, rank 0): delete records of steps after the checkpoint this attempt resumed from
on_batch: the step's rows -> one record per row (segments + hashes), kept in memory
on_save: write this rank's records since the last checkpoint to <run dir>/replay/ before the checkpoint
"""

from __future__ import annotations

from raychat.data.replay.records import prune_records, replay_meta, step_records, write_records
from raychat.log import log
from raychat.train.trainer import Callback


class ReplayRecorder(Callback):
    """Records what every row of every optimizer step held (pretraining and SFT)."""

    def __init__(self):
        self.records: list[dict] = []
        self.started = False

    @staticmethod
    def run_dir(trainer) -> str:
        """<root>/<run> of the trainer's run (a local path or URI), from its CheckpointManager."""
        c = trainer.checkpoints
        return c.storage.uri_of(c.run_path)

    def on_step_begin(self, trainer, step: int) -> None:
        if not self.started:
            self.started = True
            if trainer.rank == 0 and (n := prune_records(self.run_dir(trainer), trainer.start_step)):
                log(f"replay: removed {n} record files of steps after {trainer.start_step} (redone now)")

    def on_batch(self, trainer, step: int, batches: list[dict]) -> None:
        self.records += step_records(
            step + 1,
            trainer.rank,
            trainer.world,
            batches,
            trainer.bos_id,
            trainer.config.model.document_masking,
        )

    def on_save(self, trainer, step: int) -> None:
        if not self.records:
            return
        tokenizer = trainer.checkpointer.tokenizer
        meta = replay_meta(
            trainer.config, tokenizer.version, tokenizer.bos_id, trainer.row_source.fingerprint()
        )
        write_records(self.run_dir(trainer), trainer.rank, self.records, meta)
        self.records = []
