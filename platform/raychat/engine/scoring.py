"""Prompt logprobs: how likely the model finds each token of a given sequence (OpenAI legacy completions'
`echo` + `logprobs`, the log-likelihood requests of evaluation harnesses such as lm-evaluation-harness).

One causal forward over the whole sequence, no KV cache: the logits at position i - 1 predict token i, so
token i's logprob is log_softmax(logits[i - 1])[ids[i]] (the chain rule of a causal LM:
log p(ids) = sum_i log p(ids[i] | ids[:i])). The first token has nothing before it: its entry is None.
The distribution is the model's raw one (no temperature, no top-k/top-p), fp32.
"""

from __future__ import annotations

import torch

from raychat.engine.attention import to_device
from raychat.engine.stream import TokenLogprob


@torch.inference_mode()
def prompt_logprobs(model, ids: list[int], top_logprobs: int = 0) -> list[TokenLogprob | None]:
    """Each token's logprob given the tokens before it, with the `top_logprobs` most likely alternatives.

    Args:
        model: a raychat GPT (or anything with its forward: (1, T) int64 ids, position_ids= -> (1, T, V)
            logits), eval mode.
        ids: the sequence, T >= 1 token ids (the caller checks range and length).
        top_logprobs: alternatives per position, >= 0 (torch.topk: largest first).
    Returns:
        T entries: None for ids[0], then TokenLogprob(ids[i], ln p(ids[i] | ids[:i]), [(token_id, logprob),
        ...] most likely first) for i >= 1. Memory: one (T, V) fp32 logits tensor.
    Raises:
        ValueError: empty ids or top_logprobs < 0.
        RuntimeError: the model's logits hold NaN or +inf (the caller ends that request alone).
    """
    if not ids:
        raise ValueError("ids is empty; scoring needs at least one token")
    if not isinstance(top_logprobs, int) or top_logprobs < 0:
        raise ValueError(f"top_logprobs must be an int >= 0, got {top_logprobs!r}")
    device = next(iter(model.parameters()), torch.empty(0)).device
    x = to_device(torch.tensor([ids], dtype=torch.long), device)
    positions = to_device(torch.arange(len(ids))[None], device)
    logits = model(x, position_ids=positions)[0, :-1].float()  # (T - 1, V): position i - 1 predicts token i
    if bool(torch.isnan(logits).any()) or bool(torch.isposinf(logits).any()):
        raise RuntimeError("non-finite logits (NaN or +inf) while scoring the prompt")
    logp = torch.log_softmax(logits, dim=-1)
    target = torch.tensor(ids[1:], dtype=torch.long, device=logp.device)
    chosen = logp.gather(1, target[:, None])[:, 0].cpu().tolist()
    k = min(top_logprobs, logp.shape[-1])
    top_v, top_i = (t.cpu().tolist() for t in logp.topk(k, dim=-1)) if k else ([[]] * len(chosen),) * 2
    out: list[TokenLogprob | None] = [None]
    for token, lp, values, indices in zip(ids[1:], chosen, top_v, top_i):
        out.append(TokenLogprob(token, lp, list(zip(indices, values))))
    return out
