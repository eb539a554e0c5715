"""EngineProcess: the Scheduler in a child process gives the same tokens as in-process, cancels, rejects bad
prompts at submit, ends every live stream when the child dies, bounds its queue, and, when the child stops
making progress (SIGSTOP), fails the health check and ends the open streams with the stall error."""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import time
from pathlib import Path

import pyarrow.fs as pafs
import pytest
from support.serve_helpers import write_tiny_checkpoint
from support.stopped_writer import age

from raychat.checkpoint import load_model
from raychat.checkpoint_manager import CACHE_UNUSED_S, resolve_checkpoint
from raychat.engine import ModelRunner, SamplingParams, Scheduler
from raychat.engine.process import EngineProcess
from raychat.engine.scheduler import QueueFullError
from raychat.serve.server import ChatServer

GREEDY = SamplingParams(max_tokens=12, temperature=0.0)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return write_tiny_checkpoint(tmp_path_factory.mktemp("ckpt"))


@pytest.fixture(scope="module")
def engine_process(checkpoint):
    proc = EngineProcess(checkpoint, max_slots=3, max_len=64)
    yield proc
    proc.stop()


def prompts(tokenizer):
    return [
        [tokenizer.bos_id, *tokenizer.encode(text)] for text in ("json", "a longer prompt here", "x", "wrap")
    ]


def drain(stream):
    return [(e.text, e.token_ids, e.finished, e.finish_reason) for e in stream]


def test_same_tokens_as_the_in_process_scheduler(checkpoint, engine_process):
    model, tokenizer, _ = load_model(checkpoint)
    local = Scheduler(ModelRunner(model, tokenizer), max_slots=3, max_len=64)
    local.start()
    try:
        expected = [drain(s) for s in [local.submit(p, GREEDY) for p in prompts(tokenizer)]]
    finally:
        local.stop()
    # 4 requests on 3 rows: one waits for a free row, as in the local run
    streams = [engine_process.submit(p, GREEDY) for p in prompts(tokenizer)]
    assert engine_process.num_pending + engine_process.num_active == 4
    assert [drain(s) for s in streams] == expected
    assert [len(e) for e in expected] == [12] * 4 and expected[0][-1][3] == "length"
    assert (engine_process.num_active, engine_process.num_pending, engine_process.num_free_slots) == (0, 0, 3)


def test_async_consumer_cancel_and_bad_prompts(checkpoint, engine_process):
    _, tokenizer, _ = load_model(checkpoint)

    async def cancel_after_two_events():
        stream = engine_process.submit(
            [tokenizer.bos_id], SamplingParams(max_tokens=60, temperature=1.0, seed=3)
        )
        events = []
        async for event in stream:
            events.append(event)
            if len(events) == 2:
                assert stream.cancel() is True
        return events

    events = asyncio.run(asyncio.wait_for(cancel_after_two_events(), timeout=60))
    assert events[-1].finish_reason == "cancelled" and len(events) < 60
    assert engine_process.num_active == 0 and engine_process.cancel("no-such-request") is False
    with pytest.raises(ValueError) as too_long:
        engine_process.submit([tokenizer.bos_id] * 64)
    assert str(too_long.value) == (
        "the prompt has 64 tokens, but the model's context length is 64 tokens and at least 1 completion token "
        "must follow (64 + 1 > 64): at most 63 fit"
    )
    with pytest.raises(ValueError, match=f"token ids outside 0..{tokenizer.vocab_size - 1}"):
        engine_process.submit([tokenizer.vocab_size])
    with pytest.raises(ValueError, match="wake_every must be an int >= 1"):
        engine_process.submit([tokenizer.bos_id], wake_every=0)


def test_child_death_ends_live_streams_and_a_new_child_takes_over(checkpoint):
    proc = EngineProcess(checkpoint, max_slots=2, max_len=256)
    _, tokenizer, _ = load_model(checkpoint)
    try:
        expected = drain(proc.submit([tokenizer.bos_id], GREEDY))
        stream = proc.submit([tokenizer.bos_id], SamplingParams(max_tokens=200, temperature=1.0, seed=0))
        first = next(iter(stream))
        assert not first.finished and proc.running
        os.kill(proc._proc.pid, signal.SIGKILL)
        last = list(stream)[-1]
        assert last.finished and last.finish_reason == "error" and "exited with code -9" in last.error
        assert (proc.num_active, proc.num_pending, proc.num_free_slots) == (0, 0, 2)
        deadline = time.monotonic() + 60
        while not proc.running and time.monotonic() < deadline:
            time.sleep(0.05)
        assert proc.running and proc.restarts == 1 and proc.num_active == 0
        assert drain(proc.submit([tokenizer.bos_id], GREEDY)) == expected
    finally:
        proc.stop()
    assert proc._proc.poll() is not None


def test_no_restarts_left_stops_the_engine(checkpoint):
    proc = EngineProcess(checkpoint, max_slots=2, max_len=64, max_restarts=0)
    _, tokenizer, _ = load_model(checkpoint)
    try:
        os.kill(proc._proc.pid, signal.SIGKILL)
        proc._reader.join(10)
        assert not proc.running and "exited with code -9" in str(proc.last_error)
        with pytest.raises(
            RuntimeError, match="engine process is not running \\(stopped: engine process exited"
        ):
            proc.submit([tokenizer.bos_id])
    finally:
        proc.stop()


def test_start_errors(checkpoint, tmp_path):
    with pytest.raises(ValueError, match="max_slots must be an int >= 1, got 0"):
        EngineProcess(checkpoint, max_slots=0)
    with pytest.raises(FileNotFoundError, match="not a raychat checkpoint"):
        EngineProcess(tmp_path)


def test_chat_engine_over_an_engine_process(checkpoint):
    """ChatServer.from_checkpoint(engine_process=True) streams the same reply as the in-process ChatServer."""
    request = {
        "messages": [{"role": "user", "content": "Tell me about json."}],
        "max_tokens": 10,
        "temperature": 0,
    }

    async def reply(engine):
        try:
            events = [e async for e in engine.generate(request)]
            return events, engine.stats()
        finally:
            engine.shutdown()

    local, _ = asyncio.run(reply(ChatServer.from_checkpoint(checkpoint, max_slots=2)))
    remote, stats = asyncio.run(
        reply(ChatServer.from_checkpoint(checkpoint, engine_process=True, max_slots=2))
    )
    strip = lambda events: [{k: v for k, v in e.items() if k != "usage"} for e in events]  # noqa: E731
    assert strip(remote) == strip(local) and remote[-1]["usage"]["completion_tokens"] == 10
    assert stats["in_flight"] == 0 and stats["completed"] == 1 and stats["free_rows"] == 2


def test_http_while_the_engine_process_is_down(checkpoint):
    """A replica whose engine process is gone answers 503 with a JSON error, and /health says so."""
    from fastapi.testclient import TestClient

    from raychat.serve.ingress import LocalClient, create_app

    engine = ChatServer.from_checkpoint(checkpoint, engine_process=True, max_slots=2)
    try:
        engine.scheduler.max_restarts = 0
        client = TestClient(create_app(LocalClient(engine)))
        assert client.get("/health").json()["status"] == "ok"
        os.kill(engine.scheduler._proc.pid, signal.SIGKILL)
        engine.scheduler._reader.join(10)
        body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
        for path in ("/chat/completions", "/v1/chat/completions"):
            resp = client.post(path, json=body)
            assert resp.status_code == 503 and resp.headers["retry-after"] == "5"
            error = resp.json()["error"]
            assert error["type"] == "server_error" and error["message"].startswith("engine unavailable: ")
        health = client.get("/health")
        assert health.status_code == 503 and health.json()["status"] == "unavailable"
        assert (
            health.json()["engine"]["engine_running"] is False and health.json()["engine"]["in_flight"] == 0
        )
    finally:
        engine.shutdown()


def test_queue_bound_while_the_child_is_stopped(checkpoint):
    """While the child is stopped, max_slots + max_pending requests are taken (2 for the slots, 3 waiting),
    the next raises QueueFullError; after SIGCONT the taken ones complete and the queue has room again."""
    proc = EngineProcess(checkpoint, max_slots=2, max_len=64, max_pending=3)
    _, tokenizer, _ = load_model(checkpoint)
    try:
        expected = drain(proc.submit([tokenizer.bos_id], GREEDY))
        os.kill(proc._proc.pid, signal.SIGSTOP)
        try:
            taken = [proc.submit([tokenizer.bos_id], GREEDY) for _ in range(5)]
            full = r"^engine queue full: 3 requests already wait for a KV slot \(max_pending=3\)$"
            with pytest.raises(QueueFullError, match=full):
                proc.submit([tokenizer.bos_id], GREEDY)
            assert proc.num_pending == 5  # none has its first event yet
        finally:
            os.kill(proc._proc.pid, signal.SIGCONT)
        assert [drain(s) for s in taken] == [expected] * 5
        assert drain(proc.submit([tokenizer.bos_id], GREEDY)) == expected and proc.restarts == 0
    finally:
        proc.stop()


@pytest.fixture(scope="module")
def long_checkpoint(tmp_path_factory):
    """Rows of 4,096 tokens: a stream that runs to the end of its row lasts seconds on this tiny model."""
    return write_tiny_checkpoint(tmp_path_factory.mktemp("long"), max_seq_len=4096)


def test_counts_are_the_child_schedulers_during_a_long_prefill_and_a_score(long_checkpoint):
    """A 1,500-token prompt prefilled 8 tokens a step holds its row for ~190 steps before its first event:
    (num_active, num_pending, num_free_slots) reads (1, 0, 1) then, as the child's Scheduler has it (before
    the child reads the submit: (0, 1, 2)). A score() of that prompt takes no row and never waits: (0, 0, 2)
    throughout, as with the in-process Scheduler. Idle: (0, 0, 2)."""
    proc = EngineProcess(long_checkpoint, max_slots=2, max_len=1600, prefill_chunk_tokens=8)
    prompt = [1 + i % 500 for i in range(1500)]

    def counts_until_the_first_event(stream) -> set[tuple[int, int, int]]:
        seen, deadline = set(), time.monotonic() + 60
        while time.monotonic() < deadline:
            counts = (proc.num_active, proc.num_pending, proc.num_free_slots)
            if stream._pushed:  # counts may be from after the event
                return seen
            seen.add(counts)
            time.sleep(0.005)
        raise AssertionError(f"no event within 60 s; counts seen {seen}")

    try:
        stream = proc.submit(prompt, SamplingParams(max_tokens=2, temperature=0.0))
        seen = counts_until_the_first_event(stream)
        assert (1, 0, 1) in seen and seen <= {(0, 1, 2), (1, 0, 1)}, seen
        events = list(stream)
        assert [len(e.token_ids) for e in events] == [1, 1] and events[-1].finish_reason == "length"
        assert (proc.num_active, proc.num_pending, proc.num_free_slots) == (0, 0, 2)

        scored = proc.score(prompt, 0)
        assert counts_until_the_first_event(scored) <= {(0, 0, 2)}  # empty if it ended before a look
        (event,) = list(scored)
        assert event.finish_reason == "stop" and len(event.prompt_logprobs) == 1500
        assert (proc.num_active, proc.num_pending, proc.num_free_slots) == (0, 0, 2)
    finally:
        proc.stop()


async def health_failure(server: ChatServer, timeout_s: float) -> RuntimeError | None:
    """The first RuntimeError of server.check_health() within timeout_s (checked every 0.1 s), or None."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            server.check_health()
        except RuntimeError as e:
            return e
        await asyncio.sleep(0.1)
    return None


def test_a_stopped_child_fails_the_health_check_and_ends_open_streams(long_checkpoint):
    """SIGSTOP the engine child with one stream generating and one queued: within stall_timeout_s (plus a
    watch period) the health check raises, both streams end with the stall error (503 for the replica's
    generate), the child is killed and not restarted, and new requests get 503."""
    server = ChatServer.from_checkpoint(
        long_checkpoint, engine_process=True, max_slots=2, stall_timeout_s=1.0
    )
    proc = server.scheduler
    prompt = [server.tokenizer.bos_id]
    # greedy, this prompt runs to the end of the 4,096-token row (~13 s alone here), so it is mid-stream
    request = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": None, "temperature": 0}

    async def scenario():
        generating = server.generate(request)
        first = await anext(generating)
        os.kill(proc._proc.pid, signal.SIGSTOP)
        queued = proc.submit(prompt, GREEDY)
        error = await health_failure(server, timeout_s=60)
        rest = [event async for event in generating]
        rejected = [event async for event in server.generate(request)]
        return first, error, rest, list(queued), rejected

    try:
        server.check_health()
        first, error, rest, queued, rejected = asyncio.run(asyncio.wait_for(scenario(), timeout=120))
        stall = r"engine process stalled: no step for \d+\.\d s with 2 requests live \(stall_timeout_s=1\); "
        stall += "killed it, the replica's health check fails"
        assert first["type"] == "delta"
        seen_by_health = rf"engine (stalled: no step for \d+\.\d s with requests live \(stall_timeout_s=1\)|stopped: {stall})"
        assert error is not None and re.fullmatch(seen_by_health, str(error)), error
        assert (
            rest[-1]["type"] == "error"
            and rest[-1]["status"] == 503
            and re.fullmatch(stall, rest[-1]["message"])
        )
        assert queued[-1].finish_reason == "error" and re.fullmatch(stall, queued[-1].error)
        assert proc._proc.poll() == -signal.SIGKILL and proc.restarts == 0 and not proc.running
        with pytest.raises(RuntimeError, match="^engine stopped: engine process stalled: "):
            server.check_health()
        assert rejected == [{"type": "error", "status": 503, "param": None,
                             "message": f"engine unavailable: engine process is not running (stopped: {queued[-1].error})"}]  # fmt: skip
        assert server.stats()["in_flight"] == 0
    finally:
        server.shutdown()


def test_a_checkpoint_on_object_storage_is_served_from_the_nodes_copy(
    checkpoint, s3_env, tmp_path, monkeypatch
):
    """`raychat serve --checkpoint s3://...` deployed no replica: each one failed with `no tokenizer at
    s3:/bucket/...` (the URI handed to a local file API). The replica fetches the checkpoint into its node's
    cache once; its engine process, restarted too, loads that copy, so it serves on when the bucket's copy is
    gone. The model id is the URI as given (not the cached copy's name), as for a local checkpoint. The server marks that copy in use
    while it runs (every IN_USE_MARK_S, here 0.05 s), so a new commit of the checkpoint resolved a day after
    the server's resolve keeps it: it was deleted, and the engine's next restart failed."""
    monkeypatch.setattr("raychat.checkpoint_manager.DEFAULT_CACHE", tmp_path / "cache")
    monkeypatch.setattr("raychat.serve.server.IN_USE_MARK_S", 0.05)
    bucket = s3_env.make_bucket()
    fs, where = s3_env.filesystem(), f"{bucket}/runs/r/checkpoint_000000"
    pafs.copy_files(str(checkpoint), where, destination_filesystem=fs)
    request = {
        "messages": [{"role": "user", "content": "Tell me about json."}],
        "max_tokens": 6,
        "temperature": 0,
    }

    async def reply(engine):
        return [{k: v for k, v in e.items() if k != "usage"} async for e in engine.generate(request)]

    local = ChatServer.from_checkpoint(checkpoint, max_slots=2)
    try:
        expected = asyncio.run(reply(local))
    finally:
        local.shutdown()
    server = ChatServer.from_checkpoint(f"s3://{where}", engine_process=True, max_slots=2)
    try:
        assert server.info()["model_id"] == f"s3://{where}"
        assert asyncio.run(reply(server)) == expected and expected[-1]["finish_reason"] == "length"
        copy = Path(server.in_use.directory)
        assert copy.parent == tmp_path / "cache" and (copy / "model.safetensors").is_file()
        age(copy, CACHE_UNUSED_S + 60)
        deadline = time.monotonic() + 5
        while time.time() - copy.stat().st_mtime > 60:  # the server's next mark
            assert time.monotonic() < deadline, "the server did not mark its copy within 5 s"
            time.sleep(0.02)
        commit = json.loads(fs.open_input_file(f"{where}/commit.json").read())
        with fs.open_output_stream(f"{where}/commit.json") as f:  # committed again, a day later
            f.write(json.dumps({**commit, "committed_at": commit["committed_at"] + 1}).encode())
        assert resolve_checkpoint(f"s3://{where}") != copy and (copy / "model.safetensors").is_file()
        fs.delete_dir(where)
        os.kill(server.scheduler._proc.pid, signal.SIGKILL)
        deadline = time.monotonic() + 60
        while server.scheduler.restarts == 0 or not server.scheduler.running:
            assert time.monotonic() < deadline, server.scheduler.last_error
            time.sleep(0.05)
        assert asyncio.run(reply(server)) == expected
    finally:
        server.shutdown()
