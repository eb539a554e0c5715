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


def write_tiny_checkpoint(directory, seed: int = 0, max_seq_len: int = 256):
    model, tokenizer = tiny_model_and_tokenizer(seed, max_seq_len)
    save_model(directory, model, tokenizer, {"step": 0, "stage": "test"})
    return directory
