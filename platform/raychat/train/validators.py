"""Validators: what the Trainer measures at each evaluation step, one object per measurement.

  BPBValidator       validation bits per byte on fixed rows (all ranks; sums all-reduced): "<name>"
  MeanBPBValidator   BPB over the rows of several BPBEvaluators together (sums added, no extra forward)
  AccuracyValidator  greedy task accuracy of held-out examples (rank 0): "<task>_accuracy"
  SamplesValidator   greedy samples from fixed prompts at the end (and every sample_every; rank 0)

Evaluation runs the high-precision copy of FP8 layers (raychat.train.fp8.high_precision_linears).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Sequence

import numpy as np
import torch

from raychat.eval.bpb import bpb_sums
from raychat.eval.samples import greedy_samples
from raychat.eval.tasks import task_accuracy
from raychat.tasks import Task
from raychat.tokenizer import Tokenizer
from raychat.train.fp8 import high_precision_linears


class Validator:
    """evaluate(model, step, last_step) -> {metric name: value}; {} when it has nothing to say at `step`."""

    def validate(self, model: torch.nn.Module, step: int, last_step: int) -> dict: ...


class BPBValidator(Validator):
    """BPB of this rank's share of fixed validation rows ({"input_ids", optional "supervised" and
    "segment_ids": (N, T+1)}); the nat and byte sums are all-reduced (raychat.eval.bpb)."""

    def __init__(
        self,
        name: str,
        rows: dict[str, np.ndarray],
        tokenizer: Tokenizer,
        batch_size: int,
        document_masking: bool,
        device: torch.device,
        autocast: Callable | None = None,
    ):
        self.name, self.rows, self.bos_id = name, rows, tokenizer.bos_id
        self.token_bytes = torch.tensor(tokenizer.token_bytes(), dtype=torch.int64)
        self.batch_size, self.document_masking, self.device, self.autocast = (
            batch_size, document_masking, device, autocast,
        )  # fmt: skip
        self.last_sums = (0.0, 0.0)

    def validate(self, model, step, last_step) -> dict:
        nats, nbytes = bpb_sums(
            model, self.rows, self.token_bytes, self.bos_id, self.batch_size, self.document_masking,
            self.device, self.autocast,
        )  # fmt: skip
        self.last_sums = (nats, nbytes)
        return {self.name: nats / (math.log(2) * nbytes)}


class MeanBPBValidator(Validator):
    """BPB over every row of `parts` together (run after them: it adds their last sums)."""

    def __init__(self, name: str, parts: Sequence[BPBValidator]):
        self.name, self.parts = name, list(parts)

    def validate(self, model, step, last_step) -> dict:
        nats = sum(p.last_sums[0] for p in self.parts)
        nbytes = sum(p.last_sums[1] for p in self.parts)
        return {self.name: nats / (math.log(2) * nbytes)}


class AccuracyValidator(Validator):
    """Greedy accuracy on the first `num_examples` examples of a held-out task (raychat.eval.tasks)."""

    def __init__(self, name: str, task: Task, tokenizer: Tokenizer, num_examples: int):
        self.name, self.task, self.tokenizer, self.num_examples = name, task, tokenizer, num_examples

    def validate(self, model, step, last_step) -> dict:
        return {self.name: task_accuracy(model, self.tokenizer, self.task, self.num_examples)}


class SamplesValidator(Validator):
    """Greedy samples of fixed prompts (raychat.eval.samples) at the last step and every `every` steps."""

    def __init__(self, tokenizer: Tokenizer, every: int, device: torch.device):
        self.tokenizer, self.every, self.device = tokenizer, every, device

    def validate(self, model, step, last_step) -> dict:
        if step == last_step or (self.every and step % self.every == 0):
            return {"samples": greedy_samples(model, self.tokenizer, device=self.device)}
        return {}


def validate_all(validators: Sequence[Validator], model: torch.nn.Module, step: int, last_step: int) -> dict:
    """Every evaluator's metrics at `step`, in order, with FP8 layers swapped for high precision."""
    out: dict = {}
    fp8 = any(type(m).__name__ == "Float8Linear" for m in model.modules())
    with high_precision_linears(model) if fp8 else contextlib.nullcontext():
        for e in validators:
            out.update(e.validate(model, step, last_step))
    return out
