"""Next-token sampling: greedy, temperature, top-k and top-p (nucleus), with an explicit torch.Generator.

Order of operations (as Hugging Face `generate`): logits / temperature -> keep the top_k largest ->
keep the smallest set of tokens whose probability mass reaches top_p (Holtzman et al. 2020, "The Curious
Case of Neural Text Degeneration") -> sample from softmax. temperature == 0 is greedy (argmax; ties go to
the lowest id). Each row of `logits` is an independent draw: rows never share a sample.
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass, field

import torch


def make_generator(seed: int | None, device: str | torch.device = "cpu") -> torch.Generator:
    """A torch.Generator on `device`, seeded with `seed` (None: 63 random bits from the OS)."""
    gen = torch.Generator(device=device)
    gen.manual_seed(secrets.randbits(63) if seed is None else int(seed))
    return gen


def validate(temperature: float, top_k: int | None, top_p: float | None) -> None:
    """Raise ValueError naming the field if temperature < 0, top_k < 0 or top_p outside (0, 1]."""
    if not temperature >= 0:
        raise ValueError(f"temperature must be >= 0 (0 = greedy), got {temperature}")
    if top_k is not None and top_k < 0:
        raise ValueError(f"top_k must be None or >= 0 (0/None = off), got {top_k}")
    if top_p is not None and not 0 < top_p <= 1:
        raise ValueError(f"top_p must be None or in (0, 1] (1/None = off), got {top_p}")


def filter_logits(logits: torch.Tensor, top_k: int | None, top_p: float | None) -> torch.Tensor:
    """Set logits outside top_k / the top_p nucleus to -inf. logits: (n, V) float; returns a new tensor.

    The nucleus always keeps the most likely token (so top_p never leaves a row empty).
    """
    logits = logits.clone()
    V = logits.shape[-1]
    if top_k and top_k < V:
        kth = torch.topk(logits, top_k, dim=-1).values[:, -1:]
        logits[logits < kth] = float("-inf")
    if top_p is not None and top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        probs = torch.softmax(sorted_logits, dim=-1)
        mass_before = torch.cumsum(probs, dim=-1) - probs
        remove_sorted = mass_before >= top_p  # first token has mass_before 0 < top_p: always kept
        remove = torch.zeros_like(remove_sorted).scatter(-1, order, remove_sorted)
        logits[remove] = float("-inf")
    return logits


def sample_next(
    logits: torch.Tensor,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """Sample one token per row.

    Args:
        logits: (n, V) float logits (any float dtype; computed in fp32).
        temperature: >= 0; 0 = greedy.
        top_k: None/0 = off, else keep the k most likely tokens.
        top_p: None/1 = off, else nucleus mass in (0, 1].
        generator: torch.Generator on logits.device; rows draw independently from it.
    Returns:
        (n,) int64 token ids.
    Raises:
        ValueError: invalid temperature / top_k / top_p (see `validate`).
    """
    validate(temperature, top_k, top_p)
    if logits.ndim != 2:
        raise ValueError(f"logits must be (n, V), got shape {tuple(logits.shape)}")
    logits = logits.float()
    if temperature == 0:
        return torch.argmax(logits, dim=-1)
    logits = filter_logits(logits / temperature, top_k, top_p)
    probs = torch.softmax(logits, dim=-1)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


@dataclass(frozen=True)
class SamplingParams:
    """How one request generates.

    Fields:
        max_tokens: completion tokens at most (sampled and forced tool-output tokens), >= 1.
        temperature: >= 0; 0 = greedy.
        top_k: None/0 = off, else >= 1.
        top_p: None/1.0 = off, else in (0, 1].
        seed: int seeds the request's torch.Generator; None = fresh OS entropy.
        stop: stop strings; generation ends when the completion text contains one (never emitted).
    Raises:
        ValueError: a field outside its allowed values (the message names it).
    """

    max_tokens: int = 256
    temperature: float = 1.0
    top_k: int | None = None
    top_p: float | None = None
    seed: int | None = None
    stop: tuple[str, ...] = field(default=())

    def __post_init__(self):
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        else:
            object.__setattr__(self, "stop", tuple(self.stop))
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be an int >= 1, got {self.max_tokens!r}")
        validate(self.temperature, self.top_k, self.top_p)
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise ValueError(f"stop must be non-empty strings, got {self.stop!r}")
