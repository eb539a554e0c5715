"""Continuous batching: streams equal batched generation, late admission, cancel, async consumption."""

from __future__ import annotations

import asyncio

import pytest
from support.engine_fixtures import byte_tokenizer, scripted_model, tiny_gpt

from raychat.engine import KVBudgetError, ModelRunner, SamplingParams, Scheduler

GREEDY = SamplingParams(max_tokens=10, temperature=0.0)


@pytest.fixture(scope="module")
def tok():
    return byte_tokenizer()


@pytest.fixture(scope="module")
def engine(tok):
    return ModelRunner(tiny_gpt(tok), tok)


def prompt(tok, s):
    return [tok.bos_id, *tok.encode(s)]


def drain(stream):
    events = list(stream)
    assert [e.finished for e in events] == [False] * (len(events) - 1) + [True]
    return events


def test_stream_equals_generate_batch(tok, engine):
    p = prompt(tok, "stream me")
    (ref,) = engine.generate_batch([p], max_tokens=10, temperature=0.0)
    sched = Scheduler(engine, max_slots=2, max_len=64)
    events = drain(sched.submit(p, GREEDY, request_id="r1"))
    assert [t for e in events for t in e.token_ids] == ref.completion_tokens
    assert "".join(e.text for e in events) == ref.text
    last = events[-1]
    assert last.finish_reason == "length" and last.request_id == "r1"
    assert last.usage.prompt_tokens == len(p) and last.usage.completion_tokens == 10
    assert sched.num_free_slots == 2


def test_late_admission_and_queueing(tok, engine):
    prompts = [prompt(tok, s) for s in ("first one", "b", "a third prompt here")]
    refs = engine.generate_batch(prompts, max_tokens=10, temperature=0.0)
    sched = Scheduler(engine, max_slots=2, max_len=64)
    streams = [sched.submit(prompts[0], GREEDY)]
    for _ in range(3):
        sched.step()
    streams += [sched.submit(p, GREEDY) for p in prompts[1:]]
    assert sched.step() == 2  # row 1 admits prompt 1; prompt 2 waits for a free row
    assert sched.num_pending == 1
    while sched.num_active or sched.num_pending:
        sched.step()
    for s, ref in zip(streams, refs):
        tokens = [t for e in drain(s) for t in e.token_ids]
        assert tokens == ref.completion_tokens


def test_cancel_frees_row_within_one_step_and_is_idempotent(tok, engine):
    sched = Scheduler(engine, max_slots=2, max_len=64)
    stream = sched.submit(prompt(tok, "long"), SamplingParams(max_tokens=50, temperature=0.0), request_id="c")
    sched.step()
    sched.step()
    assert sched.num_free_slots == 1
    assert sched.cancel("c") is True
    assert sched.cancel("c") is False  # second call: harmless no-op
    sched.step()
    assert sched.num_free_slots == 2
    assert sched.cancel("c") is False
    events = drain(stream)
    assert events[-1].finish_reason == "cancelled" and events[-1].usage.completion_tokens == 2
    assert sched.step() == 0
    # its first token's event, and that one alone, carries the usage a replica's TTFT / prefix-cache
    # metrics count (StreamEvent.first): a request cancelled after its first token is counted once
    assert [e.first is not None for e in events] == [True, False, False]
    first = events[0].first
    assert (first.prompt_tokens, first.completion_tokens, first.cached_tokens) == (
        len(prompt(tok, "long")),
        1,
        0,
    )
    assert first.ttft_s == events[-1].usage.ttft_s > 0 and first.total_s == first.ttft_s


def test_a_one_token_request_carries_first_on_its_final_event(tok, engine):
    sched = Scheduler(engine, max_slots=1, max_len=64)
    (event,) = drain(sched.submit(prompt(tok, "one"), SamplingParams(max_tokens=1, temperature=0.0)))
    assert event.finish_reason == "length" and event.first.completion_tokens == 1
    assert event.first.ttft_s == event.usage.ttft_s


def test_cancel_pending_request(tok, engine):
    sched = Scheduler(engine, max_slots=1, max_len=64)
    sched.submit(prompt(tok, "a"), GREEDY)
    waiting = sched.submit(prompt(tok, "b"), GREEDY, request_id="w")
    sched.step()
    assert sched.num_pending == 1 and waiting.cancel() is True
    sched.step()
    assert sched.num_pending == 0
    (last,) = [e for e in waiting._events]
    assert last.finish_reason == "cancelled" and last.usage.completion_tokens == 0
    assert last.first is None and last.usage.ttft_s is None  # no first token: counted in no TTFT


def test_tool_and_stop_through_scheduler(tok):
    ps, pe = tok.special_id("<|python_start|>"), tok.special_id("<|python_end|>")
    body = [ps, *tok.encode("2*21"), pe]
    model = scripted_model(tok.vocab_size, {1 + i: t for i, t in enumerate(body)}, default=ord("!"))
    sched = Scheduler(ModelRunner(model, tok), max_slots=1, max_len=64)
    events = drain(sched.submit([tok.bos_id], SamplingParams(max_tokens=30, temperature=0, stop=["!!"])))
    text = "".join(e.text for e in events)
    assert text == "<|python_start|>2*21<|python_end|><|output_start|>42<|output_end|>"
    assert events[-1].finish_reason == "stop"


WITH_RESULT = "ab<|python_start|>6*7<|python_end|><|output_start|>42<|output_end|>"
EVERYTHING = WITH_RESULT + "=42*c!!!!"


@pytest.mark.parametrize(
    ("stop", "text", "reason"),
    [
        ((), EVERYTHING, "length"),
        (["*"], WITH_RESULT + "=42", "stop"),  # not in the call
        (["42"], WITH_RESULT + "=", "stop"),  # not the result
        (["7"], EVERYTHING, "length"),  # only inside the call
        (["<|"], EVERYTHING, "length"),  # a marker is a token, not text
        (["b<"], EVERYTHING, "length"),  # "ab" then a marker: no visible text spans it
        (["<|python_end|>"], "ab<|python_start|>6*7", "stop"),  # a special token's text: a stop token
    ],
)
def test_stop_strings_match_the_visible_text_only(tok, stop, text, reason):
    """Sampled: "ab", a call of 6*7, then (after the 4 forced result tokens) "=42*c" and "!" (max_tokens 20).
    A stop string never cuts a call's expression, never matches its result or a marker; the call's
    <|python_end|> as a stop string ends the row at that token (kept in tokens, its text not emitted)."""
    ps, pe = tok.special_id("<|python_start|>"), tok.special_id("<|python_end|>")
    sampled = [*tok.encode("ab"), ps, *tok.encode("6*7"), pe]
    script = {1 + i: t for i, t in enumerate(sampled)} | {
        12 + i: t for i, t in enumerate(tok.encode("=42*c"))
    }
    model = scripted_model(tok.vocab_size, script, default=ord("!"))
    sched = Scheduler(ModelRunner(model, tok), max_slots=1, max_len=64)
    events = drain(sched.submit([tok.bos_id], SamplingParams(max_tokens=20, temperature=0, stop=stop)))
    assert ("".join(e.text for e in events), events[-1].finish_reason) == (text, reason)
    if stop == ["<|python_end|>"]:
        assert [t for e in events for t in e.token_ids] == sampled  # ends with the stop token


def test_async_stream_with_background_thread(tok, engine):
    p = prompt(tok, "async")
    (ref,) = engine.generate_batch([p], max_tokens=10, temperature=0.0)
    sched = Scheduler(engine, max_slots=2, max_len=64)
    sched.start()
    try:

        async def consume():
            return [e async for e in sched.submit(p, GREEDY)]

        events = asyncio.run(asyncio.wait_for(consume(), timeout=60))
    finally:
        sched.stop()
    assert [t for e in events for t in e.token_ids] == ref.completion_tokens
    assert events[-1].finished and not sched.running


def test_async_wake_every_batches_wakeups_without_changing_events(tok, engine, monkeypatch):
    import raychat.engine.stream as stream_module

    p = prompt(tok, "wake")
    params = SamplingParams(max_tokens=13, temperature=0.0)
    wakes = []
    real_resolve = stream_module._resolve
    monkeypatch.setattr(stream_module, "_resolve", lambda f: (wakes.append(1), real_resolve(f)))
    sched = Scheduler(engine, max_slots=2, max_len=64)
    sched.start()
    try:

        async def consume(wake_every):
            wakes.clear()
            events = [e async for e in sched.submit(p, params, wake_every=wake_every)]
            return events, len(wakes)

        one, _ = asyncio.run(asyncio.wait_for(consume(1), timeout=60))
        four, n_wakes = asyncio.run(asyncio.wait_for(consume(4), timeout=60))
    finally:
        sched.stop()
    assert [(e.text, e.token_ids, e.finished) for e in four] == [
        (e.text, e.token_ids, e.finished) for e in one
    ]
    assert len(one) == 13
    # the first event wakes, then one wake per 4 queued events, and the finished event: <= 1 + 13 // 4 + 1
    assert 1 <= n_wakes <= 5
    with pytest.raises(ValueError, match="wake_every must be an int >= 1, got 0"):
        sched.submit(p, params, wake_every=0)


def test_budget_sizes_rows(tok, engine):
    # 512 bytes/token (see test_engine); rows of 64 tokens = 32768 bytes each
    assert Scheduler(engine, max_slots=8, max_len=64, kv_budget_bytes=3 * 32768 + 100).max_slots == 3
    with pytest.raises(KVBudgetError, match=r"kv_budget_bytes 1000 cannot hold one row of max_len 64 tokens"):
        Scheduler(engine, max_slots=8, max_len=64, kv_budget_bytes=1000)
    with pytest.raises(ValueError) as err:
        Scheduler(engine, max_slots=8, max_len=64, kv_budget_bytes=-1)
    assert str(err.value) == "kv_budget_bytes must be None (no cap) or an int >= 1 (bytes), got -1"


def test_submit_validation(tok, engine):
    sched = Scheduler(engine, max_slots=1, max_len=16)
    with pytest.raises(ValueError) as err:
        sched.submit([tok.bos_id] * 16)
    assert str(err.value) == (
        "the prompt has 16 tokens, but the model's context length is 16 tokens and at least 1 completion token "
        "must follow (16 + 1 > 16): at most 15 fit"
    )
    sched.submit([tok.bos_id], request_id="x")
    with pytest.raises(ValueError, match="already live"):
        sched.submit([tok.bos_id], request_id="x")


def test_rows_finishing_at_different_times_and_row_reuse(tok, engine):
    # B (slot 1) finishes first; compaction moves C from slot 2 into slot 1, so A and C decode as slots
    # 0 and 1; D is then admitted into slot 2 while slots 0 and 1 hold longer, different-length histories.
    texts = {"A": "alpha", "B": "bee", "C": "gamma ray", "D": "delta"}
    limits = {"A": 12, "B": 3, "C": 12, "D": 6}
    refs = {
        k: engine.generate_batch([prompt(tok, t)], max_tokens=limits[k], temperature=0.0)[0].completion_tokens
        for k, t in texts.items()
    }
    sched = Scheduler(engine, max_slots=3, max_len=64)
    params = {k: SamplingParams(max_tokens=n, temperature=0.0) for k, n in limits.items()}
    streams = {k: sched.submit(prompt(tok, texts[k]), params[k]) for k in "ABC"}
    for _ in range(4):
        sched.step()
    assert [r and r.id for r in sched._slots] == [streams["A"].request_id, streams["C"].request_id, None]
    lengths = [len(prompt(tok, "alpha")) + 4, len(prompt(tok, "gamma ray")) + 4, 0]
    assert sched.cache.lengths.tolist() == lengths
    streams["D"] = sched.submit(prompt(tok, texts["D"]), params["D"])
    while sched.step():
        pass
    for k, s in streams.items():
        assert [t for e in drain(s) for t in e.token_ids] == refs[k], k


def test_seeded_streams_reuse_the_sampling_batch_and_an_idle_scheduler_holds_nothing(tok, engine):
    """Seeded sampled streams give the same tokens alone and side by side while the Scheduler reuses one
    SamplingBatch across steps (the same rows) and rebuilds it as rows join and leave; once idle it keeps
    no finished request or logits."""
    params = [
        SamplingParams(max_tokens=n, temperature=0.9, top_k=20, top_p=0.9, seed=s)
        for n, s in ((12, 1), (5, 2))
    ]
    p = prompt(tok, "reuse")
    alone = []
    for sp in params:
        sched = Scheduler(engine, max_slots=1, max_len=64)
        alone.append([t for e in drain(sched.submit(p, sp)) for t in e.token_ids])
    sched = Scheduler(engine, max_slots=2, max_len=64)
    streams = [sched.submit(p, sp) for sp in params]
    batches, sampled_steps = [], 0  # the batches themselves: kept alive, their ids stay distinct
    while sched.step():
        if sched._sampling is not None:
            if not any(b is sched._sampling[1] for b in batches):
                batches.append(sched._sampling[1])
            sampled_steps += 1
    assert [[t for e in drain(s) for t in e.token_ids] for s in streams] == alone
    assert 2 <= len(batches) < sampled_steps  # rebuilt when the short request left, reused in between
    assert sched._sampling is None and sched._decoded is None
