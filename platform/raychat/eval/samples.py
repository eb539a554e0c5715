"""Greedy samples from fixed prompts, printed at every evaluation to watch the model learn."""

from __future__ import annotations

import torch

from raychat.model import eval_mode

PROMPTS = (
    "The capital of France is",
    "A function in Python is defined with",
    "The opposite of hot is",
    "A dictionary is",
)


@torch.no_grad()
def greedy_samples(model, tokenizer, prompts=PROMPTS, max_tokens: int = 24, device="cpu") -> list[str]:
    """Complete each prompt greedily (full forward per token: monitoring only; serving uses raychat.engine)."""
    with eval_mode(model):
        out = []
        limit = model.config.max_seq_len
        for prompt in prompts:
            ids = tokenizer.encode(prompt, prepend_bos=True)
            for _ in range(max_tokens):
                logits = model(torch.tensor([ids[-limit:]], device=device))
                nxt = int(logits[0, -1].argmax())
                if nxt == tokenizer.bos_id:
                    break
                ids.append(nxt)
            out.append(tokenizer.decode(ids[1:]))
    return out
