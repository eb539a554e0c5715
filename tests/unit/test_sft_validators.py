"""SFT validates on the tasks it trains on (--sft-tasks): one validation BPB per task with a held-out split,
their byte-weighted mean as val_bpb, and rank 0's greedy accuracy per task."""

from __future__ import annotations

import math

import pytest
import torch

from raychat.config import from_dict
from raychat.model import GPT, ModelConfig
from raychat.train.sft import SFT, sft_defaults
from raychat.train.validators import AccuracyValidator, BPBValidator, MeanBPBValidator


def validators(tokenizer, tasks: str, rank: int = 0, world: int = 1):
    cfg = from_dict(
        type(sft_defaults()), {"sft_tasks": tasks, "seq_len": 64, "eval_tokens": 2048}, base=sft_defaults()
    )
    return SFT().validators(cfg, tokenizer, rank, world, torch.device("cpu"), None)


@pytest.mark.parametrize(
    "tasks, names",
    [
        (
            "calculator:50,chatterbot,spelling:20",  # chatterbot has no held-out split
            ["calculator_val_bpb", "spelling_val_bpb", "val_bpb", "calculator_accuracy", "spelling_accuracy"],
        ),
        ("spelling:20", ["spelling_val_bpb", "val_bpb", "spelling_accuracy"]),
        ("chatterbot", []),
    ],
)
def test_every_trained_task_with_a_held_out_split_is_validated(small_tokenizer, tasks, names):
    out = validators(small_tokenizer, tasks)
    assert [e.name for e in out] == names
    for e in out:
        if isinstance(e, AccuracyValidator):  # on the task's test split, never the one it trains on
            assert e.task.name == e.name.replace("_accuracy", "-test")


def test_other_ranks_validate_bpb_but_leave_accuracy_to_rank_0(small_tokenizer):
    out = validators(small_tokenizer, "calculator:50,spelling:20", rank=1, world=2)
    assert [e.name for e in out] == ["calculator_val_bpb", "spelling_val_bpb", "val_bpb"]


def test_val_bpb_is_the_byte_weighted_mean_of_the_tasks(small_tokenizer):
    """With lm_head all zeros every logit is 0: each target costs ln(V) nats, so a task's nat sum is ln(V)
    times its number of targets (an integer), and val_bpb adds the tasks' nats and bytes."""
    tok = small_tokenizer
    model = GPT(ModelConfig.from_depth(1, tok.vocab_size, 64, aspect_ratio=64, head_dim=32)).init_weights(0)
    torch.nn.init.zeros_(model.lm_head.weight)
    calc, spell, mean = validators(tok, "calculator:50,spelling:20")[:3]
    assert isinstance(calc, BPBValidator) and isinstance(mean, MeanBPBValidator)
    values = {}
    for e in (calc, spell, mean):
        values.update(e.validate(model, 1, 1))
    (n1, b1), (n2, b2) = calc.last_sums, spell.last_sums
    for nats, nbytes in ((n1, b1), (n2, b2)):
        targets = nats / math.log(tok.vocab_size)
        assert targets == pytest.approx(round(targets), abs=1e-3) and round(targets) > 0 and nbytes > 0
    assert values["calculator_val_bpb"] == pytest.approx(n1 / (math.log(2) * b1))
    assert values["val_bpb"] == pytest.approx((n1 + n2) / (math.log(2) * (b1 + b2)))
    assert min(values["calculator_val_bpb"], values["spelling_val_bpb"]) < values["val_bpb"]
    assert values["val_bpb"] < max(values["calculator_val_bpb"], values["spelling_val_bpb"])
