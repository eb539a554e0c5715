"""Shared by the serving tests: a tiny random model and tokenizer, saved as a raychat checkpoint."""

from __future__ import annotations

import inspect
import json
import textwrap

import torch

from raychat.checkpoint import save_model
from raychat.model import GPT, ModelConfig
from raychat.tokenizer import Tokenizer


def tiny_model_and_tokenizer(seed: int = 0, max_seq_len: int = 256) -> tuple[GPT, Tokenizer]:
    """A 2-layer model over a 600-token BPE trained on two stdlib sources; every weight random (scale 0.3)
    so greedy argmax margins are wide and batched decoding picks the same tokens as solo decoding."""
    tokenizer = Tokenizer.train([inspect.getsource(json), inspect.getsource(textwrap)], vocab_size=600)
    cfg = ModelConfig(vocab_size=tokenizer.vocab_size, n_layer=2, n_embd=64, n_head=4, n_kv_head=2, head_dim=16,
                      intermediate_size=128, max_seq_len=max_seq_len)  # fmt: skip
    model = GPT(cfg)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.3 + (1.0 if p.ndim == 1 else 0.0))
    return model.eval(), tokenizer


def write_tiny_checkpoint(directory, seed: int = 0, max_seq_len: int = 256, stage: str = "test"):
    """A committed checkpoint of a random tiny model (meta and commit marker: step 0, `stage`)."""
    model, tokenizer = tiny_model_and_tokenizer(seed, max_seq_len)
    save_model(directory, model, tokenizer, {"step": 0, "stage": stage}, commit=True)
    return directory


USAGE = {"prompt_tokens": 5, "completion_tokens": 4, "total_tokens": 9, "ttft_s": 0.01}
HELLO = [
    {"type": "delta", "text": "Hel", "tokens": 1, "logprobs": None},
    {"type": "delta", "text": "", "tokens": 1, "logprobs": None},
    {"type": "delta", "text": "lo\nworld", "tokens": 2, "logprobs": None},
    {"type": "done", "finish_reason": "stop", "usage": USAGE},
]


class FakeEngine:
    """Scripted engine client (the ingress' client protocol): every generate() yields `script` events
    (a callable script gets the request), and it records requests and closes. `fail` is raised instead of
    the event at that position (an exception escaping the engine client)."""

    def __init__(self, script=None, fail: dict | None = None, model_id: str = "tiny"):
        self.script = HELLO if script is None else script
        self.fail = fail or {}
        self.model_id = model_id
        self.requests, self.closed = [], 0

    async def info(self):
        from raychat.chat_template import TEMPLATE_VERSION

        return {"model_id": self.model_id, "template_version": TEMPLATE_VERSION, "tokenizer_version": "abc",
                "max_seq_len": 256}  # fmt: skip

    async def stats(self):
        return {"in_flight": 0}

    async def check(self, requests):
        return None  # refuses nothing: the script's events answer each request

    async def generate(self, request):
        self.requests.append(request)
        script = self.script(request) if callable(self.script) else self.script
        try:
            for i, ev in enumerate(script):
                if i in self.fail:
                    raise self.fail[i]
                yield ev
        finally:
            self.closed += 1
