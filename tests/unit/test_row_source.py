"""RowSource: both row sources implement the one protocol the Trainer and the checkpointer read, and a
checkpoint's rank states re-deal through it (restore_rows) to a world of another size."""

from __future__ import annotations

import typing

import pytest

from raychat.data.loader.cursor import Deal
from raychat.data.loader.pipeline import PretrainRows
from raychat.data.loader.row_source import RowSource
from raychat.data.loader.sft_rows import SFTRows
from raychat.tasks.registry import mixture_tasks
from raychat.train.checkpointer import restore_rows
from raychat.train.pretrain import Pretraining
from raychat.train.sft import SFT
from raychat.train.trainer import Trainer

SPEC, SEED, ROW_LEN = "calculator:30,spelling:20", 5, 128


class NoRedeal:
    """A row source of the old, unwritten protocol: one rank's state at a time."""

    def next_batch(self, n: int) -> dict: ...

    def fingerprint(self) -> dict: ...

    def state_dict(self) -> dict: ...

    def load_state_dict(self, state: dict) -> None: ...


def test_both_row_sources_and_the_stages_and_trainer_speak_row_source():
    assert issubclass(PretrainRows, RowSource) and issubclass(SFTRows, RowSource)
    assert not issubclass(NoRedeal, RowSource)
    built = [typing.get_type_hints(stage.row_source)["return"] for stage in (Pretraining, SFT)]
    assert built == [PretrainRows, SFTRows]
    assert typing.get_type_hints(Trainer.__init__)["row_source"] is RowSource


def rows(tok, rank, world, spec=SPEC):
    return SFTRows(mixture_tasks(spec, "train", SEED), SEED, tok, ROW_LEN, rank, world, buffer_size=8)


def items(batch) -> list[int]:
    return [g for row in batch["replay"] for g in row["doc"]]


def test_restore_rows_redeals_a_checkpoint_of_two_ranks_to_three(small_tokenizer):
    old = [rows(small_tokenizer, r, 2) for r in range(2)]
    trained = [g for _ in range(4) for src in old for g in items(src.next_batch(3))]
    buffered = [g for src in old for g in src.state_dict()["packer"]["buffer"]]
    checkpoint = [{"rows": src.state_dict(), "step": 4} for src in old]  # as Checkpointer.restore returns
    new = [rows(small_tokenizer, r, 3) for r in range(3)]
    for src in new:
        restore_rows(src, checkpoint)
    states = [src.state_dict() for src in new]
    assert [(s["rank"], s["deal"]["world"], s["taken"], s["packer"]["buffer"]) for s in states] == [
        (0, 3, 0, []), (1, 3, 0, []), (2, 3, 0, []),
    ]  # fmt: skip
    assert [s["packer"]["stats"]["rows"] for s in states] == [24, 0, 0]  # rank 0 keeps the run's counters
    assert len(buffered) > 0 and {g for g, _ in Deal.from_dict(states[0]["deal"]).pending} >= set(buffered)
    later = [g for src in new for g in items(src.next_batch(4))]
    assert len(later) > 12 and not set(later) & set(trained)  # nothing trained twice


def test_restore_rows_refuses_another_stream_or_part_of_a_world(small_tokenizer):
    old = [rows(small_tokenizer, r, 2) for r in range(2)]
    for src in old:
        src.next_batch(2)
    checkpoint = [{"rows": src.state_dict(), "step": 1} for src in old]
    with pytest.raises(ValueError, match="made on .*'examples': 50.*this run has .*'examples': 31"):
        restore_rows(rows(small_tokenizer, 0, 1, "calculator:31"), checkpoint)
    with pytest.raises(ValueError, match=r"ranks 0..1 of one world, in order; got ranks \[1\]"):
        restore_rows(rows(small_tokenizer, 0, 1), checkpoint[1:])
