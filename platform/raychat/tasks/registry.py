"""The task registry: every task a stage trains or evaluates on, by name, with one contract.

make_task(name, split, size, seed, **options) -> Task, where split is "train" or "test" (held out: no example
shared with train), size the number of examples (None: the task's default), seed the example order.
SFT mixtures are specs "calculator:4000,chatterbot,spelling:2000" (name[:examples], examples a positive
integer; parse_mixture, checked as the config is built); RL takes one task by name.

held_out(name) says whether the task has a test split (chatterbot-corpus has none: its conversations are
all used for training, so SFT validation covers the tasks that have one); EVAL_ONLY tasks (humaneval) have
no train split.

Local tasks: calculator, chatterbot, spelling (generated or shipped with a package). Hub tasks (nanochat's,
read from the task data directory, raychat.tasks.hub_data, option data_dir = --task-data-dir): smoltalk,
gsm8k, mmlu (train: cais/mmlu all/auxiliary_train), arc-easy, arc-challenge, humaneval (test only). A hub
task's rows are put in a fixed seeded order (HUB_ORDER_SEED, as nanochat's shuffle(seed=42)), so `name:N`
takes a sample across the whole file; the same N examples whatever the run's seed. A missing file raises
FileNotFoundError in one line naming the expected path (check_data checks a whole spec up front: the files and
every record in them). A user's own conversations are --sft-data's (raychat.tasks.sft_data), the task
'sft-data' that mixture_tasks adds (README "Your own conversations").
"""

from __future__ import annotations

from raychat.config.schema import parse_task_spec
from raychat.tasks.base import Task
from raychat.tasks.calculator import Calculator
from raychat.tasks.chatterbot import ChatterbotConversations
from raychat.tasks.hub_data import HUB_SPLITS, split_files
from raychat.tasks.humaneval import HumanEval
from raychat.tasks.loaders import GSM8K, MultipleChoice, SmolTalk
from raychat.tasks.sft_data import SFTDataRead, sft_data_split
from raychat.tasks.spelling import Spelling

HUB_ORDER_SEED = 42  # nanochat's tasks: load_dataset(...).shuffle(seed=42)


def _calculator(split: str, size: int | None, seed: int, max_operand: int = 999) -> Task:
    return Calculator(split=split, size=size or 10_000, seed=seed, max_operand=max_operand)


def _chatterbot(split: str, size: int | None, seed: int) -> Task:
    if split != "train":
        raise ValueError("task 'chatterbot' has no held-out split (its corpus is used whole for training)")
    return ChatterbotConversations(stop=size)


def _spelling(split: str, size: int | None, seed: int) -> Task:
    return Spelling(split=split, size=size, seed=seed)


def _hub(name: str, build):
    """A factory of hub task `name`: its split's files under data_dir, rows in HUB_ORDER_SEED order."""

    def factory(split: str, size: int | None, seed: int, data_dir: str | None = None) -> Task:
        if (name, split) not in HUB_SPLITS:
            raise ValueError(f"task {name!r} has no {split} split (it is for evaluation only)")
        return build(split_files(name, HUB_SPLITS[name, split], data_dir), seed=HUB_ORDER_SEED, stop=size)

    return factory


# every task's name, in TASKS' order: a literal, so that a config can check a task spec without importing the
# tasks (raychat.config.schema.owned_choices)
TASK_NAMES = (
    "calculator", "chatterbot", "spelling", "smoltalk", "gsm8k", "mmlu", "arc-easy", "arc-challenge", "humaneval",
)  # fmt: skip
TASKS = {
    "calculator": _calculator,
    "chatterbot": _chatterbot,
    "spelling": _spelling,
    "smoltalk": _hub("smoltalk", SmolTalk),
    "gsm8k": _hub("gsm8k", GSM8K),
    "mmlu": _hub("mmlu", lambda files, **kw: MultipleChoice(files, "mmlu", **kw)),
    "arc-easy": _hub("arc-easy", lambda f, **kw: MultipleChoice(f, "arc", name="arc-easy", **kw)),
    "arc-challenge": _hub(
        "arc-challenge", lambda f, **kw: MultipleChoice(f, "arc", name="arc-challenge", **kw)
    ),
    "humaneval": _hub("humaneval", HumanEval),
}
# the tasks that read nothing from the task data directory (the others are HUB_TASKS): a literal, as TASK_NAMES
LOCAL_TASKS = ("calculator", "chatterbot", "spelling")
HELD_OUT = {name: True for name in TASKS} | {"chatterbot": False}
EVAL_ONLY = ("humaneval",)
UNGRADED = ("chatterbot", "smoltalk")  # conversations without a checker
# the tasks whose accuracy `raychat eval --tasks` measures (a held-out split and a checker), in TASK_NAMES' order:
# a literal, as TASK_NAMES
EVAL_TASK_NAMES = ("calculator", "spelling", "gsm8k", "mmlu", "arc-easy", "arc-challenge", "humaneval")
REWARD_TASKS = ("calculator", "gsm8k")  # the tasks whose reward RL can optimize (raychat rl --task)
HUB_TASKS = tuple(sorted({name for name, _ in HUB_SPLITS}))


def make_task(name: str, split: str = "train", size: int | None = None, seed: int = 0, **options) -> Task:
    """The task `name` (see the module doc); options: calculator's max_operand, a hub task's data_dir.

    Raises:
        ValueError: an unknown name (listing the known), or a split the task does not have.
        FileNotFoundError: a hub task's file is missing (one line naming it).
    """
    if name not in TASKS:
        raise ValueError(f"unknown task {name!r}; known: {sorted(TASKS)}")
    if name not in HUB_TASKS:
        options.pop("data_dir", None)  # local tasks read no task data directory
    return TASKS[name](split, size, seed, **options)


def held_out(name: str) -> bool:
    return HELD_OUT[name]


def graded(name: str) -> bool:
    """Whether the task has a checker (is_correct), so accuracy can be measured on it."""
    return name not in UNGRADED


def check_data(names, splits=("train",), data_dir: str | None = None, flag: str = "--sft-tasks") -> None:
    """Check, before any stage starts (in the driver, before Ray), that every hub task in `names` has its files
    for `splits`, and every record in them: each task is read as a stage reads it (make_task), so a bad record
    stops the command here, not in a worker or actor after Ray started.

    Raises:
        ValueError: "<flag>: <the missing file's line>" (raychat.tasks.hub_data.split_files), "<flag>: <file>
            line <n>: <what is wrong> (K of N records are bad)" (the task's record check:
            raychat.tasks.loaders, raychat.tasks.humaneval), or a task that has no such split ("humaneval is
            for evaluation only").
    """
    for name in dict.fromkeys(names):
        for split in splits:
            if name in HUB_TASKS and (name, split) not in HUB_SPLITS:
                raise ValueError(f"{flag}: task {name!r} has no {split} split (it is for evaluation only)")
            if name in HUB_TASKS:
                try:
                    make_task(name, split, data_dir=data_dir)
                except (FileNotFoundError, ValueError) as e:
                    raise ValueError(f"{flag}: {e}") from None


def check_present_data(names, split: str, data_dir: str | None = None, prefix: str = "report card") -> None:
    """check_data's record check of the hub tasks in `names` whose `split` files are in the task data
    directory; a task without its files is passed over (the report card scores it "n/a: no data").

    Raises:
        ValueError: "<prefix>: <file> line <n>: <what is wrong> (K of N records are bad)", or an empty file.
    """
    for name in dict.fromkeys(names):
        if (name, split) in HUB_SPLITS:
            try:
                make_task(name, split, data_dir=data_dir)
            except FileNotFoundError:
                continue
            except ValueError as e:
                raise ValueError(f"{prefix}: {e}") from None


def parse_mixture(
    spec: str, flag: str = "--sft-tasks", empty_ok: bool = False
) -> list[tuple[str, int | None]]:
    """[(name, examples or None)] of a spec "calculator:2000,chatterbot,spelling:1000" (name[:examples]).

    Raises:
        ConfigError (a ValueError) naming `flag` (raychat.config.schema.parse_task_spec): an unknown task name,
            a count that is not a positive integer, no task at all (unless empty_ok).
    """
    return parse_task_spec(spec, flag, TASK_NAMES, empty_ok)


def mixture_tasks(
    spec: str,
    split: str = "train",
    seed: int = 0,
    data_dir: str | None = None,
    sft_data: str | SFTDataRead = "",
    sft_test_size: float = 0.0,
) -> list[Task]:
    """The tasks of a mixture spec (parse_mixture), each with its examples count; data_dir: hub tasks' files.
    With `sft_data` (--sft-data, or its conversations read already: raychat.tasks.sft_data.read_sft_data), its
    conversations of `split` come last as the task 'sft-data' (raychat.tasks.sft_data.sft_data_split; none for
    a test split with no held-out conversations), and the spec may be empty.

    Raises:
        ValueError: as parse_mixture, make_task and sft_data_split. FileNotFoundError: as make_task.
    """
    tasks = [
        make_task(name, split, n, seed, data_dir=data_dir)
        for name, n in parse_mixture(spec, empty_ok=bool(sft_data))
    ]
    if sft_data:
        own = sft_data_split(sft_data, sft_test_size)
        tasks += [own.train] if split == "train" else [own.test] if own.test is not None else []
    return tasks
