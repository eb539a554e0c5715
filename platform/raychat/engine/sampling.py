"""Next-token sampling: greedy, temperature, top-k and top-p (nucleus), batched, numerically safe.

Order of operations (as Hugging Face `generate`): logits / temperature -> keep the top_k largest ->
keep the smallest set of tokens whose probability mass reaches top_p (Holtzman et al. 2020, "The Curious
Case of Neural Text Degeneration") -> sample from softmax. top_k keeps exactly k tokens: ties at the k-th
logit go to the lower token ids (as vLLM's sort-based top-k; Hugging Face keeps every tie). A temperature
below TEMPERATURE_EPS (1e-5, as vLLM's _SAMPLING_EPS) is greedy: argmax of the raw logits, ties to the
lowest id, no random draw. Each row is an independent draw.

The draw is the exponential race (torch.multinomial's algorithm for one sample: argmax of probs / q with
q ~ Exp(1), see ATen's Distributions.cpp), written out so a whole batch samples with per-row parameters and
one device-to-host transfer:
  - a row without top_k races over the whole vocabulary: its generator draws q of shape (rows, V), as
    `multinomial` did, so the same seeds give the same tokens as per-row `torch.multinomial` calls;
  - a row with top_k races over its k candidates only, taken in (logit descending, token id ascending)
    order: its generator draws q of shape (rows, k). The noise then scales with k instead of the vocabulary
    (drawing Exp(1) costs ~16 ns an entry on this CPU: ~1 ms a row a step at V = 65,536,
    bench/results/decode_overhead.md). The distribution is the same (every entry of q is i.i.d.); the
    tokens a seed gives differ from `multinomial`'s.
Rows that share a generator (one prompt's samples in `generate_batch`) draw one tensor, in the order they
were added; a row's draw depends on its own logits, parameters and generator only, never on which other
rows share the batch (on GPUs, one exception: `_top_k_candidates` on a tie that reaches past 64 candidates).

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


def _filter(logits: torch.Tensor, top_p: torch.Tensor | None) -> torch.Tensor:
    """Top-p over the whole vocabulary (the rows without top-k): logits (n, V) fp32, top_p (n, 1) fp32 (>= 1 =
    off) or None. Returns the logits with the tokens outside each row's nucleus at -inf; the most likely
    token always stays. Ties in the sort order are broken arbitrarily (they share the same logit)."""
    if top_p is None:
        return logits
    sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
    return torch.full_like(logits, float("-inf")).scatter_(1, order, _top_p(sorted_logits, top_p))


def _top_k_candidates(logits: torch.Tensor, top_k: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's top-k candidates in (logit descending, token id ascending) order.

    Args:
        logits: (n, V) fp32.
        top_k: n ints >= 1 (host values; above V means V).
    Returns:
        (values, ids), each (n, W) with W = min(V, the largest top_k rounded up past a multiple of 64): values
        fp32, the first top_k[r] of row r are its candidates' logits and the rest -inf, ids int64 their token
        ids. Exactly top_k tokens per row: ties at the k-th logit go to the lower ids (as vLLM's sort-based
        top-k), so a row's candidates depend on its own logits and top_k only.
    The -inf padding to a multiple of 64 keeps a row's softmax (top-p, the draw) summing its candidates in the
    same vector lanes whatever W the batch needs; over exactly k entries the sum rounds differently, and a
    row's token could then depend on its neighbours' top_k.
    One partial `topk` of W values, not a sort of the vocabulary. On CPU (host reads are free) the id-order
    sorts run only when two of the W values are equal, and a tie at a row's finite k-th value that reaches past
    the W largest widens to V (a partial topk orders and picks equal values arbitrarily; -inf candidates have
    probability 0, whichever ids they carry). Other devices never read
    from the device: the sorts always run, and such a tie past W is broken in topk's order.
    """
    n, V = logits.shape
    k = [min(x, V) for x in top_k]
    kmax = max(k)
    W = min(V, (kmax // 64 + 1) * 64)
    vals, ids = torch.topk(logits, W, dim=-1)  # descending; order among equal values unspecified
    cpu = logits.device.type == "cpu"
    if not cpu or W == V or bool((vals[:, 1:] == vals[:, :-1]).any()):  # ties: id order among equal values
        if cpu and W < V:
            kth = vals.gather(1, (torch.tensor(k) - 1)[:, None])[:, 0]
            if bool(((vals[:, -1] == kth) & (kth > float("-inf"))).any()):  # -inf candidates are never drawn
                vals, ids = torch.topk(logits, V, dim=-1)
                W = V
        ids, by_id = torch.sort(ids, dim=-1)  # a stable sort by value of the id-sorted candidates
        vals, pos = torch.sort(vals.gather(1, by_id), dim=-1, descending=True, stable=True)
        ids = ids.gather(1, pos)
    if min(k) == kmax:
        vals[:, kmax:] = float("-inf")
        return vals, ids
    beyond = torch.arange(W, device=vals.device) >= to_device(torch.tensor(k), vals.device)[:, None]
    return vals.masked_fill(beyond, float("-inf")), ids


def _top_p(logits: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """logits (n, W) fp32 sorted descending along each row (-inf allowed), top_p (n, 1) fp32 (>= 1 = off):
    the tokens past each row's nucleus set to -inf (a token stays while the mass before it is < top_p, so
    the first always stays)."""
    probs = torch.softmax(logits, dim=-1)
    return logits.masked_fill(torch.cumsum(probs, dim=-1) - probs >= top_p, float("-inf"))


def filter_logits(logits: torch.Tensor, top_k: int | None, top_p: float | None) -> torch.Tensor:
    """Set logits outside top_k / the top_p nucleus to -inf. logits: (n, V) float; returns a new tensor.

    top_k keeps exactly k tokens (ties at the k-th logit to the lower ids); the nucleus always keeps the most
    likely token (so top_p never leaves a row empty).
    """
    n, V = logits.shape
    p = torch.full((n, 1), float(top_p), device=logits.device) if top_p is not None and top_p < 1 else None
    if not top_k:
        return _filter(logits.clone(), p)
    vals, ids = _top_k_candidates(logits.float(), [int(top_k)] * n)
    if p is not None:
        vals = _top_p(vals, p)
    return torch.full_like(logits, float("-inf")).scatter_(1, ids, vals.to(logits.dtype))


def sample_next(
    logits: torch.Tensor,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """Sample one token per row, all rows with the same parameters and one generator (a SamplingBatch of n
    such rows: the same draws as the engine's).

    Args:
        logits: (n, V) float logits (any float dtype; computed in fp32).
        temperature: >= 0; below TEMPERATURE_EPS = greedy.
        top_k: None/0 = off, else keep the k most likely tokens.
        top_p: None/1 = off, else nucleus mass in (0, 1].
        generator: torch.Generator on logits.device (None: torch's default generator).
    Returns:
        (n,) int64 token ids, on logits.device.
    Raises:
        ValueError: invalid temperature / top_k / top_p (see `validate`), logits not (n, V), or a row with
            NaN, +inf or no finite logit.
    """
    validate(temperature, top_k, top_p)
    if logits.ndim != 2:
        raise ValueError(f"logits must be (n, V), got shape {tuple(logits.shape)}")
    batch = SamplingBatch()
    for _ in range(logits.shape[0]):
        batch.add(temperature, top_k, top_p, generator)
    out = batch.sample(logits)
    bad = [i for i, s in enumerate(out) if s.error]
    if bad:
        raise ValueError(f"rows {bad}: {out[bad[0]].error}")
    return torch.tensor([s.token for s in out], dtype=torch.int64, device=logits.device)


def _take(token: torch.Tensor, sampled: torch.Tensor, groups: list, overflow: torch.Tensor, errors: dict):
    """token (n,) int64 with the rows of `groups` that drew without error replaced by sampled (n,), except
    the rows whose scaled logits overflow (overflow (n,) bool: they keep their greedy token)."""
    n, dev = token.shape[0], token.device
    drawn = [r for _, rows, _ in groups for r in rows if r not in errors]
    if len(drawn) == n:
        return torch.where(overflow, token, sampled)
    if not drawn:
        return token
    mask = torch.zeros(n, dtype=torch.bool)
    mask[drawn] = True
    return torch.where(to_device(mask, dev) & ~overflow, sampled, token)


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

    Rows that share a generator draw their noise in one call per path (its rows with top-k: (rows, largest
    k); without: (rows, V), as one multinomial call over those rows did), in the order they were added.
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

    def _draw(self, groups: list, width: int, n: int, dev, errors: dict) -> torch.Tensor:
        """(n, width) Exp(1) noise: each group (generator, rows, k) draws one (len(rows), k) tensor (k <=
        width) into its rows' first k columns, in the order the rows were added; every other entry is 1
        (dividing by it changes nothing). A failing draw (e.g. a generator on another device) fails its rows
        alone (recorded in `errors`)."""
        whole = len(groups) == 1 and groups[0][1] == list(range(n)) and groups[0][2] == width
        noise = None if whole else torch.ones((n, width), device=dev)  # whole: the draw is the noise
        for generator, rows, k in groups:
            try:
                q = torch.empty((len(rows), k), device=dev).exponential_(1, generator=generator)
            except RuntimeError as e:
                errors.update({r: f"invalid sampling state: {e}" for r in rows})
                continue
            if whole:
                return q
            if rows[-1] - rows[0] == len(rows) - 1:
                noise[rows[0] : rows[-1] + 1, :k] = q
            else:
                noise[to_device(torch.tensor(rows), dev), :k] = q
        if noise is None:
            noise = torch.ones((n, width), device=dev)
        return noise

    def sample(self, logits: torch.Tensor) -> list[Sampled]:
        """logits: (len(self), V) rows in the order added (any float dtype, any device). One D2H copy."""
        n, V = logits.shape
        if n != len(self):
            raise ValueError(f"logits has {n} rows for {len(self)} sampling rows")
        dev = logits.device
        logits = logits.float()
        rowmax, greedy_tok = logits.max(dim=-1)  # NaN propagates into rowmax; ties go to the lowest id
        bad = ~(rowmax.abs() < float("inf"))  # NaN, +inf, or no finite logit (all -inf)
        temp = to_device(torch.tensor(self.temperature, dtype=torch.float32), dev)
        overflow = torch.isposinf(rowmax / temp)  # = max of scaled: tiny temperature, greedy (T -> 0 limit)
        p = to_device(torch.tensor(self.top_p)[:, None], dev) if min(self.top_p) < 1 else None
        # a generator's rows split by path: with top-k (noise over its k candidates) or not (over V)
        top_k_groups, vocab_groups = [], []
        for generator, rows in self._draws.values():
            with_k = [r for r in rows if self.top_k[r]]
            if with_k:
                top_k_groups.append((generator, with_k, min(V, max(self.top_k[r] for r in with_k))))
            if len(with_k) < len(rows):
                vocab_groups.append((generator, [r for r in rows if not self.top_k[r]], V))
        errors: dict[int, str] = {}
        token = greedy_tok
        if top_k_groups:  # candidates of the raw logits (temperature > 0 keeps their order)
            vals, ids = _top_k_candidates(logits, [max(1, x) for x in self.top_k])
            vals = vals / temp[:, None]
            if p is not None:
                vals = _top_p(vals, p)
            width = max(k for _, _, k in top_k_groups)  # every drawing row's candidates are among the first
            noise = self._draw(top_k_groups, width, n, dev, errors)
            choice = torch.argmax(torch.softmax(vals, dim=-1)[:, :width] / noise, dim=-1)
            token = _take(token, ids.gather(1, choice[:, None])[:, 0], top_k_groups, overflow, errors)
        if vocab_groups:
            noise = self._draw(vocab_groups, V, n, dev, errors)
            probs = torch.softmax(_filter(logits / temp[:, None], p), dim=-1)
            token = _take(token, torch.argmax(probs / noise, dim=-1), vocab_groups, overflow, errors)
        if max(self.forced) >= 0:
            forced = to_device(torch.tensor(self.forced), dev)
            token = torch.where(forced >= 0, forced, token)
        cols = [token.double(), bad.double()]
        K = max(self.num_logprobs)
        if K >= 0:
            lp = torch.log_softmax(torch.where(overflow[:, None], logits, logits / temp[:, None]), dim=-1)
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
