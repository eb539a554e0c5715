"""--sft-data: a user's own conversations, named by path, as the task 'sft-data' of an SFT mixture.

The value is PATH[,PATH...]: each a .jsonl / .json (JSON lines) / .parquet file of {"messages": [...]} records
(raychat.chat_template's format, checked record by record as smoltalk's: raychat.tasks.loaders.SmolTalk), or a
directory of such files (its own files, sorted; not its subdirectories). The held-out split, measured as
"sft-data_val_bpb" and never trained on, is, as the hub's datasets name their splits:
- the files of the `test` split (test.jsonl, test-00000-of-00001.parquet): those in a named directory, those
  named, and those beside a named file of the `train` split (train.jsonl, train-00000-of-00002.parquet);
- else, where there is none, `test_size` of the conversations, carved off in a seeded order (numpy PCG64,
  SPLIT_SEED: the same conversations whatever the run's seed): a fraction in (0, 1) holds out
  ceil(test_size * N) of the N conversations (as datasets' and scikit-learn's train_test_split count), a whole
  number >= 1 that many, 0 none.
"""

from __future__ import annotations

import copy
import math
from decimal import Decimal
from pathlib import Path
from typing import NamedTuple

from raychat.config.schema import shown
from raychat.tasks.base import Task
from raychat.tasks.hub_data import SUFFIXES, is_split
from raychat.tasks.loaders import SmolTalk

SFT_DATA = "sft-data"  # the task's name: its examples' ids, its metrics ("sft-data_val_bpb")
SPLIT_SEED = 42  # the order the held-out conversations are carved off in (as the hub tasks' HUB_ORDER_SEED)
_read: list = []  # [the files' (path, size, mtime_ns), what read_sft_data read of them]: this process's read


class SFTData(SmolTalk):
    name = SFT_DATA


class SplitFiles(NamedTuple):
    train: tuple[Path, ...]
    test: tuple[Path, ...]


class SFTDataSplit(NamedTuple):
    """train: the conversations trained on; test: the held-out ones (None: none); carved: whether the held-out
    ones were carved off the train files (else they are the test files)."""

    train: Task
    test: Task | None
    carved: bool


def sft_data_files(value: str) -> SplitFiles:
    """The train and test files of an --sft-data value (module doc), each once, in the order named.

    Raises:
        ValueError: "--sft-data: ..." naming a path that does not exist, a file of another suffix, a directory
            with no data file, or a value with no file to train on (only test files).
    """
    train: dict[Path, None] = {}
    test: dict[Path, None] = {}
    for item in filter(None, (s.strip() for s in value.split(","))):
        path = Path(item).expanduser()
        if path.is_dir():
            files = sorted(f for f in path.iterdir() if f.suffix in SUFFIXES and f.is_file())
            if not files:
                raise ValueError(f"--sft-data: directory {path} holds no {'/'.join(SUFFIXES)} file")
            for f in files:
                (test if is_split(f.name, "test") else train)[f] = None
        elif path.is_file():
            if path.suffix not in SUFFIXES:
                raise ValueError(f"--sft-data: {path}: suffix must be one of {list(SUFFIXES)}")
            (test if is_split(path.name, "test") else train)[path] = None
            if is_split(path.name, "train"):
                test.update(dict.fromkeys(sorted(
                    f for f in path.parent.iterdir() if f.suffix in SUFFIXES and is_split(f.name, "test")
                )))  # fmt: skip
        else:
            raise ValueError(f"--sft-data: {path}: no such file or directory")
    if not train:
        raise ValueError(
            f"--sft-data: {value!r} names no file to train on (test.jsonl and test-* files are held out)"
        )
    return SplitFiles(tuple(train), tuple(test))


def absolute(value: str) -> str:
    """An --sft-data value with each path made absolute against this process's directory (the driver's: the
    workers that read the files run elsewhere)."""
    return ",".join(str(Path(s.strip()).expanduser().resolve()) for s in value.split(",") if s.strip())


def held_out_count(n: int, test_size: float) -> int:
    """How many of n conversations --sft-test-size `test_size` holds out (module doc): ceil(test_size * n) for a
    fraction (in decimal, so 0.1 of 30 is 3), the number itself from 1 on.

    Raises:
        ValueError: "--sft-test-size ...: holds out K of the N conversations ..." when none would be left to
            train on.
    """
    k = math.ceil(Decimal(repr(test_size)) * n) if test_size < 1 else int(test_size)
    if k >= n:
        raise ValueError(
            f"--sft-test-size {shown(test_size)}: holds out {k:,} of the {n:,} conversations of --sft-data, "
            "leaving none to train on (a smaller --sft-test-size, 0 for none, or a test file beside the data)"
        )
    return k


class SFTDataRead(NamedTuple):
    """An --sft-data value's conversations as read_sft_data read and checked them, not yet split: train: those
    of its train files; test: those of its test files (None: none)."""

    train: SFTData
    test: SFTData | None


def read_sft_data(value: str) -> SFTDataRead:
    """Read the files of an --sft-data value and check every record, train and test files alike, in a seeded
    order (SPLIT_SEED). Read once per process: a later call for the same files (by absolute path, the value
    named relative or not) returns what the first read while none of them changed (size and mtime); the
    latest read is kept, one value's. Every stage's reader (the driver's checks, the speedrun's check before
    its first stage, each worker's row source and validators) comes here and splits what it read
    (sft_data_split).

    Raises:
        ValueError: one line: as sft_data_files; "--sft-data: <file> line <n>: <field>: <what is wrong> (K of N
            records are bad)" (SmolTalk), an empty file.
    """
    files = sft_data_files(value)
    key = tuple(
        (str(f.resolve()), f.stat().st_size, f.stat().st_mtime_ns) for f in (*files.train, *files.test)
    )
    if _read and _read[0] == key:
        return _read[1]
    try:
        train = SFTData(list(files.train), seed=SPLIT_SEED)
        test = SFTData(list(files.test), seed=SPLIT_SEED) if files.test else None
    except (FileNotFoundError, ValueError) as e:
        raise ValueError(f"--sft-data: {e}") from None
    _read[:] = [key, SFTDataRead(train, test)]
    return _read[1]


def forget_read() -> None:
    """Drop this process's read (read_sft_data): the next call reads the files again, as a new process would."""
    _read.clear()


def sft_data_split(data: str | SFTDataRead, test_size: float, size: int | None = None) -> SFTDataSplit:
    """The conversations of an --sft-data value split into train and test (module doc); the test split holds
    at most `size` of them (None: all). data: the value (its files read and checked here: read_sft_data) or
    what read_sft_data read of it (its tasks shared, not read again).

    Raises:
        ValueError: one line: as read_sft_data, or as held_out_count.
    """
    train, test = read_sft_data(data) if isinstance(data, str) else data
    if test is not None:
        return SFTDataSplit(_view(train, 0, None), _view(test, 0, size), False)
    k = held_out_count(len(train), test_size)
    if k == 0:
        return SFTDataSplit(_view(train, 0, None), None, True)
    return SFTDataSplit(_view(train, k, None), _view(train, 0, k if size is None else min(k, size)), True)


def _view(task: Task, start: int, stop: int | None) -> Task:
    """Examples start..stop of `task` as a task of their own (its rows shared, not read again)."""
    view = copy.copy(task)
    Task.__init__(view, start, stop)
    return view
