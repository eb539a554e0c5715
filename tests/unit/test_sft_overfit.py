"""SFT on a tiny batch with the real template, packing, masks, loss and optimizers: the loss goes to ~0 and
greedy generation reproduces each reply and stops with <|assistant_end|>."""

import json

import torch

from raychat.chat_template import render_for_completion
from raychat.config import TrainConfig, from_dict
from raychat.config.train import OptimSection
from raychat.data.loader.sample_packing import SamplePacker, render_samples, rows_to_batch
from raychat.data.loader.sft_rows import SFTRows, run_epochs
from raychat.engine import ModelRunner
from raychat.loss import cross_entropy_sum, global_target_count, normalize
from raychat.model import GPT, ModelConfig
from raychat.tasks.sft_data import SFTData
from raychat.train.launch import held_out_line
from raychat.train.optim import build_optimizers
from raychat.train.sft import epochs_line, sft_defaults

CONVERSATIONS = [
    [{"role": "user", "content": "Hello there!"}, {"role": "assistant", "content": "Hi. How are you?"}],
    [{"role": "user", "content": "What is 12 * 34?"}, {"role": "assistant", "content": "It is 408."}],
    [{"role": "user", "content": "Spell apple"}, {"role": "assistant", "content": "a-p-p-l-e"}],
    [{"role": "user", "content": "Which planet is red?"}, {"role": "assistant", "content": "Mars."}],
]


def test_tiny_batch_overfits_and_generation_reproduces_the_replies(small_tokenizer):
    tok = small_tokenizer
    torch.manual_seed(0)
    model = GPT(ModelConfig.from_depth(2, tok.vocab_size, 64, aspect_ratio=64, head_dim=32)).init_weights(0)
    row_len = 65
    items = list(render_samples(tok, ((str(i), c) for i, c in enumerate(CONVERSATIONS)), row_len))
    rows = list(SamplePacker.from_items(items, row_len, pad_id=tok.bos_id))
    assert sum(len(r["sample_ids"]) for r in rows) == 4 and len(rows) < 4  # packed, several samples a row
    batch = rows_to_batch(
        {
            k: torch.stack([torch.as_tensor(r[k]) for r in rows])
            for k in ("input_ids", "supervised", "segment_ids")
        },
        tok.bos_id,
    )
    cfg = OptimSection(matrix_lr=0.02, embedding_lr=0.2, unembedding_lr=0.02, scalar_lr=0.02)
    optimizers = build_optimizers(model, cfg)
    n = global_target_count([batch["loss_mask"]])
    for _ in range(150):
        logits = model(
            batch["input_ids"], position_ids=batch["position_ids"], segment_ids=batch["segment_ids"]
        )
        loss_sum, _ = cross_entropy_sum(logits, batch["labels"], batch["loss_mask"])
        normalize(loss_sum, n).backward()
        for opt in optimizers:
            opt.step()
            opt.zero_grad(set_to_none=True)
    assert loss_sum.item() / n < 0.05

    engine = ModelRunner(model.eval(), tok)
    prompts = [render_for_completion(tok, c[:1]) for c in CONVERSATIONS]
    results = engine.generate_batch(prompts, max_tokens=24, temperature=0.0)
    end = tok.special_id("<|assistant_end|>")
    for conv, r in zip(CONVERSATIONS, results):
        assert r.text == conv[1]["content"]
        assert r.completion_tokens[-1] == end and r.finish_reason == "stop"


def _chats(path, answers):
    """A JSON-lines file of one-exchange conversations "red?" -> answer."""
    chat = lambda a: {"messages": [{"role": "user", "content": "red?"}, {"role": "assistant", "content": a}]}  # noqa: E731
    path.write_text("".join(json.dumps(chat(a)) + "\n" for a in answers))
    return str(path)


def test_the_epochs_of_a_run_are_counted_by_hand(small_tokenizer, tmp_path):
    """A tiny SFT trial made ~80 epochs of its 19 conversations and nothing said so (its held-out BPB rose as the
    model memorized them). "red?" -> " Mars." renders to 10 tokens (BOS, <|user_start|>, "re" "d" "?",
    <|user_end|>, <|assistant_start|>, " Mars" ".", <|assistant_end|>): a row of 20 holds two. 4 of them fill 2
    rows an epoch, so 12 rows make 6 epochs, 100 rows (sampled: 64 rows, 128 conversations) 50; a fifth
    conversation too long for a row (skipped, as SFTRows skips it) is still one of the epoch's 5 stream items:
    12 rows (2 a row: it is in none) go through the 5 six times."""
    tok = small_tokenizer
    assert len(tok.encode("red?")) == 3 and len(tok.encode(" Mars.")) == 2
    four = SFTData(_chats(tmp_path / "four.jsonl", [" Mars."] * 4))
    rows = SFTRows([four], 0, tok, 20)
    assert run_epochs(rows, 12) == (6, 2) and run_epochs(rows, 100) == (50, 2)
    five = SFTData(_chats(tmp_path / "five.jsonl", [" Mars."] * 4 + [" Mars." * 10]))
    assert run_epochs(SFTRows([five], 0, tok, 20), 12) == (6, 2)
    tok.save(tmp_path / "tok")
    cfg = from_dict(TrainConfig, {
        "sft_tasks": "", "sft_data": str(tmp_path / "four.jsonl"), "sft_test_size": 0, "seq_len": 19,
        "num_workers": 1, "device_batch_size": 2, "total_batch_size": 76, "num_iterations": 3,
        "tokenizer_path": str(tmp_path / "tok"),
    }, base=sft_defaults())  # fmt: skip
    assert epochs_line(cfg, tok) == (
        "sft data: the run's 12 rows of 20 tokens hold ~24 conversations: ~6 epochs of its mixture's 4 training "
        "conversations (~2 a row): from the second epoch on the same conversations repeat, so a held-out val_bpb "
        "that rises while the loss falls is the model memorizing them"
    )


def test_the_epochs_line_counts_only_the_conversations_the_rows_hold(small_tokenizer, tmp_path):
    """A conversation too long for a row is skipped: it is one of the epoch's 5 (6 epochs, as above) but no row
    holds it. The line said the 12 rows of 20 tokens "hold ~30 conversations (~2.5 a row)" (6 x 5); they hold
    24, 2 a row (a row of 20 holds two 10-token ones); of 100 with 99 too long, "~2,400 (~200 a row)"."""
    tok = small_tokenizer
    tok.save(tmp_path / "tok")
    five = _chats(tmp_path / "five.jsonl", [" Mars."] * 4 + [" Mars." * 10])
    cfg = from_dict(TrainConfig, {
        "sft_tasks": "", "sft_data": five, "sft_test_size": 0, "seq_len": 19, "num_workers": 1,
        "device_batch_size": 2, "total_batch_size": 76, "num_iterations": 3, "tokenizer_path": str(tmp_path / "tok"),
    }, base=sft_defaults())  # fmt: skip
    assert epochs_line(cfg, tok).startswith(
        "sft data: the run's 12 rows of 20 tokens hold ~24 conversations: ~6 epochs of its mixture's 5 training "
        "conversations (~2 a row): "
    )


def test_the_line_after_the_final_metrics_names_the_step_of_the_best_held_out_bpb():
    """The trial's sft-data_val_bpb went 5.71 -> 8.49 and the run ended with its final metrics alone. Now a line
    names each held-out BPB's best step, and when one rose after it, what that means and which checkpoint holds
    that step (val_bpb, the same numbers as a single task's, is left out)."""
    logged = [
        {"step": 1, "loss": 3.0},
        {"step": 2, "loss": 2.0, "sft-data_val_bpb": 5.71, "val_bpb": 5.71},
        {"step": 4, "loss": 1.0, "sft-data_val_bpb": 5.5, "val_bpb": 5.5},
        {"step": 6, "loss": 0.5, "sft-data_val_bpb": 8.49, "val_bpb": 8.49},
    ]
    kept = {4: "/runs/s/checkpoint_000004", 6: "/runs/s/checkpoint_000006"}
    head = "held-out BPB: sft-data_val_bpb best 5.5000 at step 4, 8.4900 at the end (step 6)"
    tail = (
        ": sft-data_val_bpb rose after step 4 while training went on: the model learned its training data rather "
        "than what carries over to held-out data (overfitting: fewer steps or more data); "
    )
    assert held_out_line(logged, kept) == head + tail + "checkpoint /runs/s/checkpoint_000004 holds step 4"
    assert held_out_line(logged, {6: kept[6]}) == (
        head + tail + "no checkpoint of step 4 is kept (--checkpoint-every, --keep-checkpoints)"
    )
    two = [{**row, "calculator_val_bpb": 9 - row["step"]} for row in logged if "val_bpb" in row]
    assert held_out_line(two, kept).startswith(
        "held-out BPB: sft-data_val_bpb best 5.5000 at step 4, 8.4900 at the end (step 6); val_bpb best 5.5000 "
        "at step 4, 8.4900 at the end (step 6); calculator_val_bpb best 3.0000 at the end (step 6): val_bpb rose "
        "after step 4"
    )
    falling = [row for row in logged if row["step"] < 6]
    assert held_out_line(falling, kept) == "held-out BPB: sft-data_val_bpb best 5.5000 at the end (step 4)"
    assert held_out_line(logged[:2], kept) is None  # measured once: nothing to compare


def test_a_held_out_bpb_that_ends_at_its_best_value_did_not_rise():
    """A BPB equal at its last two evaluations (5.5 at steps 4 and 6) was named "best at step 4, 5.5000 at the
    end: rose after step 4 ... overfitting": a tie is best at the end, and nothing rose."""
    logged = [
        {"step": 2, "loss": 2.0, "sft-data_val_bpb": 5.71},
        {"step": 4, "loss": 1.0, "sft-data_val_bpb": 5.5},
        {"step": 6, "loss": 0.5, "sft-data_val_bpb": 5.5},
    ]
    assert held_out_line(logged, {4: "/runs/s/checkpoint_000004"}) == (
        "held-out BPB: sft-data_val_bpb best 5.5000 at the end (step 6)"
    )
