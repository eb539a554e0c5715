"""Serving-scale engine paths against references: greedy output equals the no-cache loop with slots
admitted and freed in a scattered order, GQA and chunked prefill; a 64-token prefill budget keeps a
1,000-token prompt from delaying a decoding request by more than one chunk per token; the LM head runs
only where a token is sampled; a decode step writes only the new tokens' keys/values."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from support.engine_fixtures import byte_tokenizer, reference_greedy, tiny_gpt
from support.engine_seeded_workloads import BATCH_SETTINGS, REQUESTS, record, run_alone
from torch.utils._python_dispatch import TorchDispatchMode

from raychat.engine import ModelRunner, SamplingParams, Scheduler


@pytest.fixture(scope="module")
def tok():
    return byte_tokenizer()


@pytest.fixture(scope="module")
def model(tok):
    return tiny_gpt(tok, max_seq_len=1100)  # 4 query heads over 2 kv heads (GQA)


def stop_ids(tok):
    return {tok.special_id("<|assistant_end|>"), tok.bos_id}


def test_same_seeds_same_samples_as_before_the_rewrite(tok):
    """Seeded generate_batch (5 settings, 3 samples per prompt, rows stopping at scattered steps) and a
    scattered Scheduler run: what has no top-k gives exactly the tokens recorded from commit 76453d3's engine
    (top-k rows race over their k candidates since, engine/sampling.py), and every request, top-k or not,
    gives the same tokens alone on a 1-slot Scheduler as in the scattered run."""
    recorded = json.loads(
        Path(__file__).parents[1].joinpath("data").joinpath("engine_seeded_76453d3.json").read_text()
    )
    got = record()
    without_k = [i for i, setting in enumerate(BATCH_SETTINGS) if not setting[1]]
    assert [got["generate_batch"][i] for i in without_k] == [recorded["generate_batch"][i] for i in without_k]
    without_k = [i for i, request in enumerate(REQUESTS) if not request[3]]
    assert [got["scheduler"][i] for i in without_k] == [recorded["scheduler"][i] for i in without_k]
    assert len(without_k) == 4 and all(len(t) > 0 for t in got["scheduler"])
    engine = ModelRunner(tiny_gpt(tok), tok)
    assert [run_alone(engine, tok, i) for i in range(len(REQUESTS))] == got["scheduler"]


def test_greedy_equals_no_cache_with_scattered_slots_and_chunked_prefill(tok, model):
    # prompts of 3..70 tokens with a 16-token prefill budget: the long ones take several chunks, sharing
    # steps with decoding slots; max_tokens differ, so slots free in a scattered order and compaction
    # moves the last busy slot into each freed one; late submissions reuse freed slots.
    texts = ["hi", "a prompt of thirty-one tokens..", "x" * 70, "mid-length one", "z" * 40, "q", "last!"]
    limits = [14, 3, 9, 6, 11, 2, 8]
    submit_at = [0, 0, 0, 1, 4, 4, 9]
    prompts = [[tok.bos_id, *tok.encode(t)] for t in texts]
    refs = [reference_greedy(model, p, n, stop_ids(tok)) for p, n in zip(prompts, limits)]
    sched = Scheduler(ModelRunner(model, tok), max_slots=3, max_len=128, prefill_chunk_tokens=16)
    streams, step, moved = {}, 0, 0
    while len(streams) < len(texts) or sched.num_active or sched.num_pending:
        for i, at in enumerate(submit_at):
            if at == step:
                streams[i] = sched.submit(prompts[i], SamplingParams(max_tokens=limits[i], temperature=0.0))
        before = {r.id: r.slot for r in sched._slots if r is not None}
        sched.step()
        moved += sum(1 for r in sched._slots if r is not None and before.get(r.id, r.slot) != r.slot)
        step += 1
    assert moved >= 2  # compaction happened (busy slots stayed 0..n-1)
    for i, ref in enumerate(refs):
        assert [t for e in streams[i] for t in e.token_ids] == ref, texts[i]


def test_generate_batch_chunked_prefill_equals_reference(tok, model):
    prompts = [[tok.bos_id, *tok.encode(t)] for t in ("k" * 50, "short", "medium prompt here")]
    engine = ModelRunner(model, tok, prefill_chunk_tokens=16)  # prompt 0 is chunked, the others batched
    res = engine.generate_batch(prompts, num_samples=2, max_tokens=10, temperature=0.0)
    for r in res:
        assert r.completion_tokens == reference_greedy(model, prompts[r.prompt_index], 10, stop_ids(tok))


def test_long_prompt_delays_a_decoding_request_by_one_chunk_per_token(tok, model):
    forwards: list[tuple[int, int]] = []
    hook = model.register_forward_pre_hook(lambda m, args: forwards.append(tuple(args[0].shape)))
    try:
        per_step = _steps_while_a_long_prompt_prefills(tok, model, forwards, budget=64)
        unchunked = _steps_while_a_long_prompt_prefills(tok, model, forwards, budget=2048)
    finally:
        hook.remove()
    # 1000 prompt tokens / 64 per step = 16 steps to the long request's first token; in every one of them
    # the decoding request got its token, after at most one prefill forward of at most 64 tokens
    assert len(per_step) == 16
    for tokens_of_short, prefill_shapes in per_step:
        assert tokens_of_short == 1 and len(prefill_shapes) == 1 and prefill_shapes[0][1] <= 64
    assert [shape for _, shapes in per_step for shape in shapes] == [(1, 64)] * 15 + [(1, 40)]
    # without chunking, the one step before the long request's first token holds a 1000-token forward
    assert len(unchunked) == 1 and unchunked[0][1] == [(1, 1000)]


def _steps_while_a_long_prompt_prefills(tok, model, forwards, budget):
    """[(tokens the decoding request got, prefill forward shapes)] per step, from the long prompt's
    submission to its first token; also checks both completions against the no-cache reference."""
    short = [tok.bos_id, *tok.encode("decoding")]
    long = [tok.bos_id, *tok.encode("0123456789" * 100)][:1000]
    sched = Scheduler(ModelRunner(model, tok), max_slots=2, max_len=1100, prefill_chunk_tokens=budget)
    a = sched.submit(short, SamplingParams(max_tokens=40, temperature=0.0))
    for _ in range(3):
        sched.step()
    b = sched.submit(long, SamplingParams(max_tokens=3, temperature=0.0))
    per_step = []
    while not b._events:
        forwards.clear()
        seen = len(a._events)
        sched.step()
        per_step.append((len(a._events) - seen, [s for s in forwards if s[1] > 1]))
    while sched.step():
        pass
    assert [t for e in a for t in e.token_ids] == reference_greedy(model, short, 40, stop_ids(tok))
    assert [t for e in b for t in e.token_ids] == reference_greedy(model, long, 3, stop_ids(tok))
    return per_step


def test_lm_head_runs_only_on_sampled_positions(tok, model):
    rows_seen = []
    hook = model.lm_head.register_forward_pre_hook(lambda m, args: rows_seen.append(tuple(args[0].shape)))
    try:
        prompts = [[tok.bos_id, *tok.encode("a" * 30)], [tok.bos_id, *tok.encode("bb")]]
        ModelRunner(model, tok).generate_batch(prompts, max_tokens=3, temperature=0.0)
    finally:
        hook.remove()
    # prefill of (2, 31): 2 rows into the LM head, not 62 positions; then two decodes of 2 rows of 1 token
    d = model.config.n_embd
    assert rows_seen == [(2, d), (2, 1, d), (2, 1, d)]


class _Writes(TorchDispatchMode):
    """Records how many elements every op materializes: a new output's size; for an op whose output
    aliases an input (a view, or an in-place write such as the cache's index_put_), the size of the
    other tensors it reads from (what it copies in)."""

    def __init__(self):
        super().__init__()
        self.sizes: list[tuple[str, int]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = [t for t in torch.utils._pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        storages = {t.untyped_storage().data_ptr() for t in inputs}
        for t in out if isinstance(out, tuple | list) else [out]:
            if not isinstance(t, torch.Tensor):
                continue
            if t.untyped_storage().data_ptr() in storages:
                own = t.untyped_storage().data_ptr()
                others = [x.numel() for x in inputs if x.untyped_storage().data_ptr() != own]
                self.sizes.append((str(func), max(others, default=0)))
            else:
                self.sizes.append((str(func), t.numel()))
        return out


def test_decode_step_over_scattered_rows_copies_no_history(tok, model):
    """With 3 of 4 rows left after a scattered finish and ~200 cached tokens each, no op of a decode step
    produces a tensor as large as one layer's keys of the busy rows (the old path's index_select did)."""
    sched = Scheduler(ModelRunner(model, tok), max_slots=4, max_len=256, prefill_chunk_tokens=1024)
    limits = [30, 2, 30, 30]
    for i, n in enumerate(limits):
        sched.submit([tok.bos_id, *tok.encode(str(i) * 200)], SamplingParams(max_tokens=n, temperature=0.0))
    for _ in range(4):
        sched.step()
    assert sched.num_active == 3 and sched.cache.lengths[:3].min() >= 200
    cfg = model.config
    history = 3 * cfg.n_kv_head * 200 * cfg.head_dim
    with _Writes() as writes:
        sched.step()
    biggest = max(n for _, n in writes.sizes)
    assert biggest < history / 4, sorted(writes.sizes, key=lambda x: -x[1])[:3]


def test_static_decode_path_of_compiled_graphs_equals_reference(tok, model):
    """compile_decode=True decodes with fixed shapes (rows padded to a bucket with free slots, keys over
    the whole max_len with a mask from device offsets). Run here uncompiled: the same code torch.compile
    captures (compiling it takes ~1 min on this CPU; bench/engine_gpu.py runs it compiled)."""
    engine = ModelRunner(model, tok, compile_decode=True)
    engine._compiled = engine._decode_step
    prompts = [[tok.bos_id, *tok.encode(t)] for t in ("one", "two two", "three three three")]
    sched = Scheduler(engine, max_slots=4, max_len=64)
    limits = [9, 3, 6]
    streams = [
        sched.submit(p, SamplingParams(max_tokens=n, temperature=0.0)) for p, n in zip(prompts, limits)
    ]
    while sched.step():
        pass
    for s, p, n in zip(streams, prompts, limits):
        assert [t for e in s for t in e.token_ids] == reference_greedy(model, p, n, stop_ids(tok))


def test_dtype_selection(tok):
    from raychat.engine.runner import decode_buckets, resolve_dtype

    cpu = torch.device("cpu")
    assert resolve_dtype("auto", cpu, torch.float32) == torch.float32
    assert resolve_dtype("auto", torch.device("cuda"), torch.float32) == torch.bfloat16
    assert resolve_dtype("model", cpu, torch.float16) == torch.float16
    with pytest.raises(ValueError, match="dtype must be 'model', 'auto' or one of"):
        resolve_dtype("fp8", cpu, torch.float32)
    engine = ModelRunner(tiny_gpt(tok), tok, dtype="bfloat16")
    assert (
        engine.model.lm_head.weight.dtype == torch.bfloat16
        and engine.new_cache(1, 8).k.dtype == torch.bfloat16
    )
    (res,) = engine.generate_batch([[tok.bos_id, *tok.encode("bf16")]], max_tokens=4, temperature=0.0)
    assert len(res.completion_tokens) == 4
    assert decode_buckets(48) == [1, 2, 4, 8, 16, 32, 48] and decode_buckets(1) == [1]
