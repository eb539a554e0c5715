"""Task API: a dataset of conversations with a checker, plus mixtures and curricula of tasks.

A conversation is a dict {"id": str, "messages": [...]} in the chat template's format (see
raychat.chat_template), with task-specific fields: "answer" (the reference), and for categorical tasks
"letters" (the answer choices, e.g. ["A", "B", "C", "D"]).

eval_type "categorical": the model's answer is the choice with the highest logit among `letters` after
<|assistant_start|>; is_correct(conversation, letter) -> bool.
eval_type "generative": the model generates a completion (assistant text, tool outputs included);
is_correct(conversation, completion) -> bool; reward() defaults to float(is_correct()) for RL.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

import numpy as np

EVAL_TYPES = ("categorical", "generative")
ANSWER_RE = re.compile(r"####\s*(-?[0-9][0-9,]*(?:\.[0-9]+)?)")


def extract_answer(completion: str) -> str | None:
    """The number after the LAST "#### " marker (GSM8K convention), commas removed; None if absent."""
    found = ANSWER_RE.findall(completion)
    return found[-1].replace(",", "") if found else None


class Task:
    """Base class. Subclasses set `name` and `eval_type` and implement num_examples and get_example.

    Slicing: Task(start, stop, step) views physical examples start, start+step, ... < stop; len() and
    task[i] use the view, get_example(i) the physical index.
    `source_files`: the paths of the files its examples are read from, () for a generated task (SFT's resume
    check compares their sha256: raychat.data.loader.sft_rows).
    """

    name: str = "task"
    eval_type: str = "generative"
    source_files: tuple[str, ...] = ()

    def __init__(self, start: int = 0, stop: int | None = None, step: int = 1):
        if start < 0 or step < 1 or (stop is not None and stop < start):
            raise ValueError(f"slice must have 0 <= start <= stop and step >= 1, got {start}:{stop}:{step}")
        if self.eval_type not in EVAL_TYPES:
            raise ValueError(f"{type(self).__name__}.eval_type must be one of {list(EVAL_TYPES)}")
        self.start, self.stop, self.step = start, stop, step

    def num_examples(self) -> int:
        """Physical number of examples (before slicing)."""
        raise NotImplementedError

    def get_example(self, index: int) -> dict:
        """The conversation at physical `index`."""
        raise NotImplementedError

    def is_correct(self, conversation: dict, completion: str) -> bool:
        raise NotImplementedError(f"task {self.name!r} has no checker")

    def reward(self, conversation: dict, completion: str) -> float:
        return float(self.is_correct(conversation, completion))

    def __len__(self) -> int:
        stop = self.num_examples() if self.stop is None else min(self.stop, self.num_examples())
        return max(0, -(-(stop - self.start) // self.step))

    def __getitem__(self, i: int) -> dict:
        n = len(self)
        if not -n <= i < n:
            raise IndexError(f"{self.name}: index {i} out of range for {n} examples")
        return self.get_example(self.start + (i % n) * self.step)

    def _id(self, index: int) -> str:
        return f"{self.name}/{index}"


class TaskMixture:
    """Examples of several tasks in one deterministic shuffled order.

    Args:
        tasks: the tasks; listing a task twice repeats it (weight by repetition).
        weights: optional explicit repetition factor per task (>= 0): factor w takes floor(w) full passes
            plus the first round(frac(w) * len) examples of a seeded permutation of that task.
        seed: seed of the shuffle (numpy PCG64); same seed, same order.
    Items: task_mixture[i] -> conversation with "id" and "source" (task name).
    """

    def __init__(self, tasks: Sequence[Task], weights: Sequence[float] | None = None, seed: int = 0):
        if not tasks:
            raise ValueError("TaskMixture needs at least one task")
        weights = [1.0] * len(tasks) if weights is None else list(weights)
        if len(weights) != len(tasks) or any(w < 0 for w in weights):
            raise ValueError(f"weights must be {len(tasks)} numbers >= 0, got {weights}")
        self.tasks, self.weights, self.seed = list(tasks), weights, seed
        rng = np.random.default_rng(seed)
        index = []
        for t, (task, w) in enumerate(zip(self.tasks, weights)):
            n = len(task)
            full, frac = int(w), w - int(w)
            ex = np.concatenate([np.tile(np.arange(n), full), rng.permutation(n)[: round(frac * n)]])
            index.append(np.stack([np.full(len(ex), t), ex], axis=1).astype(np.int64))
        self.index = np.concatenate(index) if index else np.zeros((0, 2), np.int64)
        self.index = self.index[rng.permutation(len(self.index))]

    def __len__(self) -> int:
        return len(self.index)

    def __getitem__(self, i: int) -> dict:
        t, ex = self.index[i]
        conversation = dict(self.tasks[t][int(ex)])
        conversation["source"] = self.tasks[t].name
        return conversation

    def describe(self) -> dict:
        """Replay metadata: task names, slices, weights, seed."""
        return {
            "tasks": [
                {"name": t.name, "slice": [t.start, t.stop, t.step], "examples": len(t)} for t in self.tasks
            ],
            "weights": self.weights,
            "seed": self.seed,
        }


class TaskSequence:
    """A curriculum: all examples of tasks[0] in order, then tasks[1], ... (no shuffle)."""

    def __init__(self, tasks: Sequence[Task]):
        if not tasks:
            raise ValueError("TaskSequence needs at least one task")
        self.tasks = list(tasks)
        self.offsets = np.cumsum([0] + [len(t) for t in self.tasks])

    def __len__(self) -> int:
        return int(self.offsets[-1])

    def __getitem__(self, i: int) -> dict:
        if not 0 <= i < len(self):
            raise IndexError(f"index {i} out of range for {len(self)} examples")
        t = int(np.searchsorted(self.offsets, i, side="right")) - 1
        conversation = dict(self.tasks[t][i - int(self.offsets[t])])
        conversation["source"] = self.tasks[t].name
        return conversation

    def describe(self) -> dict:
        return {
            "sequence": [
                {"name": t.name, "slice": [t.start, t.stop, t.step], "examples": len(t)} for t in self.tasks
            ]
        }
