"""The task registry: every task a stage trains or evaluates on, by name, with one contract.

make_task(name, split, size, seed, **options) -> Task, where split is "train" or "test" (held out: no example
shared with train), size the number of examples (None: the task's default), seed the example order.
SFT mixtures are specs "calculator:4000,chatterbot,spelling:2000" (name[:examples]); RL takes one task by name.

held_out(name) says whether the task has a test split (chatterbot-corpus has none: its conversations are
all used for training, so SFT validation covers the tasks that have one).
"""

from __future__ import annotations

from raychat.tasks.base import Task
from raychat.tasks.calculator import Calculator
from raychat.tasks.chatterbot import ChatterbotConversations
from raychat.tasks.spelling import Spelling


def _calculator(split: str, size: int | None, seed: int, max_operand: int = 999) -> Task:
    return Calculator(split=split, size=size or 10_000, seed=seed, max_operand=max_operand)


def _chatterbot(split: str, size: int | None, seed: int) -> Task:
    if split != "train":
        raise ValueError("task 'chatterbot' has no held-out split (its corpus is used whole for training)")
    return ChatterbotConversations(stop=size)


def _spelling(split: str, size: int | None, seed: int) -> Task:
    return Spelling(split=split, size=size, seed=seed)


TASKS = {"calculator": _calculator, "chatterbot": _chatterbot, "spelling": _spelling}
HELD_OUT = {"calculator": True, "chatterbot": False, "spelling": True}


def make_task(name: str, split: str = "train", size: int | None = None, seed: int = 0, **options) -> Task:
    """The task `name` (see the module doc). Raises ValueError for an unknown name (listing the known)."""
    if name not in TASKS:
        raise ValueError(f"unknown task {name!r}; known: {sorted(TASKS)}")
    return TASKS[name](split, size, seed, **options)


def held_out(name: str) -> bool:
    return HELD_OUT[name]


def parse_mixture(spec: str, flag: str = "--sft-tasks") -> list[tuple[str, int | None]]:
    """[(name, examples or None)] of a spec "calculator:2000,chatterbot,spelling:1000".

    Raises:
        ValueError: an unknown task name, as "<flag>: unknown task ...; known: [...]".
    """
    out = []
    for item in filter(None, (s.strip() for s in spec.split(","))):
        name, _, count = item.partition(":")
        if name not in TASKS:
            raise ValueError(f"{flag}: unknown task {name!r}; known: {sorted(TASKS)}")
        out.append((name, int(count) if count else None))
    return out


def mixture_tasks(spec: str, split: str = "train", seed: int = 0) -> list[Task]:
    """The tasks of a mixture spec (parse_mixture), each with its examples count."""
    return [make_task(name, split, n, seed) for name, n in parse_mixture(spec)]
