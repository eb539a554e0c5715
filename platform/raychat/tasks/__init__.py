"""Tasks (conversations with checkers), mixtures, curricula and the task registry."""

from raychat.tasks.base import EVAL_TYPES, Task, TaskMixture, TaskSequence, extract_answer
from raychat.tasks.calculator import Calculator
from raychat.tasks.chatterbot import ChatterbotConversations
from raychat.tasks.humaneval import HumanEval
from raychat.tasks.loaders import GSM8K, MultipleChoice, SmolTalk
from raychat.tasks.report import format_report, mixture_report
from raychat.tasks.spelling import Spelling

__all__ = [
    "EVAL_TYPES",
    "GSM8K",
    "HumanEval",
    "Calculator",
    "ChatterbotConversations",
    "MultipleChoice",
    "SmolTalk",
    "Spelling",
    "Task",
    "TaskMixture",
    "TaskSequence",
    "extract_answer",
    "format_report",
    "mixture_report",
]
