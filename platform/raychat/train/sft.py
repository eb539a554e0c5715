"""Supervised fine-tuning: the pretraining loop (raychat.train.loop) fed with packed conversations.

  TaskMixture -> chat template (render + truncate) -> SamplePacker (best fit, segment ids) -> rows
  -> the same loop: DDP, FP8, checkpoints, exact resume, metrics; document_masking is forced on.

`raychat sft --init-from <pretraining checkpoint>` (or `jobs/sft.py`). The final checkpoint has
meta.kind == "sft" (a chat model).
"""

from __future__ import annotations

import numpy as np

from raychat.tokenizer import Tokenizer


def build_tasks(spec: str, split: str = "train", seed: int = 0):
    """Tasks from a spec "calculator:2000,chatterbot,spelling:1000" (name[:examples]).

    Raises:
        ValueError: an unknown task name (the message lists the known ones).
    """
    from raychat.tasks import Calculator, ChatterbotConversations, Spelling

    known = {
        "calculator": lambda n: Calculator(split=split, size=n or 10_000, seed=seed),
        "chatterbot": lambda n: ChatterbotConversations(stop=n),
        "spelling": lambda n: Spelling(split=split, size=n, seed=seed),
    }
    tasks = []
    for item in filter(None, (s.strip() for s in spec.split(","))):
        name, _, count = item.partition(":")
        if name not in known:
            raise ValueError(f"--sft-tasks: unknown task {name!r}; known: {sorted(known)}")
        tasks.append(known[name](int(count) if count else None))
    return tasks


class SFTRows:
    """This rank's endless, exactly resumable stream of packed conversation rows.

    Rank r takes mixture examples r, r+W, r+2W, ...; at the end of the mixture the next epoch starts.
    """

    def __init__(self, cfg, tokenizer: Tokenizer, rank: int = 0, world_size: int = 1):
        from raychat.data.sample_packing import SamplePacker
        from raychat.tasks import TaskMixture

        self.mixture = TaskMixture(build_tasks(cfg.data.sft_tasks, "train", cfg.run.seed), seed=cfg.run.seed)
        self.tokenizer, self.row_len = tokenizer, cfg.model.seq_len + 1
        self.indices = list(range(rank, len(self.mixture), world_size))
        self.epoch, self.position = 0, 0
        self.packer = SamplePacker(self._next_item, self.row_len, pad_id=tokenizer.bos_id, buffer_size=64)

    def _next_item(self):
        from raychat.data.sample_packing import render_samples

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
        return {k: rows[k] for k in ("input_ids", "supervised", "segment_ids")}

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "position": self.position, "packer": self.packer.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.epoch, self.position = state["epoch"], state["position"]
        self.packer.load_state_dict(state["packer"])


def sft_validation_rows(cfg, tokenizer: Tokenizer) -> dict[str, np.ndarray]:
    """Packed rows of held-out conversations (calculator test split), fixed across evaluations."""
    from raychat.data.sample_packing import SamplePacker, render_samples
    from raychat.tasks import Calculator

    task = Calculator(split="test", size=max(64, cfg.train.eval.eval_tokens // 32), seed=cfg.run.seed)
    items = render_samples(
        tokenizer, ((task[i]["id"], task[i]) for i in range(len(task))), cfg.model.seq_len + 1
    )
    packer = SamplePacker.from_items(items, cfg.model.seq_len + 1, pad_id=tokenizer.bos_id)
    rows = list(packer)
    n = max(cfg.cluster.num_workers, len(rows) // cfg.cluster.num_workers * cfg.cluster.num_workers)
    return {k: np.stack([r[k] for r in rows[:n]]) for k in ("input_ids", "supervised", "segment_ids")}


def add_cli(subparsers) -> None:
    from raychat.config import TrainConfig, add_flags, from_dict
    from raychat.config.train import SFT_DEFAULTS

    parser = subparsers.add_parser(
        "sft",
        help="supervised fine-tuning of a pretrained checkpoint into a chat model",
        description="Fine-tune on packed conversations (--sft-tasks) with the pretraining loop on Ray Train. "
        "Needs --init-from <pretraining checkpoint dir>. Running again with the same --run-name resumes.",
    )
    add_flags(parser, TrainConfig, defaults=from_dict(TrainConfig, SFT_DEFAULTS), preset="cpu")
    parser.set_defaults(func=_main)


def _main(args) -> int:
    from raychat.config import from_dict
    from raychat.train.pretrain import config_for, run_training

    cfg = config_for(args, "sft")
    if not cfg.run.init_from:
        raise ValueError("--init-from <pretraining checkpoint directory> is required")
    from raychat.checkpoint import read_meta

    read_meta(cfg.run.init_from)  # a clear error now, not inside a Ray worker
    run_training(from_dict(type(cfg), {"document_masking": True}, base=cfg))
    return 0
