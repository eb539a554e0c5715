"""Next-token sampling: greedy, temperature, top-k and top-p (nucleus), batched, numerically safe.

Order of operations (as Hugging Face `generate`): logits / temperature -> keep the top_k largest ->
keep the smallest set of tokens whose probability mass reaches top_p (Holtzman et al. 2020, "The Curious
Case of Neural Text Degeneration") -> sample from softmax. A temperature below TEMPERATURE_EPS (1e-5, as
vLLM's _SAMPLING_EPS) is greedy: argmax of the raw logits, ties to the lowest id, no random draw. Each row
is an independent draw.

The draw is torch.multinomial's own algorithm for one sample (the exponential race: argmax of probs / q
with q ~ Exp(1) drawn by `torch.empty_like(probs).exponential_(1, generator)`, see ATen's
Distributions.cpp), written out so a whole batch samples with per-row parameters and no host sync: the
noise of every generator is drawn in the same shapes multinomial drew it, so the same seeds give the same
tokens as per-row `multinomial` calls.

`SamplingBatch` collects one row per sequence (its parameters, generator, forced token, logprobs wanted)
and `sample(logits)` returns every row's token, error and logprobs with ONE device-to-host transfer.
Safety (per row, never affecting other rows): logits containing NaN or +inf, or no finite logit at all,
end that row with an error; a finite row whose logits / temperature overflows to inf is sampled greedily
(the limit of the distribution as temperature -> 0); -inf logits are valid (probability 0).

Logprobs (OpenAI's `logprobs` / `top_logprobs`): log_softmax of the temperature-scaled logits BEFORE top-k
/ top-p filtering (for greedy rows, and rows sampled greedily because of overflow, of the raw logits),
fp32. A token removed by top-k/top-p still has its
finite logprob under this distribution; the chosen token's logprob is its entry; top_logprobs are the
largest entries (ties to the lower id). Forced tool-output tokens get their logprob from the same
distribution although the model did not sample them.
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass, field

import torch

from raychat.engine.attention import to_device

TEMPERATURE_EPS = 1e-5
MAX_TOP_LOGPROBS = 20


def make_generator(seed: int | None, device: str | torch.device = "cpu") -> torch.Generator:
    """A torch.Generator on `device`, seeded with `seed` (None: 63 random bits from the OS)."""
    gen = torch.Generator(device=device)
    gen.manual_seed(secrets.randbits(63) if seed is None else int(seed))
    return gen


def is_greedy(temperature: float) -> bool:
    return temperature < TEMPERATURE_EPS


def validate(temperature: float, top_k: int | None, top_p: float | None) -> None:
    """Raise ValueError naming the field if temperature < 0 (or not finite), top_k < 0 or top_p outside
    (0, 1]."""
    if not 0 <= temperature < float("inf"):
        raise ValueError(f"temperature must be a finite number >= 0 (0 = greedy), got {temperature}")
    if top_k is not None and top_k < 0:
        raise ValueError(f"top_k must be None or >= 0 (0/None = off), got {top_k}")
    if top_p is not None and not 0 < top_p <= 1:
        raise ValueError(f"top_p must be None or in (0, 1] (1/None = off), got {top_p}")


def _filter(logits: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor | None, kmax: int = 0):
    """Per-row top-k / top-p: logits (n, V) fp32; top_k (n,) int64 (0 = off) or None, kmax its largest
    value (given by the caller: reading it from the device would sync); top_p (n, 1) fp32 (>= 1 = off)
    or None. Returns a new tensor with the removed entries at -inf; the most likely token always stays."""
    if top_k is not None and logits.device.type == "cpu" and kmax < logits.shape[-1]:
        kept = _filter_candidates(logits, top_k, top_p, kmax)
        if kept is not None:
            return kept
    if top_k is not None:
        V = logits.shape[-1]
        k = top_k.clamp(max=V)
        kth = torch.topk(logits, min(kmax, V), dim=-1).values.gather(1, (k - 1).clamp(min=0)[:, None])
        logits = logits.masked_fill((logits < kth) & (k[:, None] > 0), float("-inf"))
    if top_p is not None:
        V = logits.shape[-1]
        width = V
        if top_k is not None and logits.device.type == "cpu" and bool((top_k > 0).all()):
            # every row kept at most ~top_k tokens: sort those, not the vocabulary (a CPU sort of 4096
            # logits costs ~0.2 ms a row). The width is a multiple of 64 so the softmax's vectorized sum
            # runs over the same lanes as over V (the rest are -inf: exp 0): bitwise the same probs.
            survivors = int((logits > float("-inf")).sum(-1).max())
            width = min(V, -(-survivors // 64) * 64)
        if width < V:  # ties in ascending id order (the full sort leaves their order unspecified)
            cand = torch.sort(torch.topk(logits, width, dim=-1, sorted=False).indices, dim=-1).values
            sorted_logits, pos = torch.sort(logits.gather(1, cand), dim=-1, descending=True, stable=True)
            order = cand.gather(1, pos)
        else:
            sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        probs = torch.softmax(sorted_logits, dim=-1)
        mass_before = torch.cumsum(probs, dim=-1) - probs
        remove_sorted = mass_before >= top_p  # first token has mass_before 0 < top_p: always kept
        remove = torch.zeros(logits.shape, dtype=torch.bool, device=logits.device)
        remove.scatter_(-1, order, remove_sorted)
        logits = logits.masked_fill(remove, float("-inf"))
    return logits


def _filter_candidates(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor | None, kmax: int):
    """`_filter` for rows that all have top_k > 0, working on the W = kmax rounded up to 64 largest logits of
    each row only (one topk, then sorts of W entries), the same result bitwise (the top-p softmax runs on
    the same values in the same order, padded with -inf to a multiple of 64 lanes as the full path's).
    Returns None when it does not apply: a row without top-k, or ties at a row's k-th value that reach past
    the W candidates (the full path keeps every tie)."""
    V = logits.shape[-1]
    if not bool((top_k > 0).all()):
        return None
    W = min(V, -(-kmax // 64) * 64)
    vals, idx = torch.topk(logits, W, dim=-1)  # descending; order among equal values unspecified
    kth = vals.gather(1, (top_k.clamp(max=V) - 1)[:, None])
    if W < V and bool((vals[:, -1:] >= kth).any()):
        return None
    vals = vals.masked_fill(vals < kth, float("-inf"))
    if top_p is not None:  # order the candidates by (logit desc, id asc) as the full path does
        ids, by_id = torch.sort(idx, dim=-1)
        vals, pos = torch.sort(vals.gather(1, by_id), dim=-1, descending=True, stable=True)
        idx = ids.gather(1, pos)
        probs = torch.softmax(vals, dim=-1)
        mass_before = torch.cumsum(probs, dim=-1) - probs
        vals = vals.masked_fill(mass_before >= top_p, float("-inf"))  # the first token always stays
    return torch.full_like(logits, float("-inf")).scatter_(1, idx, vals)


def filter_logits(logits: torch.Tensor, top_k: int | None, top_p: float | None) -> torch.Tensor:
    """Set logits outside top_k / the top_p nucleus to -inf. logits: (n, V) float; returns a new tensor.

    The nucleus always keeps the most likely token (so top_p never leaves a row empty).
    """
    n = logits.shape[0]
    k = torch.full((n,), int(top_k), device=logits.device) if top_k else None
    p = torch.full((n, 1), float(top_p), device=logits.device) if top_p is not None and top_p < 1 else None
    return _filter(logits.clone(), k, p, int(top_k or 0))


def sample_next(
    logits: torch.Tensor,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """Sample one token per row (all rows share the parameters and draw from one generator).

    Args:
        logits: (n, V) float logits (any float dtype; computed in fp32).
        temperature: >= 0; below TEMPERATURE_EPS = greedy.
        top_k: None/0 = off, else keep the k most likely tokens.
        top_p: None/1 = off, else nucleus mass in (0, 1].
        generator: torch.Generator on logits.device (None: torch's default generator).
    Returns:
        (n,) int64 token ids, on logits.device (no host sync).
    Raises:
        ValueError: invalid temperature / top_k / top_p (see `validate`), logits not (n, V).
    """
    validate(temperature, top_k, top_p)
    if logits.ndim != 2:
        raise ValueError(f"logits must be (n, V), got shape {tuple(logits.shape)}")
    logits = logits.float()
    if is_greedy(temperature):
        return torch.argmax(logits, dim=-1)
    probs = torch.softmax(filter_logits(logits / temperature, top_k, top_p), dim=-1)
    return torch.argmax(probs / torch.empty_like(probs).exponential_(1, generator=generator), dim=-1)


@dataclass(frozen=True)
class SamplingParams:
    """How one request generates.

    Fields:
        max_tokens: completion tokens at most (sampled and forced tool-output tokens), >= 1.
        temperature: finite, >= 0; below TEMPERATURE_EPS (1e-5) = greedy.
        top_k: None/0 = off, else >= 1.
        top_p: None/1.0 = off, else in (0, 1].
        seed: int seeds the request's torch.Generator; None = fresh OS entropy.
        stop: stop strings; generation ends when the completion text contains one (never emitted).
        logprobs: return each completion token's logprob (module docstring: which distribution).
        top_logprobs: 0..20 most likely alternatives per token as well; needs logprobs=True.
    Raises:
        ValueError: a field outside its allowed values (the message names it).
    """

    max_tokens: int = 256
    temperature: float = 1.0
    top_k: int | None = None
    top_p: float | None = None
    seed: int | None = None
    stop: tuple[str, ...] = field(default=())
    logprobs: bool = False
    top_logprobs: int = 0

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
        if not isinstance(self.logprobs, bool):
            raise ValueError(f"logprobs must be a bool, got {self.logprobs!r}")
        if not isinstance(self.top_logprobs, int) or not 0 <= self.top_logprobs <= MAX_TOP_LOGPROBS:
            raise ValueError(
                f"top_logprobs must be an int in 0..{MAX_TOP_LOGPROBS}, got {self.top_logprobs!r}"
            )
        if self.top_logprobs and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs=True")


@dataclass(frozen=True)
class Sampled:
    """One row's result: token id (-1 when error is set), error message or None, the chosen token's
    logprob and the top alternatives [(token_id, logprob), ...] when the row asked for logprobs."""

    token: int
    error: str | None = None
    logprob: float | None = None
    top_logprobs: list[tuple[int, float]] | None = None


class SamplingBatch:
    """Rows to sample in one step. `add` one row per sequence, then `sample(logits)` once.

    Rows that share a generator draw their noise in one call, in the order they were added (as one
    multinomial call over those rows did).
    """

    def __init__(self):
        self.temperature: list[float] = []
        self.top_k: list[int] = []
        self.top_p: list[float] = []
        self.forced: list[int] = []
        self.num_logprobs: list[int] = []  # -1 = no logprobs
        self._draws: dict[int, tuple[torch.Generator | None, list[int]]] = {}

    def __len__(self) -> int:
        return len(self.forced)

    def add(
        self,
        temperature: float,
        top_k: int | None,
        top_p: float | None,
        generator: torch.Generator | None,
        forced: int | None = None,
        logprobs: bool = False,
        top_logprobs: int = 0,
    ) -> int:
        """Add a row; returns its index. forced: the token this row takes without sampling (tool output)."""
        i = len(self.forced)
        greedy = is_greedy(temperature)
        self.temperature.append(1.0 if greedy else float(temperature))
        self.top_k.append(0 if greedy or not top_k else int(top_k))
        self.top_p.append(2.0 if greedy or top_p is None or top_p >= 1 else float(top_p))
        self.forced.append(-1 if forced is None else int(forced))
        self.num_logprobs.append(int(top_logprobs) if logprobs else -1)
        if forced is None and not greedy:
            self._draws.setdefault(id(generator), (generator, []))[1].append(i)
        return i

    def sample(self, logits: torch.Tensor) -> list[Sampled]:
        """logits: (len(self), V) rows in the order added (any float dtype, any device). One D2H copy."""
        n, V = logits.shape
        if n != len(self):
            raise ValueError(f"logits has {n} rows for {len(self)} sampling rows")
        dev = logits.device
        logits = logits.float()
        # Exp(1) draws of the sampled rows, in one (n, V) tensor: a generator's rows that are consecutive
        # draw straight into their slice (the same numbers as a fresh tensor: exponential_ fills a
        # contiguous block in order); other rows keep 1 (dividing by it changes nothing)
        num_sampled = sum(len(rows) for _, rows in self._draws.values())
        noise = (torch.empty if num_sampled == n else torch.ones)((n, V), device=dev) if num_sampled else None
        drawn = [False] * n
        errors: dict[int, str] = {}
        for generator, rows in self._draws.values():
            try:
                if rows[-1] - rows[0] == len(rows) - 1:
                    noise[rows[0] : rows[-1] + 1].exponential_(1, generator=generator)
                else:
                    q = torch.empty((len(rows), V), device=dev).exponential_(1, generator=generator)
                    noise[to_device(torch.tensor(rows), dev)] = q
            except RuntimeError as e:  # e.g. a generator on another device: those rows fail alone
                errors.update({r: f"invalid sampling state: {e}" for r in rows})
                continue
            for r in rows:
                drawn[r] = True
        rowmax, greedy_tok = logits.max(dim=-1)  # NaN propagates into rowmax; ties go to the lowest id
        bad = ~(rowmax < float("inf")) | (rowmax == float("-inf"))
        temp = to_device(torch.tensor(self.temperature, dtype=torch.float32), dev)
        scaled = logits / temp[:, None]
        overflow = torch.isposinf(rowmax / temp)  # = max of scaled: tiny temperature, greedy (T -> 0 limit)
        token = greedy_tok
        num_drawn = sum(drawn)
        if num_drawn:
            k = to_device(torch.tensor(self.top_k), dev) if any(self.top_k) else None
            p = to_device(torch.tensor(self.top_p)[:, None], dev) if min(self.top_p) < 1 else None
            probs = torch.softmax(_filter(scaled, k, p, max(self.top_k)), dim=-1)
            sampled = torch.argmax(probs / noise, dim=-1)
            if num_drawn == n:  # every row drew: only overflowing rows fall back to greedy
                token = torch.where(overflow, greedy_tok, sampled)
            else:
                mask = to_device(torch.tensor(drawn), dev)
                token = torch.where(mask & ~overflow, sampled, greedy_tok)
        if max(self.forced) >= 0:
            forced = to_device(torch.tensor(self.forced), dev)
            token = torch.where(forced >= 0, forced, token)
        cols = [token.double(), bad.double()]
        K = max(self.num_logprobs)
        if K >= 0:
            lp = torch.log_softmax(torch.where(overflow[:, None], logits, scaled), dim=-1)
            cols.append(lp.gather(1, token[:, None]).squeeze(1).double())
            if K > 0:
                top = torch.topk(lp, K, dim=-1)
                cols += [*top.indices.double().unbind(1), *top.values.double().unbind(1)]
        host = torch.stack(cols, dim=1).cpu().tolist()  # the one device-to-host transfer
        out = []
        for i, row in enumerate(host):
            if i in errors or row[1]:
                error = errors.get(i) or "non-finite logits (NaN, +inf, or no finite value) from the model"
                out.append(Sampled(-1, error))
                continue
            k = self.num_logprobs[i]
            lp = row[2] if k >= 0 else None
            top = [(int(row[3 + j]), row[3 + K + j]) for j in range(k)] if k > 0 else ([] if k == 0 else None)
            out.append(Sampled(int(row[0]), None, lp, top))
        return out
