"""SFT validates on the tasks it trains on (--sft-tasks): one validation BPB per task with a held-out split,
their byte-weighted mean as val_bpb, and rank 0's greedy accuracy per task."""

from __future__ import annotations

import json
import math

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from raychat.config import from_dict
from raychat.eval.bpb import bpb_coverage
from raychat.loss import TokenCrossEntropy
from raychat.model import GPT, ModelConfig
from raychat.ports import free_ports
from raychat.tokenizer import Tokenizer
from raychat.train.sft import SFT, check_validation_rows, sft_defaults
from raychat.train.trainer import to_batch
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


ANSWERS = ["a" * 30, "b" * 34, "c" * 38]  # one row each (seq_len below): no two fit together


def _held_out_rows(rank: int, port: int, tok_dir: str, data: str, seq_len: int, out) -> None:
    """Rank `rank` of 2 gloo ranks: SFT's validators of --sft-data `data` (as each Ray Train worker builds them)
    on a model whose lm_head is all zeros; out[rank]: its rows and the all-reduced sums."""
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        tok = Tokenizer.load(tok_dir)
        cfg = from_dict(
            type(sft_defaults()),
            {"sft_tasks": "", "sft_data": data, "seq_len": seq_len, "tokenizer_path": tok_dir},
            base=sft_defaults(),
        )
        bpb, mean = SFT().validators(cfg, tok, rank, 2, torch.device("cpu"), None)
        model = GPT(ModelConfig.from_depth(1, tok.vocab_size, seq_len, aspect_ratio=64, head_dim=32))
        torch.nn.init.zeros_(model.init_weights(0).lm_head.weight)
        values = {**bpb.validate(model, 1, 1), **mean.validate(model, 1, 1)}
        out[rank] = {"rows": len(bpb.rows["input_ids"]), "sums": bpb.last_sums, "values": values}
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("held_out", [1, 3])
def test_validation_bpb_is_over_every_held_out_row_on_two_workers(held_out, small_tokenizer, tmp_path):
    """Held-out rows fewer than the workers (1 row, 2 workers: rank 1's share is empty) or not a multiple of them
    (3 rows: the third was dropped, the row count rounded down to a multiple of the workers, so the BPB depended
    on the number of workers). Every row counts now, on 2 real gloo ranks: with lm_head all zeros each target
    costs ln(V) nats, and the targets with bytes are the answers' tokens (each <|assistant_end|> has 0 bytes), so
    the sums are ln(V) x their tokens and their UTF-8 bytes, worked out from the answers alone."""
    tok = small_tokenizer
    tok.save(tmp_path / "tok")
    chat = lambda a: {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": a}]}  # noqa: E731
    (tmp_path / "train.jsonl").write_text(json.dumps(chat("t")) + "\n")
    answers = ANSWERS[:held_out]
    (tmp_path / "test.jsonl").write_text("".join(json.dumps(chat(a)) + "\n" for a in answers))
    lengths = [len(tok.encode("q")) + len(tok.encode(a)) + 5 for a in ANSWERS]  # 5 markers: BOS, 2 per turn
    assert max(lengths) < min(lengths) * 2  # a row of max(lengths) tokens holds one conversation, never two
    with mp.Manager() as manager:
        out = manager.dict()
        args = (free_ports(1)[0], str(tmp_path / "tok"), str(tmp_path / "train.jsonl"), max(lengths) - 1, out)
        mp.spawn(_held_out_rows, args=args, nprocs=2, join=True)
        results = dict(out)
    assert sorted(results[r]["rows"] for r in (0, 1)) == ([0, 1] if held_out == 1 else [1, 2])
    tokens = sum(len(tok.encode(a)) for a in answers)
    nbytes = sum(len(a.encode()) for a in answers)
    assert nbytes == {1: 30, 3: 102}[held_out]
    for r in (0, 1):
        nats, got_bytes = results[r]["sums"]
        assert got_bytes == nbytes and nats == pytest.approx(tokens * math.log(tok.vocab_size), rel=1e-6)
        want = tokens * math.log2(tok.vocab_size) / nbytes
        assert results[r]["values"]["sft-data_val_bpb"] == pytest.approx(want, rel=1e-6)
        assert results[r]["values"]["val_bpb"] == pytest.approx(want, rel=1e-6)


class Bigram(torch.nn.Module):
    """A fixed model whose logits at a position depend only on that position's input token: row `prev` of
    `table` (V, V); every other logit is 0."""

    def __init__(self, table: torch.Tensor):
        super().__init__()
        self.register_buffer("table", table)

    def forward(self, input_ids, position_ids=None, segment_ids=None):
        return self.table[input_ids]


def test_held_out_rows_are_built_masked_and_scored_as_training_rows_by_hand(small_tokenizer, tmp_path):
    """A tiny SFT trial's sft-data_val_bpb rose 5.71 -> 8.49 while the loss fell: a defect, or overfitting? The
    same conversation, once in --sft-data's train file and once in its test file, gives the same row in the
    training stream (SFTRows) and in the held-out rows (SFT.validators), the same loss_mask (the assistant's
    tokens " Mars", "." and <|assistant_end|>, never BOS, the user's "red?" or the markers around it), and
    the BPB worked out by hand. The model is a bigram table: after <|assistant_start|> it puts logit ln(V-1) on
    " Mars" (p = (V-1) / (V-1 + V-1) = 1/2), after " Mars" ln((V-1)/3) on "." (p = 1/4), after "." ln(V-1) on
    <|assistant_end|> (p = 1/2); every other logit is 0, so a user token would cost ln V. BPB = (ln 2 + ln 4)
    nats / ln 2 / (5 + 1) bytes = 0.5 (<|assistant_end|> has 0 bytes: in neither sum); the training loss is the
    mean over the 3 targets, (ln 2 + ln 4 + ln 2) / 3 = 4/3 ln 2 nats. The rise of the trial was the model
    memorizing its 19 answers (exp: the same validator on the training conversations fell 3.0 -> 0.03 as the
    held-out one rose), not a difference in how the rows are scored."""
    tok = small_tokenizer
    tok.save(tmp_path / "tok")
    mars, dot = tok.encode(" Mars.")
    end, start = tok.special_id("<|assistant_end|>"), tok.special_id("<|assistant_start|>")
    assert tok.token_bytes()[mars] == 5 and tok.token_bytes()[dot] == 1 and tok.token_bytes()[end] == 0
    chat = {"messages": [{"role": "user", "content": "red?"}, {"role": "assistant", "content": " Mars."}]}
    for name in ("train.jsonl", "test.jsonl"):
        (tmp_path / name).write_text(json.dumps(chat) + "\n")
    # BOS, <|user_start|>, "re" "d" "?", <|user_end|>, <|assistant_start|>, " Mars" ".", <|assistant_end|>
    length = 10
    cfg = from_dict(
        type(sft_defaults()),
        {"sft_tasks": "", "sft_data": str(tmp_path / "train.jsonl"), "seq_len": length - 1,
         "tokenizer_path": str(tmp_path / "tok")},
        base=sft_defaults(),
    )  # fmt: skip
    bpb, _ = SFT().validators(cfg, tok, 0, 1, torch.device("cpu"), None)
    train = SFT().row_source(cfg, tok, 0, 1).next_batch(1)
    for k in ("input_ids", "supervised", "segment_ids"):
        assert train[k].tolist() == bpb.rows[k].tolist(), k  # one conversation a row, no padding
    batch = to_batch(train, tok.bos_id, True, torch.device("cpu"))
    assert batch["labels"][batch["loss_mask"]].tolist() == [mars, dot, end]
    assert batch["input_ids"][batch["loss_mask"]].tolist() == [start, mars, dot]

    v = tok.vocab_size
    table = torch.zeros(v, v)
    table[start, mars], table[mars, dot], table[dot, end] = (
        math.log(v - 1),
        math.log((v - 1) / 3),
        math.log(v - 1),
    )
    model = Bigram(table)
    assert bpb.validate(model, 1, 1) == {"sft-data_val_bpb": pytest.approx(0.5, rel=1e-6)}
    assert bpb.last_sums == pytest.approx((3 * math.log(2), 6), rel=1e-6)
    # what the run says the score covers: the bytes are the sum above, the tokens " Mars" and "."
    assert bpb_coverage(bpb.rows, tok.token_bytes(), tok.bos_id) == (1, 2, 6)
    assert (
        check_validation_rows(cfg)
        == "sft data: sft-data_val_bpb scores 1 held-out conversation: 2 tokens, 6 bytes"
    )
    share, stats = TokenCrossEntropy()(model(batch["input_ids"]), batch, [3])
    assert share.item() == pytest.approx(4 / 3 * math.log(2), rel=1e-6)
    assert stats.tolist() == pytest.approx([4 * math.log(2)], rel=1e-6)
