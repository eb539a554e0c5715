"""SFT rows: conversations of a task mixture rendered by the chat template and bin-packed into rows.

  TaskMixture -> render_samples (chat template, truncation) -> SamplePacker (best fit, segment ids) -> rows

SFTRows is the training row source (resumable); validation_rows packs a held-out task into a fixed set of
rows (the same rows at every evaluation).
"""

from __future__ import annotations

import numpy as np

from raychat.data.sample_packing import SamplePacker, render_samples
from raychat.tasks import Task, TaskMixture
from raychat.tokenizer import Tokenizer

ROW_KEYS = ("input_ids", "supervised", "segment_ids")


class SFTRows:
    """This rank's endless, exactly resumable stream of packed conversation rows.

    Rank r takes mixture examples r, r+W, r+2W, ...; at the end of the mixture the next epoch starts.
    `next_batch(n)` -> {"input_ids", "supervised", "segment_ids": (n, row_len) arrays}.
    """

    def __init__(
        self,
        tasks: list[Task],
        seed: int,
        tokenizer: Tokenizer,
        row_len: int,
        rank: int = 0,
        world_size: int = 1,
    ):
        self.mixture = TaskMixture(tasks, seed=seed)
        self.tokenizer, self.row_len = tokenizer, row_len
        self.indices = list(range(rank, len(self.mixture), world_size))
        self.epoch, self.position = 0, 0
        self.packer = SamplePacker(self._next_item, self.row_len, pad_id=tokenizer.bos_id, buffer_size=64)

    def _next_item(self):
        for _ in range(len(self.indices) + 1):
            if self.position >= len(self.indices):
                self.epoch, self.position = self.epoch + 1, 0
            conv = self.mixture[self.indices[self.position]]
            self.position += 1
            for item in render_samples(self.tokenizer, [(conv["id"], conv)], self.row_len, self.packer.stats):
                return item
        raise RuntimeError("every SFT sample was dropped by truncation: raise --seq-len")

    def next_batch(self, n: int) -> dict[str, np.ndarray]:
        rows = self.packer.next_batch(n)
        return {k: rows[k] for k in ROW_KEYS}

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "position": self.position, "packer": self.packer.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.epoch, self.position = state["epoch"], state["position"]
        self.packer.load_state_dict(state["packer"])


def validation_rows(task: Task, tokenizer: Tokenizer, row_len: int, world_size: int) -> dict[str, np.ndarray]:
    """Every conversation of `task` packed into rows, the row count rounded down to a multiple of world_size
    (at least world_size): {"input_ids", "supervised", "segment_ids": (N, row_len) arrays}."""
    items = render_samples(tokenizer, ((task[i]["id"], task[i]) for i in range(len(task))), row_len)
    rows = list(SamplePacker.from_items(items, row_len, pad_id=tokenizer.bos_id))
    n = max(world_size, len(rows) // world_size * world_size)
    return {k: np.stack([r[k] for r in rows[:n]]) for k in ROW_KEYS}
