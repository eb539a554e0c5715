"""A tiny GPT trained here to make calculator calls: what the tool-call, contract and fuzzing tests serve.

`train_tool_model()` overfits a 2-layer model on CONVERSATIONS (a two-turn calculator conversation and a
story) with the real chat template, so greedy decoding reproduces every assistant turn token for token:
turn 1 calls the calculator, the engine injects its result, and turn 2 (prompted with turn 1 sent back as
history) does the same. ~3 s on an idle 2-core machine.
"""

from __future__ import annotations

import inspect
import json

import torch

from raychat.chat_template import render_conversation
from raychat.checkpoint import save_model
from raychat.model import GPT, ModelConfig
from raychat.tokenizer import Tokenizer

STORY = (
    "Once upon a time a small model learned to add numbers, and every evening it counted the stars "
    "over the quiet town until the morning came back again."
)


def calculator_turn(expression: str, result: str) -> list[dict]:
    return [
        {"type": "text", "text": "Let me compute it. "},
        {"type": "python", "text": expression},
        {"type": "python_output", "text": result},
        {"type": "text", "text": f"#### {result}"},
    ]


CONVERSATIONS = [
    [
        {"role": "user", "content": "What is 47 * 12?"},
        {"role": "assistant", "content": calculator_turn("47 * 12", "564")},
        {"role": "user", "content": "And 5 + 6?"},
        {"role": "assistant", "content": calculator_turn("5 + 6", "11")},
    ],
    [{"role": "user", "content": "Tell me a story."}, {"role": "assistant", "content": STORY}],
]


def train_tool_model(steps: int = 120, seed: int = 0, max_seq_len: int = 256) -> tuple[GPT, Tokenizer]:
    tokenizer = Tokenizer.train([inspect.getsource(json), STORY * 4], vocab_size=600)
    cfg = ModelConfig(vocab_size=tokenizer.vocab_size, n_layer=2, n_embd=64, n_head=4, n_kv_head=2,
                      head_dim=16, intermediate_size=192, max_seq_len=max_seq_len)  # fmt: skip
    torch.manual_seed(seed)
    model = GPT(cfg).init_weights(seed)
    rendered = [render_conversation(tokenizer, c) for c in CONVERSATIONS]
    width = max(len(r.ids) for r in rendered)
    ids = torch.tensor([r.ids + [tokenizer.bos_id] * (width - len(r.ids)) for r in rendered])
    mask = torch.tensor([r.supervised[1:] + [0] * (width - len(r.ids)) for r in rendered], dtype=torch.bool)
    opt = torch.optim.AdamW(model.parameters(), lr=5e-3, weight_decay=0.0)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # this small a model gains nothing from 2 threads, and on a busy machine 2 spin
    try:
        for _ in range(steps):  # one batch of both conversations (right-padded, padding unsupervised)
            logits = model(ids[:, :-1])
            loss = torch.nn.functional.cross_entropy(logits[mask], ids[:, 1:][mask])
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
    finally:
        torch.set_num_threads(threads)
    return model.eval(), tokenizer


def write_tool_checkpoint(directory, **kwargs):
    model, tokenizer = train_tool_model(**kwargs)
    save_model(directory, model, tokenizer, {"step": 0, "stage": "test-tool-model"}, commit=True)
    return directory
