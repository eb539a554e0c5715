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
    tokens a seed gives differ from `multinomial`'s. Top-p zeroes the candidates past the nucleus instead
    of renormalizing (argmax of c * probs / q is the same draw for any c > 0): one softmax, not two.
Rows that share a generator (one prompt's samples in `generate_batch`) draw one tensor, in the order they
were added; a row's draw depends on its own logits, parameters and generator only, never on which other
rows share the batch (on GPUs, one exception: `_top_k_candidates` on a tie that reaches past 64 candidates).

`SamplingBatch` collects one row per sequence (its parameters, generator, forced token, logprobs wanted)
and `sample(logits)` returns every row's token, error and logprobs with ONE device-to-host transfer. The
device computes per row its greedy token, its max logit and each path's draw; the host then picks the token
(forced, greedy, or its path's draw) and finds the bad rows, in Python over n rows instead of a dozen small
tensor ops (each ~5-10 us on a CPU right after a forward: bench/results/decode_overhead.md).
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

import array
import math
import numbers
import secrets
from dataclasses import dataclass, field

import torch

from raychat.config.schema import SEED_MAX
from raychat.engine.attention import to_device
from raychat.engine.detokenize import stop_strings

TEMPERATURE_EPS = 1e-5
FP32_MAX = torch.finfo(torch.float32).max
FP32_OVERFLOW = FP32_MAX + 2.0**103  # max + half an ulp: the smallest real number float32 rounds to +inf
HOST_TIE_CHECK = 64  # candidate values (rows x W) up to which _has_ties reads them on the host
MAX_TOP_LOGPROBS = 20


def make_generator(seed: int | None, device: str | torch.device = "cpu") -> torch.Generator:
    """A torch.Generator on `device`, seeded with `seed` (None: 63 random bits from the OS)."""
    gen = torch.Generator(device=device)
    gen.manual_seed(secrets.randbits(63) if seed is None else int(seed))
    return gen


def is_greedy(temperature: float) -> bool:
    return temperature < TEMPERATURE_EPS


def is_int(x) -> bool:
    """An integer (Python's or NumPy's), not a bool."""
    return isinstance(x, numbers.Integral) and not isinstance(x, bool)


def is_real(x) -> bool:
    """A real number (int or float, Python's or NumPy's), not a bool (NaN is one: ranges refuse it)."""
    return isinstance(x, numbers.Real) and not isinstance(x, bool)


def validate(temperature: float, top_k: int | None, top_p: float | None) -> None:
    """Raise ValueError naming the field (also for a wrong type: a str, a bool) if temperature is not a real
    number in [0, FP32_MAX] (NaN is not: logits are scaled in float32), top_k not None or an int >= 0, or
    top_p not None or a real number in (0, 1]."""
    if not is_real(temperature) or not 0 <= temperature <= FP32_MAX:
        raise ValueError(
            f"temperature must be a real number in [0, {FP32_MAX:.4g}] (0 = greedy; logits are scaled in "
            f"float32), got {temperature!r}"
        )
    if top_k is not None and (not is_int(top_k) or top_k < 0):
        raise ValueError(f"top_k must be None or an int >= 0 (0/None = off), got {top_k!r}")
    if top_p is not None and (not is_real(top_p) or not 0 < top_p <= 1):
        raise ValueError(f"top_p must be None or a real number in (0, 1] (1/None = off), got {top_p!r}")


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
    sorts run only when two of the W values are equal (`_has_ties`), and a tie at a row's finite k-th value
    that reaches past the W largest widens to V (a partial topk orders and picks equal values arbitrarily;
    -inf candidates have probability 0, whichever ids they carry). Other devices never read from the
    device: the sorts always run, and such a tie past W is broken in topk's order.
    """
    n, V = logits.shape
    k = [min(x, V) for x in top_k]
    kmax = max(k)
    W = min(V, (kmax // 64 + 1) * 64)
    vals, ids = torch.topk(logits, W, dim=-1)  # descending; order among equal values unspecified
    cpu = logits.device.type == "cpu"
    if not cpu or W == V or _has_ties(vals):  # ties: the id order among equal values
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


def _past_nucleus(probs: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """probs (n, W) fp32 sorted descending along each row, top_p (n, 1) fp32 (>= 1 = off): (n, W) bool, True
    past each row's nucleus (a token stays while the mass before it is < top_p, so the first always stays, even
    where a top_p too small for fp32 rounded to 0)."""
    past = torch.cumsum(probs, dim=-1) - probs >= top_p
    past[:, 0] = False
    return past


def _max_is_first_candidate(device: torch.device) -> bool:
    """Whether `_top_k_candidates`' first candidate is each row's max logit with ties to the lowest id: on
    CPU, where a tie past the W largest widens to V. Elsewhere a tie of more than W values at the max keeps
    an arbitrary W of them, so greedy tokens come from logits.max instead."""
    return device.type == "cpu"


def _has_ties(vals: torch.Tensor) -> bool:
    """Whether a row of vals (n, W) fp32, sorted descending, holds two equal values. Up to HOST_TIE_CHECK
    values (one row at W = 64) a Python set over a host read is cheaper than the three tensor ops (4.7 vs
    6.3 us in a loop, ~12 vs ~25 us right after a forward); at 512 values the ops win (7 vs 34 us)."""
    if vals.numel() <= HOST_TIE_CHECK:
        return any(len(set(row)) < len(row) for row in vals.tolist())
    return bool((vals[:, 1:] == vals[:, :-1]).any())


def _top_p(logits: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """logits (n, W) fp32 sorted descending along each row (-inf allowed), top_p (n, 1) fp32 (>= 1 = off):
    the tokens past each row's nucleus (`_past_nucleus`) set to -inf."""
    return logits.masked_fill(_past_nucleus(torch.softmax(logits, dim=-1), top_p), float("-inf"))


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


def _float32(x: float) -> float:
    """x rounded to float32 (as torch.tensor(x, dtype=torch.float32) rounds it; inf past its range)."""
    return array.array("f", [x])[0]


def _overflows(rowmax: float, temperature: float) -> bool:
    """True when the float32 quotient rowmax / temperature (both float32 values, temperature > 0) rounds to
    +inf, i.e. the exact quotient is >= FP32_OVERFLOW. Decided in float64: the exact quotient of two float32
    values differs from FP32_OVERFLOW = 2^103 (2^25 - 1) by at least 2^-25 of it (a float32 mantissa has 24
    bits), far more than float64's rounding error, so the float64 quotient lies on the same side."""
    return rowmax / temperature >= FP32_OVERFLOW


def _to_host(cols: list[torch.Tensor], stacked: bool | None = None) -> list[tuple]:
    """Per row, the values of the (n,) tensors `cols`: plain reads on CPU; elsewhere (or stacked=True) ONE
    device-to-host copy of them stacked as float64 (exact for token ids and float32 values)."""
    if stacked is None:
        stacked = cols[0].device.type != "cpu"
    if not stacked:
        return list(zip(*(c.tolist() for c in cols)))
    return [tuple(row) for row in torch.stack([c.double() for c in cols], dim=1).cpu().tolist()]


def check_seed(seed) -> None:
    """Raise ValueError naming seed unless it is None (fresh entropy) or an int in 0..SEED_MAX (2**63 - 1:
    torch.tensor's int64, raychat.config's --seed; negative seeds are refused, as `raychat chat --seed -1`)."""
    if seed is not None and (not is_int(seed) or not 0 <= seed <= SEED_MAX):
        raise ValueError(
            f"seed must be None (a fresh random seed) or an int in 0..{SEED_MAX} (2**63 - 1), got {seed!r}"
        )


@dataclass(frozen=True)
class SamplingParams:
    """How one request generates.

    Fields (an "int" is Python's or NumPy's integer, a "real number" an int or float; a bool or str is
    neither; stored as Python int / float):
        max_tokens: completion tokens at most (sampled and forced tool-output tokens), an int >= 1.
        temperature: a real number in [0, FP32_MAX] (finite, not NaN); below TEMPERATURE_EPS (1e-5) = greedy.
        top_k: None/0 = off, else an int >= 1.
        top_p: None/1.0 = off, else a real number in (0, 1].
        seed: an int in 0..SEED_MAX (2**63 - 1, as raychat.config's --seed) seeds the request's
            torch.Generator; None = fresh OS entropy.
        stop: one stop string (a str) or a sequence of them, stored as a tuple (detokenize.stop_strings);
            generation ends when the completion's visible text (outside special tokens, calculator calls and
            their results) contains one (never emitted). One that is a special token's text is a stop token
            (raychat.engine.row_state).
        logprobs: return each completion token's logprob (module docstring: which distribution); a bool.
        top_logprobs: an int in 0..20: most likely alternatives per token as well; needs logprobs=True.
    Raises:
        ValueError: a field of the wrong type or outside its allowed values (the message names the field and
            its allowed values; a wrong type is a ValueError too, as everywhere in the engine).
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
        object.__setattr__(self, "stop", stop_strings(self.stop))
        if not is_int(self.max_tokens) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be an int >= 1, got {self.max_tokens!r}")
        validate(self.temperature, self.top_k, self.top_p)
        check_seed(self.seed)
        if not isinstance(self.logprobs, bool):
            raise ValueError(f"logprobs must be a bool, got {self.logprobs!r}")
        if not is_int(self.top_logprobs) or not 0 <= self.top_logprobs <= MAX_TOP_LOGPROBS:
            raise ValueError(
                f"top_logprobs must be an int in 0..{MAX_TOP_LOGPROBS}, got {self.top_logprobs!r}"
            )
        if self.top_logprobs and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs=True")
        self._as_python_numbers()

    def _as_python_numbers(self) -> None:
        """Store the checked numbers as Python int / float (a NumPy scalar in, the same value out)."""
        for name in ("max_tokens", "top_k", "seed", "top_logprobs", "temperature", "top_p"):
            value = getattr(self, name)
            if value is not None:
                object.__setattr__(
                    self, name, float(value) if name in ("temperature", "top_p") else int(value)
                )


@dataclass(frozen=True)
class Sampled:
    """One row's result: token id (-1 when error is set), error message or None, the chosen token's
    logprob and the top alternatives [(token_id, logprob), ...] when the row asked for logprobs."""

    token: int
    error: str | None = None
    logprob: float | None = None
    top_logprobs: list[tuple[int, float]] | None = None


class SamplingBatch:
    """Rows to sample in one step. `add` one row per sequence, then `sample(logits)`; the same rows (same
    parameters, generators and forced tokens) may sample again, step after step, without being added again.

    Rows that share a generator draw their noise in one call per path (its rows with top-k: (rows, largest
    k); without: (rows, V), as one multinomial call over those rows did), in the order they were added.
    """

    def __init__(self):
        self.temperature: list[float] = []  # float32 values (1.0 for greedy rows)
        self.top_k: list[int] = []
        self.top_p: list[float] = []
        self.forced: list[int] = []
        self.num_logprobs: list[int] = []  # -1 = no logprobs
        self._draws: dict[int, tuple[torch.Generator | None, list[int]]] = {}
        self._layout: tuple | None = None  # (device, V, temperature, top_p, groups) of the last sample()

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
        self.temperature.append(1.0 if greedy else _float32(temperature))
        self.top_k.append(0 if greedy or not top_k else int(top_k))
        self.top_p.append(2.0 if greedy or top_p is None or top_p >= 1 else float(top_p))
        self.forced.append(-1 if forced is None else int(forced))
        self.num_logprobs.append(int(top_logprobs) if logprobs else -1)
        if forced is None and not greedy:
            self._draws.setdefault(id(generator), (generator, []))[1].append(i)
        self._layout = None
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
        """logits: (len(self), V) rows in the order added (any float dtype, any device).

        The device computes each row's greedy token, its max logit and each path's draw (and the logprobs);
        the host then picks every row's token from them (forced, greedy, or its path's draw; greedy when its
        scaled max overflows) and finds the bad rows: one device-to-host copy (`_to_host`)."""
        n, V = logits.shape
        if n != len(self):
            raise ValueError(f"logits has {n} rows for {len(self)} sampling rows")
        dev = logits.device
        logits = logits if logits.dtype == torch.float32 else logits.float()
        if self._layout is None or self._layout[:2] != (dev, V):  # kept for the next sample() of these rows
            temp = to_device(
                torch.tensor([[t] for t in self.temperature], dtype=torch.float32), dev
            )  # (n, 1)
            p = None
            if min(self.top_p) < 1:
                p = to_device(torch.tensor([[x] for x in self.top_p], dtype=torch.float32), dev)
            self._layout = (dev, V, temp, p, self._groups(V))
        _, _, temp, p, (top_k_groups, vocab_groups) = self._layout
        errors: dict[int, str] = {}
        if top_k_groups:  # every row's candidates (k >= 1), in (logit desc, id asc) order
            vals, ids = _top_k_candidates(logits, [max(1, x) for x in self.top_k])
        if top_k_groups and _max_is_first_candidate(dev):
            rowmax, greedy = vals[:, 0], ids[:, 0]  # topk puts NaN first: it reaches rowmax
        else:
            rowmax, greedy = logits.max(dim=-1)  # NaN propagates into rowmax; ties go to the lowest id
        tokens, path = [greedy], {}  # candidate tokens (n,) each; drawing row -> its path's index in tokens
        if top_k_groups:  # candidates of the raw logits (temperature > 0 keeps their order)
            probs = torch.softmax(vals / temp, dim=-1)
            if p is not None:  # the race needs no renormalizing: argmax(c * probs / noise) for any c > 0
                probs = probs.masked_fill(_past_nucleus(probs, p), 0.0)
            width = max(k for _, _, k in top_k_groups)  # every drawing row's candidates are among the first
            noise = self._draw(top_k_groups, width, n, dev, errors)
            choice = torch.argmax(probs[:, :width] / noise, dim=-1)
            path |= dict.fromkeys((r for _, rows, _ in top_k_groups for r in rows), len(tokens))
            tokens.append(ids.gather(1, choice[:, None])[:, 0])
        if vocab_groups:
            noise = self._draw(vocab_groups, V, n, dev, errors)
            probs = torch.softmax(_filter(logits / temp, p), dim=-1)
            path |= dict.fromkeys((r for _, rows, _ in vocab_groups for r in rows), len(tokens))
            tokens.append(torch.argmax(probs / noise, dim=-1))
        cols = [*tokens, rowmax]
        K = max(self.num_logprobs)
        if K >= 0:  # log_softmax of the scaled logits (of the raw ones where scaling overflows)
            lp = torch.where(torch.isposinf(rowmax[:, None] / temp), logits, logits / temp).log_softmax(
                dim=-1
            )
            forced = to_device(torch.tensor([max(f, 0) for f in self.forced]), dev)
            cols += lp.gather(1, torch.stack([*tokens, forced], dim=1)).unbind(1)  # each candidate's logprob
            if K > 0:
                top = torch.topk(lp, K, dim=-1)
                cols += [*top.indices.unbind(1), *top.values.unbind(1)]
        return [
            self._result(i, row, path.get(i), len(tokens), K, errors) for i, row in enumerate(_to_host(cols))
        ]

    def _groups(self, V: int) -> tuple[list, list]:
        """The drawing rows of each generator split by path: (generator, rows, k) with top-k (noise over
        the largest k of those rows' candidates), and (generator, rows, V) without (noise over V)."""
        top_k_groups, vocab_groups = [], []
        for generator, rows in self._draws.values():
            with_k = [r for r in rows if self.top_k[r]]
            if with_k:
                top_k_groups.append((generator, with_k, min(V, max(self.top_k[r] for r in with_k))))
            if len(with_k) < len(rows):
                vocab_groups.append((generator, [r for r in rows if not self.top_k[r]], V))
        return top_k_groups, vocab_groups

    def _result(self, i: int, row: tuple, drawn: int | None, m: int, K: int, errors: dict) -> Sampled:
        """Row i's Sampled from its host values `row`: m candidate tokens (greedy first, then each path's
        draw), its max logit, then when the batch asked for logprobs (K >= 0): the logprob of each
        candidate and of its forced token, the top K ids and the top K logprobs. drawn: the index of its
        path's draw among the candidates (None: a greedy or forced row)."""
        rowmax = row[m]
        if i in errors or not math.isfinite(rowmax):
            return Sampled(
                -1, errors.get(i) or "non-finite logits (NaN, +inf, or no finite value) from the model"
            )
        if self.forced[i] >= 0:
            c, token = m, self.forced[i]
        else:
            c = 0 if drawn is None or _overflows(rowmax, self.temperature[i]) else drawn
            token = int(row[c])
        k = self.num_logprobs[i]
        if k < 0:
            return Sampled(token)
        base = m + 1  # the candidates' logprobs, then the forced token's
        top = [(int(row[base + m + 1 + j]), row[base + m + 1 + K + j]) for j in range(k)]
        return Sampled(token, None, row[base + c], top)
