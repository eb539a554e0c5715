"""Per-request fault isolation: a request whose computation fails (non-finite logits, an out-of-memory in
its prefill, a temperature that overflows logits / temperature) ends alone; the other requests produce
exactly what they produce alone; the engine (and an EngineProcess' child) keeps running. Bounds: a full
queue refuses, a request past its deadline ends and frees its slot, a hung step thread fails the health
check."""

from __future__ import annotations

import re
import threading
import time

import pytest
import torch
from support.engine_fixtures import PoisonModel, StubModel, byte_tokenizer, tiny_gpt
from support.serve_helpers import write_tiny_checkpoint

from raychat.checkpoint import load_model
from raychat.engine import ModelRunner, SamplingParams, Scheduler
from raychat.engine.process import EngineProcess
from raychat.engine.scheduler import QueueFullError
from raychat.serve.server import ChatServer


@pytest.fixture(scope="module")
def tok():
    return byte_tokenizer()


def run(sched, requests):
    """Submit every (prompt, params) at once, step to the end; [(completion tokens, text, final event)]."""
    streams = [sched.submit(p, params) for p, params in requests]
    while sched.num_active or sched.num_pending:
        sched.step()
    out = []
    for s in streams:
        events = list(s)
        tokens = [t for e in events for t in e.token_ids]
        out.append((tokens, "".join(e.text for e in events), events[-1]))
    return out


def alone(engine, prompt, params):
    (res,) = run(Scheduler(engine, max_slots=1, max_len=64), [(prompt, params)])
    return res


def test_denormal_temperature_is_greedy_and_its_neighbour_is_unchanged(tok):
    engine = ModelRunner(tiny_gpt(tok), tok)
    normal = ([tok.bos_id, *tok.encode("a normal request")], SamplingParams(max_tokens=20, seed=7))
    tiny = ([tok.bos_id, *tok.encode("tiny")], SamplingParams(max_tokens=20, temperature=5e-324))
    greedy = SamplingParams(max_tokens=20, temperature=0.0)
    got_normal, got_tiny = run(Scheduler(engine, max_slots=2, max_len=64), [normal, tiny])
    assert got_normal[:2] == alone(engine, *normal)[:2] and got_normal[2].finish_reason == "length"
    # 5e-324 < TEMPERATURE_EPS: greedy (before, logits / 5e-324 overflowed to inf and multinomial raised)
    assert got_tiny[:2] == alone(engine, tiny[0], greedy)[:2] and got_tiny[2].error is None


def test_nan_logits_end_only_that_request(tok):
    a, poison = ord("a"), ord("~")
    engine = ModelRunner(PoisonModel(tok.vocab_size, a, poison, "nan"), tok)
    params = SamplingParams(max_tokens=6, seed=1)
    requests = [([tok.bos_id, ord("x")], params), ([tok.bos_id, poison], params), ([tok.bos_id], params)]
    first, bad, last = run(Scheduler(engine, max_slots=3, max_len=64), requests)
    assert bad[0] == [] and bad[2].finish_reason == "error"
    assert bad[2].error == "RuntimeError: non-finite logits (NaN, +inf, or no finite value) from the model"
    assert first[0] == last[0] == [a] * 6 and first[2].finish_reason == "length"
    assert first[:2] == alone(engine, *requests[0])[:2]


def test_out_of_memory_in_one_prefill_ends_only_that_request(tok):
    a, poison = ord("a"), ord("~")
    model = PoisonModel(tok.vocab_size, a, poison, "oom")
    engine = ModelRunner(model, tok)
    params = SamplingParams(max_tokens=5, temperature=0.0)
    requests = [
        ([tok.bos_id, ord("x"), ord("y")], params),
        ([tok.bos_id, poison], params),
        ([tok.bos_id], params),
    ]
    sched = Scheduler(engine, max_slots=3, max_len=64)
    first, bad, last = run(sched, requests)
    assert bad[2].finish_reason == "error" and bad[2].usage.completion_tokens == 0
    assert bad[2].error.startswith("OutOfMemoryError: CUDA out of memory") and "simulated" in bad[2].error
    assert first[0] == last[0] == [a] * 5
    # the batched prefill of all three raised; each was retried alone; then decodes of the two survivors
    assert model.calls[:4] == [(3, 3), (1, 3), (1, 2), (1, 1)]
    assert sched.num_active == 0 and sched.cache.lengths.tolist() == [0, 0, 0]


def test_engine_process_survives_hostile_temperatures_and_cancel_is_true_once(tmp_path):
    checkpoint = write_tiny_checkpoint(tmp_path / "ckpt")
    _, tokenizer, _ = load_model(checkpoint)
    prompt = [tokenizer.bos_id, *tokenizer.encode("json")]
    normal = SamplingParams(max_tokens=12, temperature=0.8, seed=5)
    proc = EngineProcess(checkpoint, max_slots=2, max_len=64)
    try:
        pid = proc._proc.pid
        expected = [(e.text, e.token_ids) for e in proc.submit(prompt, normal)]
        hostile = [
            proc.submit(prompt, SamplingParams(max_tokens=12, temperature=t)) for t in (5e-324, 1e-300)
        ]
        beside = proc.submit(prompt, normal)
        assert [(e.text, e.token_ids) for e in beside] == expected
        for stream in hostile:
            assert list(stream)[-1].finish_reason == "length"
        long = proc.submit(prompt, SamplingParams(max_tokens=50, temperature=1.0, seed=1))
        next(iter(long))
        assert proc.cancel(long.request_id) is True
        assert proc.cancel(long.request_id) is False  # already cancelled
        assert list(long)[-1].finish_reason == "cancelled"
        assert proc.cancel(long.request_id) is False  # finished
        assert proc._proc.pid == pid and proc.restarts == 0 and proc.running
    finally:
        proc.stop()


def test_a_full_queue_refuses_until_a_request_ends(tok):
    """One slot and max_pending=1: two live requests (one decoding, one waiting) fill it; a third is refused;
    once they end, the queue takes requests again."""
    engine = ModelRunner(tiny_gpt(tok), tok)
    sched = Scheduler(engine, max_slots=1, max_len=64, max_pending=1)
    greedy = SamplingParams(max_tokens=4, temperature=0.0)
    taken = [sched.submit([tok.bos_id], greedy) for _ in range(2)]
    full = r"^engine queue full: 1 requests already wait for a KV slot \(max_pending=1\)$"
    with pytest.raises(QueueFullError, match=full):
        sched.submit([tok.bos_id], greedy)
    sched.step()  # one takes the slot, the other still waits: still full
    with pytest.raises(QueueFullError, match=full):
        sched.submit([tok.bos_id], greedy)
    assert [list(s)[-1].finish_reason for s in taken] == ["length", "length"]
    assert list(sched.submit([tok.bos_id], greedy))[-1].finish_reason == "length"
    with pytest.raises(ValueError, match="max_pending must be None or an int >= 1, got 0"):
        Scheduler(engine, max_pending=0)
    with pytest.raises(ValueError, match="request_timeout_s must be None or > 0 seconds, got 0"):
        Scheduler(engine, request_timeout_s=0)


def test_a_request_past_its_deadline_ends_and_frees_its_slot(tok):
    """Both the decoding request and the one waiting for the slot end with "timeout" at the first step
    after their deadline; the slot's KV row is empty and the next request runs as it does alone."""
    engine = ModelRunner(tiny_gpt(tok), tok)
    sched = Scheduler(engine, max_slots=1, max_len=64, request_timeout_s=2.0)
    prompt = [tok.bos_id, *tok.encode("deadline")]
    long = sched.submit(prompt, SamplingParams(max_tokens=50, temperature=0.0))
    waiting = sched.submit(prompt, SamplingParams(max_tokens=50, temperature=0.0))
    sched.step()  # `long`: prompt prefilled, first token sampled and decoded into the cache
    assert (sched.num_active, sched.num_pending, sched.cache.lengths.tolist()) == (1, 1, [len(prompt) + 1])
    time.sleep(2.1)  # both are past their deadline now, however loaded the machine
    sched.step()
    message = (
        r"request timed out: ran \d+\.\d s, past request_timeout_s=2; it was ended and its KV slot freed"
    )
    for stream, tokens in ((long, 1), (waiting, 0)):
        last = list(stream)[-1]
        assert last.finish_reason == "timeout" and re.fullmatch(message, last.error), last.error
        assert last.usage.completion_tokens == tokens
    assert (sched.num_free_slots, sched.num_pending, sched.cache.lengths.tolist()) == (1, 0, [0])
    short = SamplingParams(max_tokens=5, temperature=0.0)
    sched.request_timeout_s = 600.0  # the next request's deadline: one no loaded machine reaches
    after = list(sched.submit(prompt, short))
    expected = alone(engine, prompt, short)
    assert [t for e in after for t in e.token_ids] == expected[0] and after[-1].finish_reason == "length"


class GatedModel(StubModel):
    """Predicts token 97 ("a") everywhere; every forward first waits for `gate` (a hung step until set)."""

    def __init__(self, vocab_size: int):
        row = -5.0 * torch.ones(vocab_size)
        row[97] = 5.0
        super().__init__(vocab_size, lambda pos: row)
        self.gate = threading.Event()

    def forward(self, *args, **kwargs):
        self.gate.wait()
        return super().forward(*args, **kwargs)


def test_a_hung_step_thread_fails_the_health_check(tok):
    """An in-process Scheduler whose step does not return: stalled after stall_timeout_s with a request
    live, and ChatServer.check_health raises naming it; once the step returns, healthy again."""
    model = GatedModel(tok.vocab_size)
    sched = Scheduler(ModelRunner(model, tok), max_slots=1, max_len=64, stall_timeout_s=0.5)
    server = ChatServer(None, tok, scheduler=sched)
    try:
        server.check_health()  # idle: never stalled
        stream = sched.submit([tok.bos_id], SamplingParams(max_tokens=3, temperature=0.0))
        deadline = time.monotonic() + 30
        while not sched.stalled and time.monotonic() < deadline:
            time.sleep(0.05)
        with pytest.raises(RuntimeError, match=r"^engine stalled: no step for \d+\.\d s with requests live "
                           r"\(stall_timeout_s=0\.5\)$"):  # fmt: skip
            server.check_health()
        model.gate.set()
        assert [t for e in stream for t in e.token_ids] == [97] * 3
        assert sched.stalled_s == 0.0
        server.check_health()
    finally:
        model.gate.set()
        server.shutdown()
