"""Shared builders for the engine tests: a byte-level tokenizer, a tiny random GPT, scripted stub models."""

from __future__ import annotations

import math
from types import SimpleNamespace

import torch
from torch import nn

from raychat.model import GPT, ModelConfig
from raychat.tokenizer import SPLIT_PATTERN, Tokenizer

# 256 single bytes, then two merged tokens used by the stop-string tests; specials follow (ids 258..266).
EXTRA_TOKENS = (b"DEF", b"HI")


def byte_tokenizer() -> Tokenizer:
    ranks = {bytes([i]): i for i in range(256)}
    for t in EXTRA_TOKENS:
        ranks[t] = len(ranks)
    return Tokenizer(SPLIT_PATTERN, ranks)


def tiny_gpt(tokenizer: Tokenizer, seed: int = 0, max_seq_len: int = 128) -> GPT:
    """depth 2, width 64, 4 query heads / 2 kv heads (GQA), fp32, every weight random (no identity blocks).

    The LM-head rows of special tokens are zero, so their logit is exactly 0 while ordinary tokens spread
    with std ~2: greedy decoding never picks a special token and runs to max_tokens.
    """
    cfg = ModelConfig(
        vocab_size=tokenizer.vocab_size,
        n_layer=2,
        n_embd=64,
        n_head=4,
        n_kv_head=2,
        head_dim=16,
        intermediate_size=128,
        max_seq_len=max_seq_len,
    )
    torch.manual_seed(seed)
    model = GPT(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.ndim == 1:
                p.copy_(1 + 0.1 * torch.randn_like(p))
            elif name == "model.embed_tokens.weight":
                p.normal_(0, 1)
            else:
                p.normal_(0, 1 / math.sqrt(p.shape[1]))
        model.lm_head.weight.mul_(2.0)
        model.lm_head.weight[list(tokenizer.special_tokens.values())] = 0
    return model.eval()


def reference_greedy(model: GPT, prompt: list[int], max_tokens: int, stop_ids: set[int]) -> list[int]:
    """No cache: a full forward over the whole sequence for every new token."""
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(max_tokens):
            logits = model(torch.tensor([ids]))
            nxt = int(torch.argmax(logits[0, -1]))
            ids.append(nxt)
            if nxt in stop_ids:
                break
    return ids[len(prompt) :]


class StubModel(nn.Module):
    """Model stand-in with a fixed next-token rule; writes nothing to the cache (the engine tracks lengths).

    `next_logits(position) -> (V,) tensor` gives the logits predicting the token at position + 1.
    """

    def __init__(self, vocab_size: int, next_logits, max_seq_len: int = 256):
        super().__init__()
        self.config = SimpleNamespace(
            vocab_size=vocab_size, n_layer=1, n_kv_head=1, head_dim=2, max_seq_len=max_seq_len
        )
        self.next_logits = next_logits
        self.calls: list[tuple[int, int]] = []  # (batch rows, T) per forward

    def forward(self, input_ids, position_ids=None, kv_cache=None, logits_at=None):
        B, T = input_ids.shape
        self.calls.append((B, T))
        out = torch.empty(B, T, self.config.vocab_size)
        for b in range(B):
            for t in range(T):
                out[b, t] = self.next_logits(int(position_ids[b, t]))
        return out if logits_at is None else out[torch.arange(B), logits_at]


def uniform_two_token_model(vocab_size: int, a: int, b: int) -> StubModel:
    """Every position: logits 0 for tokens a and b, -inf elsewhere (p = 1/2 each)."""
    row = torch.full((vocab_size,), float("-inf"))
    row[[a, b]] = 0.0
    return StubModel(vocab_size, lambda pos: row)


def scripted_model(
    vocab_size: int, script: dict[int, int], default: int, max_seq_len: int = 256
) -> StubModel:
    """Predicts script[p] as the token at position p (one-hot logit 10); `default` where unscripted."""

    def next_logits(pos: int) -> torch.Tensor:
        row = torch.zeros(vocab_size)
        row[script.get(pos + 1, default)] = 10.0
        return row

    return StubModel(vocab_size, next_logits, max_seq_len)


class PoisonModel(StubModel):
    """Predicts `token` everywhere, except for rows whose input holds `poison`: their logits are NaN
    (mode "nan"), or the whole forward raises torch.OutOfMemoryError (mode "oom"), as a real model on a
    GPU does when one long prefill does not fit."""

    def __init__(self, vocab_size: int, token: int, poison: int, mode: str, max_seq_len: int = 256):
        row = torch.full((vocab_size,), -5.0)
        row[token] = 5.0
        super().__init__(vocab_size, lambda pos: row, max_seq_len)
        self.poison, self.mode = poison, mode

    def forward(self, input_ids, position_ids=None, kv_cache=None, logits_at=None):
        poisoned = (input_ids == self.poison).any(dim=1)
        if self.mode == "oom" and bool(poisoned.any()):
            self.calls.append(tuple(input_ids.shape))
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB (simulated)")
        out = super().forward(input_ids, position_ids, kv_cache, logits_at)
        out[poisoned] = float("nan")
        return out
