"""The real engine in-process behind the real FastAPI app (no Ray): greedy equality, stream interval,
disconnect frees the row, a failing forward answered in the error shape, and the multi-turn calculator round
trip (the history a client sends back renders to exactly the ids the model generated) over every route:
OpenAI non-streaming and streaming, client-run calls, and the raychat SSE endpoint."""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time

import pytest
import requests
import torch
from fastapi.testclient import TestClient
from openai.lib.streaming.chat import ChatCompletionStreamState
from openai.types.chat import ChatCompletionChunk
from support.engine_fixtures import StubModel, byte_tokenizer
from support.serve_helpers import tiny_model_and_tokenizer

from raychat.chat.turn import turn_parts
from raychat.chat_template import render_for_completion
from raychat.checkpoint import load_model
from raychat.engine import ModelRunner
from raychat.metrics import ServeMetrics
from raychat.ports import free_ports
from raychat.serve.errors import INTERNAL_ERROR
from raychat.serve.ingress import LocalClient, create_app
from raychat.serve.server import GAUGE_PERIOD_S, ChatServer, merge_deltas
from raychat.serve.sse import parse_sse

USER = [{"role": "user", "content": "hi"}]
V1 = "/v1/chat/completions"
Q1, Q2 = "What is 47 * 12?", "And 5 + 6?"


class RecordingClient(LocalClient):
    """LocalClient that keeps every engine request (their template messages are what gets rendered)."""

    def __init__(self, engine):
        super().__init__(engine)
        self.requests = []

    def generate(self, request):
        self.requests.append(request)
        return super().generate(request)


@pytest.fixture(scope="module")
def tiny():
    return tiny_model_and_tokenizer()


@pytest.fixture(scope="module")
def real_engine(tiny):
    engine = ChatServer(*tiny, max_slots=4, model_id="tiny")
    yield engine
    engine.shutdown()


def assert_400(resp, field, fragment):
    assert resp.status_code == 400, resp.text
    err = resp.json()["error"]
    assert err["param"] == field and fragment in err["message"], err


def test_real_engine_greedy_matches_generate_batch(tiny, real_engine):
    model, tokenizer = tiny
    client = TestClient(create_app(LocalClient(real_engine)))
    conv = [{"role": "user", "content": "Tell me about json."}]
    expected = ModelRunner(model, tokenizer).generate_batch(
        [render_for_completion(tokenizer, conv)], max_tokens=24, temperature=0
    )[0]
    resp = client.post("/chat/completions", json={"messages": conv, "max_tokens": 24, "temperature": 0})
    events = [json.loads(e) for e in parse_sse(resp.text)]
    visible = "".join(t for k, t in turn_parts(tokenizer, expected.completion_tokens) if k == "text")
    assert "".join(e.get("text", "") for e in events) == visible
    assert events[-1]["finish_reason"] == expected.finish_reason
    assert events[-1]["usage"]["completion_tokens"] == len(expected.completion_tokens)
    assert events[-1]["usage"]["prompt_tokens"] == expected.num_prompt_tokens
    too_long = [{"role": "user", "content": "json " * 400}]
    n = len(render_for_completion(tokenizer, too_long))
    assert_400(
        client.post("/chat/completions", json={"messages": too_long}),
        "messages",
        f"the conversation has {n} tokens, but the model's context length is 256 tokens and at least 1 "
        f"completion token must follow ({n} + 1 > 256): at most 255 fit; drop earlier messages",
    )
    assert real_engine.stats()["in_flight"] == 0 and real_engine.stats()["rejected"] == 1


def test_stream_interval_groups_tokens_into_deltas(tiny):
    """stream_interval=4: the first delta at once, then 4 tokens per delta, the rest when the request ends;
    the same text and tokens as streaming every token."""
    conv = [{"role": "user", "content": "Tell me about json."}]
    request = {"messages": conv, "max_tokens": 14, "temperature": 0}

    async def deltas(engine):
        try:
            return [ev async for ev in engine.generate(request)]
        finally:
            engine.shutdown()

    every = asyncio.run(deltas(ChatServer(*tiny, max_slots=2)))
    grouped = asyncio.run(deltas(ChatServer(*tiny, max_slots=2, stream_interval=4)))
    for final in (every[-1], grouped[-1]):
        assert final["finish_reason"] == "length" and final["usage"]["completion_tokens"] == 14
    text = "".join(e.get("text", "") for e in every[:-1])
    assert "".join(e.get("text", "") for e in grouped[:-1]) == text
    assert sum(e.get("tokens", 0) for e in every) == 14
    assert [e["tokens"] for e in grouped if e["type"] == "delta"] == [
        1,
        4,
        4,
        4,
        1,
    ]  # 1 + 4 + 4 + 4 + the last
    with pytest.raises(ValueError, match="stream_interval must be an int >= 1, got 0"):
        ChatServer(*tiny, stream_interval=0)


def test_merge_deltas():
    def d(text, n, logprobs=None):
        return {"type": "delta", "text": text, "tokens": n, "logprobs": logprobs}

    done = {"type": "done", "finish_reason": "stop", "usage": {}}
    assert merge_deltas([d("a", 1), d("", 1), d("bc", 2), done]) == [d("abc", 4), done]
    assert merge_deltas([d("a", 1)]) == [d("a", 1)]
    assert merge_deltas([done]) == [done]
    # under load several deltas travel in one message: every token's logprob survives, in order
    lp = [{"token": t, "logprob": -i} for i, t in enumerate("abc")]
    merged = merge_deltas([d("a", 1, lp[:1]), d("", 0, []), d("bc", 2, lp[1:]), done])
    assert merged == [d("abc", 3, lp), done]


def test_a_failing_forward_is_a_500_in_the_error_shape_not_a_crash(caplog):
    """A forward that raises (the in-thread Scheduler fails the busy requests and keeps serving): the
    non-streaming answer is a 500 error body, the streaming one an error event, each naming only a request
    id (the exception text is in the log under it); the server still answers."""
    tok = byte_tokenizer()

    def logits(pos):  # the prompt (6 tokens) prefills; decoding fails at position 9
        if pos >= 9:
            raise RuntimeError("CUDA out of memory (simulated)")
        row = torch.zeros(tok.vocab_size)
        row[ord("a")] = 5.0
        return row

    engine = ChatServer(StubModel(tok.vocab_size, logits), tok, max_slots=2)
    try:
        client = TestClient(create_app(LocalClient(engine)))
        resp = client.post(V1, json={"messages": USER, "max_tokens": 20})
        assert resp.status_code == 500, resp.text
        error = resp.json()["error"]
        assert error["type"] == "server_error" and "CUDA" not in resp.text
        assert error["message"].startswith(f"{INTERNAL_ERROR} (request id {error['request_id']};")
        streamed = parse_sse(client.post(V1, json={"messages": USER, "max_tokens": 20, "stream": True}).text)
        in_stream = json.loads(streamed[-2])["error"]
        assert in_stream["request_id"] != error["request_id"] and "CUDA" not in streamed[-2]
        for request_id in (error["request_id"], in_stream["request_id"]):
            (logged,) = [r.getMessage() for r in caplog.records if request_id in r.getMessage()]
            assert "CUDA out of memory (simulated)" in logged
        assert engine.stats()["engine_running"] and engine.stats()["in_flight"] == 0
    finally:
        engine.shutdown()


def _hang_up_after_first_event(engine: ChatServer, port: int, path: str, body: dict) -> float:
    """POST `body` as JSON over a raw socket and close it once the first `data: ` event arrived (a client that
    stops generation; `engine` still serves it then); returns the seconds from sending to that event."""
    data = json.dumps(body).encode()
    with socket.create_connection(("127.0.0.1", port)) as sock:
        sent = time.perf_counter()
        sock.sendall(f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     f"Content-Length: {len(data)}\r\n\r\n".encode() + data)  # fmt: skip
        got = b""
        while b"data: " not in got:
            chunk = sock.recv(4096)
            assert chunk, got
            got += chunk
        first_s = time.perf_counter() - sent
        assert engine.stats()["in_flight"] == 1
    return first_s


def test_disconnect_mid_stream_frees_the_row(real_engine, monkeypatch):
    """A real HTTP server (uvicorn on loopback): of five chat streams and one /v1/completions stream, sent one
    after another, four hang up after their first event. The replica's gauges then read 0 (running,
    waiting, KV slots): they kept the request's "waiting 1" of its submit for ever, as its end (a cancel the
    engine takes at its next step) published nothing. TTFT and the prefix-cache counters count every
    request once, at its first token, those whose client left too (they were counted only from a finished
    request's usage): six TTFT observations, the finished streams' equal to their usage's ttft_s, the others
    no later than their client saw its first event; queries = each prompt's tokens, hits = the whole blocks
    of the earlier identical prompts (16 * ((n - 1) // 16), the last prompt token is always recomputed)."""
    import uvicorn

    gauges, ttfts, cache = {}, [], []
    for name in ("set_running", "set_waiting", "set_kv_slots_in_use"):
        monkeypatch.setattr(ServeMetrics, name, lambda _self, n, name=name: gauges.__setitem__(name, n))
    monkeypatch.setattr(ServeMetrics, "observe_ttft", lambda _self, seconds: ttfts.append(seconds))
    monkeypatch.setattr(
        ServeMetrics, "add_prefix_cache", lambda _self, queries, hits: cache.append((queries, hits))
    )

    port = free_ports(1)[0]
    server = uvicorn.Server(
        uvicorn.Config(create_app(LocalClient(real_engine)), host="127.0.0.1", port=port, log_level="warning")
    )
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        deadline = time.time() + 10
        while not server.started and time.time() < deadline:
            time.sleep(0.05)
        before = real_engine.stats()["cancelled"]
        messages = [{"role": "user", "content": "Tell me when to stop. " * 4}]  # no other test sends it
        n = len(render_for_completion(real_engine.tokenizer, messages))
        assert n > 32
        stream = {"messages": messages, "temperature": 1.0, "seed": 1}
        hang_ups, finished = [], []
        for i, hang_up in enumerate((True, False, True, True, False)):
            body = {**stream, "max_tokens": 150 if hang_up else 6}
            if hang_up:
                hang_ups.append((i, _hang_up_after_first_event(real_engine, port, "/chat/completions", body)))
            else:
                reply = requests.post(f"http://127.0.0.1:{port}/chat/completions", json=body, timeout=60)
                finished.append((i, json.loads(parse_sse(reply.text)[-1])["usage"]["ttft_s"]))
        ids = list(range(300, 340))  # a 40-token completions prompt no other test sends
        body = {"prompt": ids, "max_tokens": 150, "temperature": 1.0, "seed": 1, "stream": True}
        hang_ups.append((5, _hang_up_after_first_event(real_engine, port, "/v1/completions", body)))
        assert asyncio.run(real_engine.wait_idle(10.0)), real_engine.stats()
        stats = real_engine.stats()
        assert stats["cancelled"] == before + 4 and stats["running"] == 0
        assert stats["free_rows"] == stats["max_slots"]
        time.sleep(2 * GAUGE_PERIOD_S)
        assert gauges == {"set_running": 0, "set_waiting": 0, "set_kv_slots_in_use": 0}
        assert len(ttfts) == 6  # the histogram's count: every request that got a token, once
        for i, ttft_s in finished:
            assert ttfts[i] == pytest.approx(ttft_s, abs=1e-6)
        for i, first_s in hang_ups:
            assert 0 < ttfts[i] <= first_s
        finished_s = sum(t for _, t in finished)  # the histogram's sum: the hang-ups' add to it
        assert finished_s < sum(ttfts) <= finished_s + sum(t for _, t in hang_ups) + 1e-6
        hit = 16 * ((n - 1) // 16)
        assert cache == [(n, 0), (n, hit), (n, hit), (n, hit), (n, hit), (40, 0)]
    finally:
        server.should_exit = True
        thread.join(10)


async def _leave_during_send(app, path: str, body: dict, leave_after: int, engine: ChatServer) -> bool:
    """Drive `app` as an ASGI server does for a client that stops reading: the disconnect arrives while the
    server is still sending frame `leave_after` (its send waits on the client), so the cancellation lands in
    send, not in the frames generator. Returns whether `engine` is idle within 1 s of the app returning (on
    the same event loop: asyncio.run's end would close a suspended generator itself)."""
    data, left, frames = json.dumps(body).encode(), asyncio.Event(), []
    requests_left = [{"type": "http.request", "body": data, "more_body": False}]

    async def receive():
        if requests_left:
            return requests_left.pop()
        await left.wait()
        return {"type": "http.disconnect"}

    async def send(message):
        if message["type"] == "http.response.body" and message.get("body"):
            frames.append(message["body"])
            if len(frames) == leave_after:
                left.set()
                await asyncio.sleep(5)  # the write the client never finishes reading

    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST", "path": path,
             "raw_path": path.encode(), "root_path": "", "scheme": "http", "query_string": b"",
             "headers": [(b"content-type", b"application/json")], "client": ("c", 1), "server": ("s", 80)}  # fmt: skip
    await asyncio.wait_for(app(scope, receive, send), 10)
    assert len(frames) == leave_after
    return await engine.wait_idle(1.0)


@pytest.mark.parametrize(
    "path,leave_after", [(V1, 1), (V1, 3), ("/chat/completions", 2), ("/v1/completions", 2)]
)
def test_client_leaving_during_a_send_cancels_its_request(tiny, path, leave_after):
    """Starlette never closes a response's body iterator: a client that left while a frame was being sent
    (the first, the role chunk, before the engine events are read, or a later one) left the frames generator
    suspended and the engine request decoding to max_tokens (250 tokens at ~10 ms each: 2.5 s more on its
    row, counted completed). Now the request is cancelled at once: the engine is idle within 1 s, cancelled
    +1, completed +0."""
    model, tokenizer = tiny
    hook = model.register_forward_hook(lambda *_: time.sleep(0.01))
    engine = ChatServer(model, tokenizer, max_slots=1, model_id="tiny")
    try:
        app = create_app(LocalClient(engine))
        sampling = {"max_tokens": 250, "temperature": 0, "stream": True}
        body = (
            {"prompt": [1, 2, 3], **sampling} if path == "/v1/completions" else {"messages": USER, **sampling}
        )
        assert asyncio.run(_leave_during_send(app, path, body, leave_after, engine)), engine.stats()
        stats = engine.stats()
        assert (stats["cancelled"], stats["completed"], stats["in_flight"]) == (1, 0, 0)
    finally:
        hook.remove()
        engine.shutdown()


# ---- the calculator model: structured tool calls and the multi-turn round trip ----------------------------
@pytest.fixture(scope="module")
def calc(tool_checkpoint):
    model, tokenizer, _ = load_model(tool_checkpoint)
    engine = ChatServer(model, tokenizer, max_slots=4, model_id="calc")
    client = RecordingClient(engine)
    yield TestClient(create_app(client)), client, ModelRunner(model, tokenizer), tokenizer
    engine.shutdown()


def greedy(runner, tokenizer, messages):
    """What the model generates for `messages` (template messages), alone: prompt + completion ids."""
    return runner.generate_batch([render_for_completion(tokenizer, messages)], max_tokens=60, temperature=0)[
        0
    ]


def turn_ids(tokenizer, text: str) -> list[int]:
    sid = tokenizer.special_id
    return [sid("<|user_start|>"), *tokenizer.encode(text), sid("<|user_end|>"), sid("<|assistant_start|>")]


def check_round_trip(calc, history_after_turn1: list[dict]):
    """Turn 2 was prompted with turn 1 sent back as history: its rendered prompt must be exactly the ids
    the engine generated in turn 1 (prompt, sampled tokens, the forced calculator output, <|assistant_end|>)
    followed by the new user message."""
    client, recorder, runner, tokenizer = calc
    first = greedy(runner, tokenizer, [{"role": "user", "content": Q1}])
    prompt2 = render_for_completion(tokenizer, recorder.requests[-1]["messages"])
    assert prompt2 == first.tokens + turn_ids(tokenizer, Q2)
    assert history_after_turn1[-1] == {"role": "user", "content": Q2}


def test_openai_round_trip_without_streaming(calc):
    client, recorder, runner, tokenizer = calc
    history = [{"role": "user", "content": Q1}]
    reply = client.post(V1, json={"messages": history, "temperature": 0}).json()
    message = reply["choices"][0]["message"]
    assert message["content"] == "Let me compute it. #### 564"
    [call] = message["tool_calls"]
    assert call["function"] == {"name": "calculator", "arguments": '{"expression": "47 * 12"}'}
    assert call["raychat"] == {"offset": len("Let me compute it. "), "output": "564"}
    assert reply["choices"][0]["finish_reason"] == "stop"
    history += [message, {"role": "user", "content": Q2}]
    reply2 = client.post(V1, json={"messages": history, "temperature": 0}).json()
    check_round_trip(calc, history)
    message2 = reply2["choices"][0]["message"]
    assert (
        message2["content"] == "Let me compute it. #### 11"
        and message2["tool_calls"][0]["raychat"]["output"] == "11"
    )
    assert "<|" not in json.dumps(reply) + json.dumps(reply2)


def test_openai_round_trip_streaming(calc):
    client, _, _, _ = calc
    history = [{"role": "user", "content": Q1}]
    raw = client.post(V1, json={"messages": history, "temperature": 0, "stream": True}).text
    assert "<|" not in raw
    state = ChatCompletionStreamState()
    chunks = [json.loads(e) for e in parse_sse(raw)[:-1]]
    for c in chunks:
        state.handle_chunk(ChatCompletionChunk.model_validate(c))
    accumulated = state.get_final_completion().choices[0].message
    assert accumulated.content == "Let me compute it. #### 564"
    # the raychat record arrives in the chunks; a client keeps it on the call (as chat.html does)
    records = [
        d.get("raychat")
        for c in chunks
        for d in c["choices"][0]["delta"].get("tool_calls", [])
        if c["choices"]
    ]
    call = {**accumulated.tool_calls[0].model_dump(include={"id", "type", "function"}),
            "raychat": {**records[0], **records[1]}}  # fmt: skip
    assert call["raychat"] == {"offset": 19, "output": "564"}
    history += [
        {"role": "assistant", "content": accumulated.content, "tool_calls": [call]},
        {"role": "user", "content": Q2},
    ]
    resp = client.post(V1, json={"messages": history, "temperature": 0})
    assert resp.status_code == 200, resp.text
    check_round_trip(calc, history)


def test_client_run_calls_follow_openai_function_calling(calc):
    """With the calculator declared in `tools`, the reply stops at the call (finish_reason tool_calls); the
    client's tool message continues the same assistant turn, and the whole history renders to the ids the
    model generates when the engine runs the calculator itself."""
    client, recorder, runner, tokenizer = calc
    tools = [{"type": "function", "function": {"name": "calculator"}}]
    history = [{"role": "user", "content": Q1}]
    step = client.post(V1, json={"messages": history, "temperature": 0, "tools": tools}).json()
    assert step["choices"][0]["finish_reason"] == "tool_calls"
    message = step["choices"][0]["message"]
    assert message["content"] == "Let me compute it. " and "raychat" not in message["tool_calls"][0]
    history += [message, {"role": "tool", "tool_call_id": message["tool_calls"][0]["id"], "content": "564"}]
    step2 = client.post(V1, json={"messages": history, "temperature": 0, "tools": tools}).json()
    assert step2["choices"][0] == {"index": 0, "message": {"role": "assistant", "content": "#### 564"},
                                   "logprobs": None, "finish_reason": "stop"}  # fmt: skip
    history += [step2["choices"][0]["message"], {"role": "user", "content": Q2}]
    assert client.post(V1, json={"messages": history, "temperature": 0}).status_code == 200
    check_round_trip(calc, history)


def test_raychat_endpoint_round_trip(calc):
    """The web page's protocol: SSE events -> the OpenAI-style history the page keeps (chat.html)."""
    client, _, _, _ = calc
    history = [{"role": "user", "content": Q1}]
    events = [
        json.loads(e)
        for e in parse_sse(
            client.post("/chat/completions", json={"messages": history, "temperature": 0}).text
        )
    ]
    kinds = [e["type"] for e in events]
    assert kinds.index("tool_call") < kinds.index("tool_result") < len(kinds) - 1 and kinds[-1] == "done"
    text, calls = "", []
    for e in events:
        if e["type"] == "delta":
            text += e["text"]
        elif e["type"] == "tool_call":
            assert (e["name"], e["expression"]) == ("calculator", "47 * 12")
            calls.append({"id": e["id"], "type": "function", "raychat": {"offset": len(text)},
                          "function": {"name": "calculator", "arguments": json.dumps({"expression": e["expression"]})}})  # fmt: skip
        elif e["type"] == "tool_result":
            calls[-1]["raychat"]["output"] = e["output"]
    history += [{"role": "assistant", "content": text, "tool_calls": calls}, {"role": "user", "content": Q2}]
    assert client.post("/chat/completions", json={"messages": history, "temperature": 0}).status_code == 200
    check_round_trip(calc, history)


def test_logprobs_equal_the_model_distribution(calc):
    client, _, runner, tokenizer = calc
    history = [{"role": "user", "content": "Tell me a story."}]
    reply = client.post(V1, json={"messages": history, "temperature": 0, "max_tokens": 6, "logprobs": True,
                                  "top_logprobs": 3}).json()  # fmt: skip
    content = reply["choices"][0]["logprobs"]["content"]
    ids = render_for_completion(tokenizer, history)
    with torch.no_grad():
        for entry in content:
            lp = torch.log_softmax(runner.model(torch.tensor([ids]))[0, -1].float(), -1)
            best = int(lp.argmax())
            assert entry["bytes"] == list(b"".join(tokenizer.iter_tokens([best])))
            assert entry["logprob"] == pytest.approx(float(lp[best]), abs=1e-4)
            top = torch.topk(lp, 3)
            assert [t["logprob"] for t in entry["top_logprobs"]] == pytest.approx(
                top.values.tolist(), abs=1e-4
            )
            ids.append(best)


def test_logprobs_end_where_a_stop_string_ends_the_content(real_engine):
    """logprobs cover the content a stop string leaves and nothing past it, streamed or not: a token cut by
    the stop string keeps its entry (its first character is content); the stop string's other tokens and the
    tokens held back as its possible start are not sent (they were, after the content's last token)."""
    client = TestClient(create_app(LocalClient(real_engine)))
    body = {"messages": [{"role": "user", "content": "Tell me about json."}], "temperature": 0,
            "max_tokens": 24, "logprobs": True}  # fmt: skip
    full = client.post(V1, json=body).json()["choices"][0]
    assert full["message"]["content"].startswith("place$\ufffd iAcul}")
    tokens = [e["token"] for e in full["logprobs"]["content"]]
    assert tokens[:7] == ["place", "$", "\ufffd", " i", "A", "cul", "}"]
    stopped = client.post(V1, json={**body, "stop": "ul}"}).json()["choices"][0]
    assert stopped["message"]["content"] == "place$\ufffd iAc" and stopped["finish_reason"] == "stop"
    assert stopped["logprobs"]["content"] == full["logprobs"]["content"][:6]  # "cul" is cut: kept
    resp = client.post(V1, json={**body, "stop": "ul}", "stream": True})
    streamed = [e for c in parse_sse(resp.text) if c != "[DONE]" for ch in json.loads(c)["choices"]
                if ch["logprobs"] for e in ch["logprobs"]["content"]]  # fmt: skip
    assert streamed == full["logprobs"]["content"][:6]
    at_start = client.post(V1, json={**body, "stop": "place"}).json()["choices"][0]
    assert at_start["message"]["content"] == "" and at_start["logprobs"]["content"] == []


def test_logprobs_of_a_calculator_turn_cover_its_content(calc):
    """Around a call the server ran (whose tokens have no entry), the text tokens' entries spell the content,
    streamed or not, and end where a stop string after the call ends it."""
    client = calc[0]
    body = {"messages": [{"role": "user", "content": Q1}], "temperature": 0, "logprobs": True}
    for extra, content in (({}, "Let me compute it. #### 564"), ({"stop": "56"}, "Let me compute it. #### ")):
        reply = client.post(V1, json={**body, **extra}).json()["choices"][0]
        assert reply["message"]["content"] == content
        assert "".join(e["token"] for e in reply["logprobs"]["content"]) == content
        resp = client.post(V1, json={**body, **extra, "stream": True})
        streamed = [e for c in parse_sse(resp.text) if c != "[DONE]" for ch in json.loads(c)["choices"]
                    if ch["logprobs"] for e in ch["logprobs"]["content"]]  # fmt: skip
        assert streamed == reply["logprobs"]["content"]


def test_an_engine_process_that_died_under_a_submit_is_a_503():
    """EngineProcess.submit raises RuntimeError while a new child loads, and the pipe's BrokenPipeError when
    the child died a moment before: both are "retry later" (503 + Retry-After), never a 500."""

    class DeadEngineProcess:
        running, restarting, max_len, max_slots, num_active, num_pending, num_free_slots = (
            False,
            True,
            64,
            1,
            0,
            0,
            1,
        )

        def __init__(self, error):
            self.error = error

        def start(self):
            pass

        def submit(self, *args, **kwargs):
            raise self.error

    tok = byte_tokenizer()
    for error in (
        BrokenPipeError(32, "Broken pipe"),
        RuntimeError("engine process is not running (restarting)"),
    ):
        engine = ChatServer(None, tok, scheduler=DeadEngineProcess(error))
        resp = TestClient(create_app(LocalClient(engine))).post(V1, json={"messages": USER})
        assert resp.status_code == 503 and resp.headers["retry-after"] == "5", resp.text
        assert resp.json()["error"]["message"].startswith("engine unavailable: ")
        assert engine.stats()["rejected"] == 1 and engine.stats()["in_flight"] == 0


def test_a_conversation_beyond_the_context_is_openais_context_length_exceeded(tiny):
    """Code context_length_exceeded (OpenAI's), so clients know to drop earlier messages (the chat page does:
    test_serve_browser.py); before, the 400 carried code None and the engine's "prompt has N tokens". The
    message is in the voice of max_tokens' refusal (the field, the context length, the prompt's tokens, what
    fits); it said "rows hold max_len 32 tokens, the reply included"."""
    model, tok = tiny
    engine = ChatServer(model, tok, max_slots=1, max_len=32, model_id="tiny")
    try:
        client = TestClient(create_app(LocalClient(engine)))
        fits = [{"role": "user", "content": "hi"}]
        long = [{"role": "user", "content": "tell me about the json module " * 3}]
        n = len(render_for_completion(tok, long))
        assert len(render_for_completion(tok, fits)) < 32 <= n
        for path in (V1, "/chat/completions"):
            resp = client.post(path, json={"messages": long, "max_tokens": 2})
            assert resp.status_code == 400, resp.text
            assert resp.json()["error"] == {
                "message": f"messages: the conversation has {n} tokens, but the model's context length is 32 "
                f"tokens and at least 1 completion token must follow ({n} + 1 > 32): at most 31 fit; drop "
                "earlier messages",
                "type": "invalid_request_error", "param": "messages", "code": "context_length_exceeded",
            }  # fmt: skip
        ok = client.post(V1, json={"messages": fits, "max_tokens": 2, "temperature": 0})
        assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 2
    finally:
        engine.shutdown()


def spy_submits(engine: ChatServer) -> list[list[int]]:
    """The prompts `engine`'s scheduler is asked to submit from now on, in order (a spy over its submit)."""
    submitted = []
    submit = engine.scheduler.submit
    engine.scheduler.submit = lambda prompt, *a, **kw: (
        submitted.append(list(prompt)) or submit(prompt, *a, **kw)
    )
    return submitted


def test_max_tokens_beyond_the_context_is_refused_before_the_engine_sees_it(tiny):
    """prompt + max_tokens over the context was accepted and cut short ("length") at the row's end; now it is
    OpenAI's and vLLM's 400 naming the field as sent and the numbers, on every chat route, streaming or not,
    and the request never reaches the engine, so a request decoding beside it runs on untouched. "hi" renders
    to 5 tokens (<|bos|> <|user_start|> hi <|user_end|> <|assistant_start|>): 27 of the 32 are left."""
    model, tok = tiny
    engine = ChatServer(model, tok, max_slots=2, max_len=32, model_id="tiny")
    submitted = spy_submits(engine)
    hi = [{"role": "user", "content": "hi"}]
    assert len(render_for_completion(tok, hi)) == 5
    try:
        client = TestClient(create_app(LocalClient(engine)))
        for path, body, param, n in [
            (V1, {"max_tokens": 28}, "max_tokens", 28),
            (V1, {"max_completion_tokens": 40, "stream": True}, "max_completion_tokens", 40),
            (V1, {"max_tokens": 30, "max_completion_tokens": 30}, "max_completion_tokens", 30),
            ("/chat/completions", {"max_tokens": 4096}, "max_tokens", 4096),
        ]:
            resp = client.post(path, json={"messages": hi, **body})
            assert resp.status_code == 400, resp.text
            assert resp.json()["error"] == {
                "message": f"{param}: {n} completion tokens requested, but the model's context length is 32 "
                f"tokens and the conversation has 5 (5 + {n} > 32): at most 27 fit",
                "type": "invalid_request_error", "param": param, "code": "context_length_exceeded",
            }  # fmt: skip
        assert submitted == [] and engine.stats()["rejected"] == 4
        for body in ({"max_tokens": 27}, {}):  # exactly the rest of the row; not given: the rest of the row
            ok = client.post(V1, json={"messages": hi, "temperature": 0, **body})
            assert ok.status_code == 200, ok.text
            usage, choice = ok.json()["usage"], ok.json()["choices"][0]
            assert (usage["prompt_tokens"], usage["completion_tokens"], choice["finish_reason"]) == (
                5,
                27,
                "length",
            )

        async def beside():
            reference = ModelRunner(model, tok).generate_batch(
                [render_for_completion(tok, hi)], max_tokens=20, temperature=0
            )[0]
            good = engine.generate({"messages": hi, "max_tokens": 20, "temperature": 0})
            events = [await anext(good)]  # decoding in the engine now
            bad = [e async for e in engine.generate({"messages": hi, "max_tokens": 28, "temperature": 0})]
            events += [e async for e in good]
            return reference, bad, events

        submitted.clear()
        reference, bad, events = asyncio.run(beside())
        assert [(e["type"], e["status"], e["param"], e["code"]) for e in bad] == [
            ("error", 400, "max_tokens", "context_length_exceeded")
        ]
        assert submitted == [render_for_completion(tok, hi)]  # the good one only
        assert "".join(e["text"] for e in events if e["type"] == "delta") == reference.text
        assert events[-1]["usage"]["completion_tokens"] == len(reference.completion_tokens) == 20
    finally:
        engine.shutdown()


def test_n_choices_are_checked_together_before_any_reaches_the_engine(tiny):
    """The n choices of a request the engine refuses (a conversation over the context, a max_tokens beyond
    it) fail it whole, as one refusal (ChatServer.check, asked once for all of them: `rejected` counts 1 per
    request, not n), and none is submitted, streaming or not; n=3 that fits submits its 3 choices."""
    model, tok = tiny
    engine = ChatServer(model, tok, max_slots=4, max_len=32, model_id="tiny")
    submitted = spy_submits(engine)
    hi, long = USER, [{"role": "user", "content": "tell me about the json module " * 3}]
    n = len(render_for_completion(tok, long))
    over = (
        f"messages: the conversation has {n} tokens, but the model's context length is 32 tokens and at least 1 "
        f"completion token must follow ({n} + 1 > 32): at most 31 fit; drop earlier messages"
    )
    budget = (
        "max_tokens: 28 completion tokens requested, but the model's context length is 32 tokens and the "
        "conversation has 5 (5 + 28 > 32): at most 27 fit"
    )
    try:
        client = TestClient(create_app(LocalClient(engine)))
        for body, message, param in [
            ({"messages": long, "n": 3}, over, "messages"),
            ({"messages": long, "n": 2, "stream": True}, over, "messages"),
            ({"messages": hi, "n": 3, "max_tokens": 28}, budget, "max_tokens"),
        ]:
            resp = client.post(V1, json=body)
            assert resp.status_code == 400, resp.text
            assert resp.json()["error"] == {
                "message": message, "type": "invalid_request_error", "param": param,
                "code": "context_length_exceeded",
            }  # fmt: skip
        assert submitted == [] and engine.stats()["rejected"] == 3
        ok = client.post(V1, json={"messages": hi, "n": 3, "max_tokens": 2, "seed": 1})
        assert ok.status_code == 200 and len(ok.json()["choices"]) == 3, ok.text
        assert submitted == [render_for_completion(tok, hi)] * 3 and engine.stats()["rejected"] == 3
    finally:
        engine.shutdown()
