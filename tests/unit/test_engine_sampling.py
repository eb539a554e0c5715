"""Sampling: greedy, temperature, top-k, top-p on hand-worked distributions; per-row independence."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from raychat.config.schema import SEED_MAX
from raychat.engine import TEMPERATURE_EPS, SamplingBatch, SamplingParams, make_generator, sample_next
from raychat.engine.sampling import (
    FP32_OVERFLOW,
    HOST_TIE_CHECK,
    _has_ties,
    _overflows,
    _to_host,
    _top_k_candidates,
    filter_logits,
)

PROBS = torch.tensor([[0.5, 0.3, 0.15, 0.05]])
LOGITS = PROBS.log()


def kept(logits):
    return torch.isfinite(logits[0]).nonzero().flatten().tolist()


def test_top_k_keeps_k_largest():
    assert kept(filter_logits(LOGITS, top_k=2, top_p=None)) == [0, 1]
    assert kept(filter_logits(LOGITS, top_k=4, top_p=None)) == [0, 1, 2, 3]
    assert kept(filter_logits(LOGITS, top_k=0, top_p=None)) == [0, 1, 2, 3]
    # exactly k: ties at the k-th logit go to the lower ids
    assert kept(filter_logits(torch.tensor([[0.0, 1.0, 1.0, 1.0]]), top_k=2, top_p=None)) == [1, 2]
    # top-k then top-p on the renormalized survivors: 0.5/0.8 = 0.625 < 0.7 <= 1 -> both stay
    assert kept(filter_logits(LOGITS, top_k=2, top_p=0.7)) == [0, 1]
    assert kept(filter_logits(LOGITS, top_k=2, top_p=0.6)) == [0]


def test_top_p_smallest_set_reaching_mass():
    # mass before each token (sorted): 0, 0.5, 0.8, 0.95; a token stays while that mass < top_p
    assert kept(filter_logits(LOGITS, top_k=None, top_p=0.5)) == [0]
    assert kept(filter_logits(LOGITS, top_k=None, top_p=0.8)) == [0, 1]
    assert kept(filter_logits(LOGITS, top_k=None, top_p=0.81)) == [0, 1, 2]
    assert kept(filter_logits(LOGITS, top_k=None, top_p=0.01)) == [0]  # never empty
    # a top_p > 0 that rounds to 0 in fp32 (under ~1.4e-45) kept nothing, and the argmax of an all -inf row
    # drew token 0 at every step: the most likely token stays here too
    for top_k in (None, 3):
        assert kept(filter_logits(LOGITS[:, [3, 2, 0, 1]], top_k=top_k, top_p=1e-50)) == [2]
    # unsorted input: same set by id
    perm = torch.tensor([2, 0, 3, 1])
    assert kept(filter_logits(LOGITS[:, perm], top_k=None, top_p=0.8)) == [1, 3]


def test_greedy_is_argmax():
    logits = torch.tensor([[0.1, 2.0, -1.0], [3.0, 3.0, 0.0]])
    assert sample_next(logits, temperature=0).tolist() == [1, 0]


def test_temperature_frequencies():
    # logits [0, ln 3]: p(1) = 3/4 at T=1; at T=0.5 logits double: p(1) = 9/10
    n = 8000
    logits = torch.tensor([[0.0, math.log(3)]]).expand(n, 2)
    gen = make_generator(123)
    f1 = sample_next(logits, 1.0, generator=gen).float().mean().item()
    f05 = sample_next(logits, 0.5, generator=gen).float().mean().item()
    # binomial std: sqrt(.75*.25/8000) = 0.0048, sqrt(.9*.1/8000) = 0.0034; 5 sigma bounds
    assert abs(f1 - 0.75) < 0.025
    assert abs(f05 - 0.9) < 0.017


def test_top_p_renormalizes():
    n = 8000
    out = sample_next(LOGITS.expand(n, 4), 1.0, top_p=0.8, generator=make_generator(7))
    assert set(out.tolist()) <= {0, 1}
    assert abs((out == 0).float().mean().item() - 0.5 / 0.8) < 0.03  # 0.625; std 0.0054


def test_rows_are_independent_and_seeded():
    logits = torch.zeros(64, 2)
    a = sample_next(logits, 1.0, generator=make_generator(0))
    b = sample_next(logits, 1.0, generator=make_generator(0))
    assert a.tolist() == b.tolist()
    assert 0 < a.sum().item() < 64


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"temperature": -0.1}, "temperature"),
        ({"top_k": -1}, "top_k"),
        ({"top_p": 1.5}, "top_p"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"stop": ("",)}, "stop"),
        ({"temperature": float("nan")}, "temperature"),
        ({"temperature": float("inf")}, "temperature"),
        ({"temperature": 1e39}, "temperature"),  # finite in Python, inf in float32: -inf logits would be NaN
        ({"logprobs": 1}, "logprobs"),
        ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
        ({"logprobs": True, "top_logprobs": -1}, "top_logprobs"),
        ({"top_logprobs": 2}, "top_logprobs needs logprobs=True"),
    ],
)
def test_params_validation(kwargs, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


def test_params_single_stop_string_becomes_tuple():
    assert SamplingParams(stop="END").stop == ("END",)
    assert SamplingParams(stop=None).stop == ()


TEMPERATURE_RULE = (
    "temperature must be a real number in [0, 3.403e+38] (0 = greedy; logits are scaled in float32)"
)
SEED_RULE = "seed must be None (a fresh random seed) or an int in 0..9223372036854775807 (2**63 - 1)"


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"temperature": "0.5"}, f"{TEMPERATURE_RULE}, got '0.5'"),  # was: TypeError '<=' not supported
        ({"temperature": True}, f"{TEMPERATURE_RULE}, got True"),
        ({"temperature": float("nan")}, f"{TEMPERATURE_RULE}, got nan"),
        ({"top_k": 2.5}, "top_k must be None or an int >= 0 (0/None = off), got 2.5"),
        ({"top_k": True}, "top_k must be None or an int >= 0 (0/None = off), got True"),
        ({"top_p": "0.9"}, "top_p must be None or a real number in (0, 1] (1/None = off), got '0.9'"),
        ({"top_p": float("nan")}, "top_p must be None or a real number in (0, 1] (1/None = off), got nan"),
        ({"max_tokens": True}, "max_tokens must be an int >= 1, got True"),
        ({"max_tokens": 8.0}, "max_tokens must be an int >= 1, got 8.0"),
        ({"seed": 2**70}, f"{SEED_RULE}, got {2**70}"),  # was: Scheduler.submit's "Overflow ... long long"
        ({"seed": 2**63}, f"{SEED_RULE}, got {2**63}"),
        ({"seed": -1}, f"{SEED_RULE}, got -1"),  # as `raychat chat --seed -1`
        ({"seed": "x"}, f"{SEED_RULE}, got 'x'"),  # was: accepted, failing later in int()
        ({"seed": 1.0}, f"{SEED_RULE}, got 1.0"),
        ({"seed": True}, f"{SEED_RULE}, got True"),
        ({"logprobs": True, "top_logprobs": True}, "top_logprobs must be an int in 0..20, got True"),
        ({"stop": 5}, "stop must be a non-empty str or a sequence of non-empty strs, got 5"),
        ({"stop": ""}, "stop must be a non-empty str or a sequence of non-empty strs, got ''"),
    ],
)
def test_params_types_and_ranges_checked_at_construction(kwargs, message):
    with pytest.raises(ValueError) as err:
        SamplingParams(**kwargs)
    assert str(err.value) == message


def test_params_seed_range_is_the_config_seed_range():
    assert SEED_MAX == 2**63 - 1
    assert SamplingParams(seed=SEED_MAX).seed == SEED_MAX and SamplingParams(seed=0).seed == 0
    make_generator(SEED_MAX)  # the largest accepted seed seeds a generator


def test_params_store_python_numbers():
    p = SamplingParams(
        max_tokens=np.int64(8), temperature=np.float32(0.5), top_k=np.int32(4), top_p=1, seed=np.uint8(3)
    )
    assert (p.max_tokens, p.temperature, p.top_k, p.top_p, p.seed) == (8, 0.5, 4, 1.0, 3)
    assert [type(v) for v in (p.max_tokens, p.temperature, p.top_k, p.top_p, p.seed)] == [
        int,
        float,
        int,
        float,
        int,
    ]


def multinomial_reference(logits, temperature, top_p, generator):
    """The engine's sampler before batching (commit 76453d3), for rows without top-k: filter, softmax,
    torch.multinomial."""
    x = logits.float() / temperature
    if top_p is not None and top_p < 1.0:
        sorted_x, order = torch.sort(x, dim=-1, descending=True)
        probs = torch.softmax(sorted_x, dim=-1)
        remove = torch.zeros_like(probs, dtype=torch.bool).scatter(
            -1, order, torch.cumsum(probs, -1) - probs >= top_p
        )
        x[remove] = float("-inf")
    return torch.multinomial(torch.softmax(x, dim=-1), 1, generator=generator).squeeze(-1)


def race_reference(row, temperature, top_k, top_p, generator):
    """A top-k row, written out: the k candidates in (logit desc, id asc) order by Python's sort, their
    probabilities, those past the top-p nucleus zeroed (the race needs no renormalizing), then the
    exponential race with (1, k) noise from the row's generator."""
    raw = row.float().tolist()
    order = sorted(range(len(raw)), key=lambda i: (-raw[i], i))[:top_k]
    probs = torch.softmax(torch.tensor([raw[i] for i in order]) / temperature, dim=0)
    if top_p is not None:
        probs[torch.cumsum(probs, 0) - probs >= top_p] = 0.0
    q = torch.empty(1, top_k).exponential_(1, generator=generator)[0]
    return order[int(torch.argmax(probs / q))]


ROWS = [(1.0, None, None), (1.0, None, None), (0.7, 5, None), (1.3, None, 0.6), (0.9, 8, 0.9), (0.0, 3, None)]
SEEDS = [10, 10, 11, 12, 13, None]  # rows 0 and 1 share a generator (one prompt's samples), the others not


def test_batch_draws_what_per_row_references_drew():
    """Rows without top-k draw what per-row torch.multinomial drew (the same seeds, the same tokens); rows
    with top-k the race over their k candidates; greedy rows the argmax; over 20 steps of one generator each."""
    ours = {s: make_generator(s) for s in set(SEEDS) - {None}}
    theirs = {s: make_generator(s) for s in set(SEEDS) - {None}}
    logits = torch.randn(6, 50, generator=torch.Generator().manual_seed(0)) * 3
    for step in range(20):
        batch = SamplingBatch()
        for (t, k, p), seed in zip(ROWS, SEEDS):
            batch.add(t, k, p, ours.get(seed))
        got = [s.token for s in batch.sample(logits)]
        expected = multinomial_reference(logits[:2], 1.0, None, theirs[10]).tolist()
        expected.append(race_reference(logits[2], 0.7, 5, None, theirs[11]))
        expected += multinomial_reference(logits[3:4], 1.3, 0.6, theirs[12]).tolist()
        expected.append(race_reference(logits[4], 0.9, 8, 0.9, theirs[13]))
        expected.append(int(logits[5].argmax()))
        assert got == expected, step
        logits = logits.roll(step + 1, dims=1)


def test_a_rows_draw_does_not_depend_on_its_neighbours():
    """The same seeded top-k row gives the same tokens alone and beside rows of other parameters (another
    top-k, none, greedy, forced): what continuous batching needs for seeded requests."""
    logits = torch.randn(20, 5, 300, generator=torch.Generator().manual_seed(1)) * 2
    alone_gen, shared_gen = make_generator(5), make_generator(5)
    others = [make_generator(6), make_generator(7)]
    for step in range(20):
        alone = SamplingBatch()
        alone.add(0.8, 40, 0.9, alone_gen)
        crowd = SamplingBatch()
        crowd.add(1.0, 200, None, others[0])
        crowd.add(0.8, 40, 0.9, shared_gen)
        crowd.add(1.1, None, 0.5, others[1])
        crowd.add(0.0, 7, None, None)
        crowd.add(1.0, 3, None, others[0], forced=4)
        assert alone.sample(logits[step, 1:2])[0].token == crowd.sample(logits[step])[1].token, step


def test_a_top_p_boundary_row_does_not_depend_on_its_neighbours_top_k():
    """Regression: a row's candidates are padded with -inf to a multiple of 64 whatever its neighbours need,
    so its softmax rounds the same. Over exactly k = 10 entries the mass before some candidate differs by
    an ulp from the padded sum; with top_p set to that mass the nucleus flipped next to a top_k=20 row."""
    torch.manual_seed(0)
    k, top_p = 10, None
    # logits whose nucleus mass differs between a width of k and a padded width; bounded, as a CPU whose
    # softmax kernel rounds both widths alike has none (this test hung there: nothing to regress on it)
    for _ in range(20_000):
        x = (torch.randn(1, k) * 3).sort(descending=True).values
        exact = torch.softmax(x, -1)
        padded = torch.softmax(torch.cat([x, torch.full((1, 54), float("-inf"))], 1), -1)[:, :k]
        before_exact, before_padded = (exact.cumsum(-1) - exact)[0], (padded.cumsum(-1) - padded)[0]
        differ = [j for j in range(1, k) if before_exact[j] != before_padded[j]]
        if differ:
            top_p = max(before_exact[differ[0]].item(), before_padded[differ[0]].item())
            break
    if top_p is None:
        pytest.skip("this CPU's softmax rounds k and padded widths alike: no boundary row to test")
    logits = torch.full((1, 100), -20.0)
    logits[0, :k] = x[0]
    other = torch.randn(1, 100, generator=torch.Generator().manual_seed(1))
    for seed in range(300):
        alone = SamplingBatch()
        alone.add(1.0, k, top_p, make_generator(seed))
        crowd = SamplingBatch()
        crowd.add(1.0, k, top_p, make_generator(seed))
        crowd.add(1.0, 20, None, make_generator(7))
        assert alone.sample(logits)[0].token == crowd.sample(torch.cat([logits, other]))[0].token, seed


def test_top_k_frequencies():
    # p = (0.5, 0.3, 0.15, 0.05): top_k=2 renormalizes to 0.625 / 0.375; top_k=3 with top_p=0.8 keeps
    # tokens whose mass before is < 0.8 among (0.5, 0.3, 0.15)/0.95: 0, 0.526, 0.842 -> tokens 0 and 1
    n = 8000
    out = sample_next(LOGITS.expand(n, 4), 1.0, top_k=2, generator=make_generator(9))
    assert set(out.tolist()) == {0, 1}
    assert abs((out == 0).float().mean().item() - 0.625) < 0.03  # std 0.0054
    out = sample_next(LOGITS.expand(n, 4), 1.0, top_k=3, top_p=0.8, generator=make_generator(10))
    assert set(out.tolist()) == {0, 1}
    assert abs((out == 0).float().mean().item() - 0.625) < 0.03


def test_top_k_candidates_equal_a_python_sort():
    """_top_k_candidates gives each row's first k finite tokens in (logit desc, id asc) order, with their
    logits, for per-row k, many exact ties (logits on a coarse grid), -inf logits, k at or past the finite
    logits, k = 64 (a multiple of the candidate width), and ties past the W largest (the widened path)."""
    gen = torch.Generator().manual_seed(3)
    V = 512
    for trial in range(120):
        n = 1 + trial % 5
        logits = torch.randn(n, V, generator=gen) * 3
        if trial % 3 == 0:
            logits = (logits * 2).round() / 2
        if trial % 7 == 0:
            logits[0, : V - 20] = float("-inf")
        top_k = torch.randint(1, 100, (n,), generator=gen)
        if trial % 11 == 0:
            top_k[0] = 64
        vals, ids = _top_k_candidates(logits, top_k.tolist())
        for r in range(n):
            x = logits[r].tolist()
            k = min(int(top_k[r]), sum(v > float("-inf") for v in x))  # -inf candidates: any ids (p = 0)
            order = sorted(range(V), key=lambda i: (-x[i], i))[:k]
            assert ids[r, :k].tolist() == order, (trial, r)
            assert vals[r, :k].tolist() == [x[i] for i in order]
            assert (vals[r, k:] == float("-inf")).all()
    masked = torch.full((1, 4096), float("-inf"))  # 3 finite logits, top_k 50: no full sort for -inf ties
    masked[0, [7, 900, 3]] = torch.tensor([1.0, 3.0, 2.0])
    vals, ids = _top_k_candidates(masked, [50])
    assert vals.shape[1] == 64 and ids[0, :3].tolist() == [900, 3, 7] and (vals[0, 3:] == float("-inf")).all()
    ties = torch.zeros(2, V)  # 512 equal logits: the 5th value ties past the 64 largest
    vals, ids = _top_k_candidates(ties, [5, 1])
    assert ids[0, :5].tolist() == [0, 1, 2, 3, 4] and ids[1, :1].tolist() == [0]


def test_logprobs_by_hand():
    # logits [0, ln 3]: at T = 1 the probabilities are 1/4, 3/4; at T = 1/2 the logits double: 1/10, 9/10
    logits = torch.tensor([[0.0, math.log(3)]] * 3)
    batch = SamplingBatch()
    batch.add(0.0, None, None, None, logprobs=True, top_logprobs=2)  # greedy: raw logits
    batch.add(0.5, 1, None, make_generator(0), logprobs=True, top_logprobs=1)  # top_k=1 keeps token 1 only
    batch.add(1.0, None, None, make_generator(0), forced=0, logprobs=True)  # forced tool-output token
    greedy, hot, forced = batch.sample(logits)
    assert greedy.token == 1 and greedy.logprob == pytest.approx(math.log(0.75), abs=1e-6)
    assert [t for t, _ in greedy.top_logprobs] == [1, 0]
    assert [lp for _, lp in greedy.top_logprobs] == pytest.approx([math.log(0.75), math.log(0.25)], abs=1e-6)
    # before top-k filtering: token 1 keeps its probability 9/10 under the temperature-scaled distribution
    assert hot.token == 1 and hot.logprob == pytest.approx(math.log(0.9), abs=1e-6)
    assert hot.top_logprobs[0][0] == 1 and len(hot.top_logprobs) == 1
    assert forced.token == 0 and forced.logprob == pytest.approx(math.log(0.25), abs=1e-6)
    assert forced.top_logprobs == [] and batch.sample(logits)[0].error is None


def test_temperature_below_eps_is_greedy_and_draws_nothing():
    gen = make_generator(3)
    state = gen.get_state().clone()
    logits = torch.tensor([[0.0, 1.0, 0.5]])
    for t in (5e-324, 1e-300, TEMPERATURE_EPS / 2):
        batch = SamplingBatch()
        batch.add(t, None, None, gen)
        assert batch.sample(logits)[0].token == 1
        assert sample_next(logits, t, generator=gen).tolist() == [1]
    assert torch.equal(gen.get_state(), state)


def test_overflowing_scaled_logits_are_greedy_and_bad_logits_fail_their_row_alone():
    # 1e36 / 1e-4 overflows float32 to inf: that row is sampled greedily (the T -> 0 limit), no error
    logits = torch.tensor(
        [
            [1e36, 0.0, -1e36],
            [float("nan"), 0.0, 0.0],
            [float("inf"), 0.0, 0.0],
            [float("-inf")] * 3,
            [float("-inf"), 2.0, float("-inf")],  # -inf is a valid logit (probability 0)
        ]
    )
    batch = SamplingBatch()
    for _ in range(5):
        batch.add(1e-4, None, None, make_generator(1), logprobs=True)
    out = batch.sample(logits)
    assert out[0].token == 0 and out[0].error is None and out[0].logprob == pytest.approx(0.0)
    assert [o.error is not None for o in out] == [False, True, True, True, False]
    assert out[1].error.startswith("non-finite logits") and out[1].token == -1
    assert out[4].token == 1 and out[4].logprob == pytest.approx(0.0)


def test_the_hosts_overflow_rule_equals_float32_division():
    """_overflows(x, t) (decided in float64 on the host) is torch's float32 x / t == +inf, for float32 x on
    both sides of every boundary FP32_OVERFLOW * t, including the float32 neighbours of the boundary."""
    assert FP32_OVERFLOW == 2.0**128 - 2.0**103  # float32 max (2^128 - 2^104) + half an ulp, by hand
    temps = torch.tensor([1e-5, 3.3e-5, 1e-4, 0.1, 0.7, 0.8, 1.0, 1.3, 2.0, 1e3])
    checked = 0
    for t in temps.tolist():  # float32 values
        if FP32_OVERFLOW * t > float(torch.finfo(torch.float32).max):
            continue  # no float32 x overflows x / t
        x = torch.tensor([FP32_OVERFLOW * t], dtype=torch.float32)  # the float32 next to the boundary
        down, up = torch.nextafter(x, torch.tensor([0.0])), torch.nextafter(x, torch.tensor([float("inf")]))
        xs = torch.cat([x, down, torch.nextafter(down, torch.tensor([0.0])), up, x * 0.5, -x])
        want = torch.isposinf(xs / torch.tensor(t, dtype=torch.float32)).tolist()
        assert [_overflows(v, t) for v in xs.tolist()] == want, t
        checked += sum(want)
    assert checked >= 8  # both sides were exercised


def test_to_host_reads_the_same_values_as_one_stacked_copy():
    """The accelerator path (one float64 copy of the stacked columns) gives what per-column reads give on
    CPU: token ids exactly, float32 values exactly, non-finite values as such."""
    ids = torch.tensor([0, 7, 65_535, 2**40])
    vals = torch.tensor([1.5, float("nan"), float("-inf"), 3.4e38])
    plain, stacked = _to_host([ids, vals]), _to_host([ids, vals], stacked=True)
    assert [r[0] for r in plain] == [int(r[0]) for r in stacked] == ids.tolist()
    assert [r[1] for r in plain][::2] == [r[1] for r in stacked][::2] == vals.tolist()[::2]
    assert math.isnan(stacked[1][1]) and stacked[3][1] == plain[3][1] and stacked[2][1] == float("-inf")


def test_a_top_k_row_whose_scaled_max_overflows_is_greedy():
    """The top-k path: a finite row whose max / temperature overflows float32 takes its greedy token (ties to
    the lower id), the next row's draw is unaffected, and its logprob is of the raw logits."""
    logits = torch.tensor([[0.0, 1e36, 1e36, -1.0], [0.0, 5.0, 4.0, -1.0]])
    batch = SamplingBatch()
    batch.add(1e-4, 3, 0.9, make_generator(1), logprobs=True)
    batch.add(1.0, 1, None, make_generator(2))
    out = batch.sample(logits)
    assert out[0].token == 1 and out[0].error is None and out[0].logprob == pytest.approx(math.log(0.5))
    assert out[1].token == 1 and out[1].logprob is None


def test_has_ties_on_the_host_and_with_tensor_ops_agree():
    """_has_ties reads small candidate sets on the host and compares larger ones with tensor ops: the same
    answer on both sides of HOST_TIE_CHECK, for rows with and without equal values (-inf included)."""
    gen, host = torch.Generator().manual_seed(5), set()
    for n, W in ((1, 64), (8, 64), (32, 64), (4, 1024)):
        vals = torch.randn(n, W, generator=gen).sort(dim=-1, descending=True).values
        tied = vals.clone()
        tied[-1, 3] = tied[-1, 2]
        padded = vals.clone()
        padded[0, W // 2 :] = float("-inf")
        for x, want in ((vals, False), (tied, True), (padded, True)):
            assert _has_ties(x) is want, (n, W)
            assert bool((x[:, 1:] == x[:, :-1]).any()) is want  # the tensor-op reference
        host.add(vals.numel() <= HOST_TIE_CHECK)
    assert host == {True, False}  # both ways were taken


def test_greedy_rows_off_cpu_take_the_max_of_all_logits(monkeypatch):
    """Off CPU the candidates never widen past W, so a greedy row beside top-k rows takes logits.max (ties to
    the lowest id), not the first candidate: a 100-way tie at the max gives token 50 alone and in a crowd.
    Simulated on CPU with the candidates a GPU may return (a topk keeping the HIGHEST ids among the ties)."""
    import raychat.engine.sampling as sampling

    real_topk = torch.topk

    def gpu_like_candidates(logits, top_k):
        V = logits.shape[-1]
        vals, ids = real_topk(logits.flip(-1), min(V, (max(top_k) // 64 + 1) * 64), dim=-1)
        ids, by_id = torch.sort(V - 1 - ids, dim=-1)  # the id-order sorts, as on a GPU
        vals, pos = torch.sort(vals.gather(1, by_id), dim=-1, descending=True, stable=True)
        return vals, ids.gather(1, pos)

    assert sampling._max_is_first_candidate(torch.device("cpu"))
    assert not sampling._max_is_first_candidate(torch.device("cuda"))
    logits = torch.full((2, 300), -5.0)
    logits[:, 50:150] = 2.0
    monkeypatch.setattr(sampling, "_top_k_candidates", gpu_like_candidates)

    def greedy_tokens(first_candidate_is_max: bool) -> tuple[int, int]:
        monkeypatch.setattr(sampling, "_max_is_first_candidate", lambda device: first_candidate_is_max)
        alone, crowd = SamplingBatch(), SamplingBatch()
        alone.add(0.0, None, None, None)
        crowd.add(0.0, None, None, None)
        crowd.add(1.0, 5, None, make_generator(0))
        return alone.sample(logits[:1])[0].token, crowd.sample(logits)[0].token

    assert greedy_tokens(False) == (50, 50)  # what a GPU gets
    alone, crowd = greedy_tokens(True)  # were the first candidate taken, the neighbour's top_k would matter
    assert alone == 50 and crowd != 50
