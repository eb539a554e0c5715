"""SFT on a tiny batch with the real template, packing, masks, loss and optimizers: the loss goes to ~0 and
greedy generation reproduces each reply and stops with <|assistant_end|>."""

import torch

from raychat.chat_template import render_for_completion
from raychat.config.train import OptimSection
from raychat.data.loader.sample_packing import SamplePacker, render_samples, rows_to_batch
from raychat.engine import ModelRunner
from raychat.loss import cross_entropy_sum, global_target_count, normalize
from raychat.model import GPT, ModelConfig
from raychat.train.optim import build_optimizers

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
