"""Fast tier for the chat endpoints: validation at every bound, auth, body limit, SSE framing, OpenAI
format, and the real engine in-process (greedy equality, disconnect frees the row). No Ray."""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time

import pytest
from fastapi.testclient import TestClient
from serve_helpers import tiny_model_and_tokenizer

from raychat.chat_template import TEMPLATE_VERSION, render_for_completion
from raychat.engine import ModelRunner
from raychat.serve.api import MAX_BODY_BYTES, field_path
from raychat.serve.ingress import LocalClient, create_app
from raychat.serve.server import ChatServer, merge_deltas
from raychat.serve.sse import parse_sse, sse_event

USER = [{"role": "user", "content": "hi"}]


class FakeEngine:
    """Scripted engine client: yields `script` events and records requests and closes."""

    def __init__(self, script=None):
        self.script = script or [
            {"type": "delta", "text": "Hel", "tokens": 1},
            {"type": "delta", "text": "", "tokens": 1},
            {"type": "delta", "text": "lo\nworld", "tokens": 2},
            {"type": "done", "finish_reason": "stop", "usage": {"prompt_tokens": 5, "completion_tokens": 4, "total_tokens": 9, "ttft_s": 0.01}},
        ]  # fmt: skip
        self.requests, self.closed = [], 0

    async def info(self):
        return {
            "model_id": "tiny",
            "template_version": TEMPLATE_VERSION,
            "tokenizer_version": "abc",
            "max_seq_len": 256,
        }

    async def stats(self):
        return {"in_flight": 0}

    async def generate(self, request):
        self.requests.append(request)
        try:
            for ev in self.script:
                yield ev
        finally:
            self.closed += 1


@pytest.fixture
def fake():
    return FakeEngine()


@pytest.fixture
def client(fake):
    return TestClient(create_app(fake))


def post(client, body, path="/chat/completions", **kw):
    return client.post(path, json=body, **kw)


def assert_400(resp, field, fragment):
    assert resp.status_code == 400, resp.text
    err = resp.json()["error"]
    assert err["param"] == field
    assert err["message"].startswith(f"{field}: "), err["message"]
    assert fragment in err["message"], err["message"]


# ---- bounds: (body overrides, field, message fragment or None when valid) -----------------------------
def msgs(n, content="a"):
    return [{"role": "user" if i % 2 == 0 else "assistant", "content": content} for i in range(n)]


BOUNDS = [
    ({"messages": msgs(1)}, None, None),
    ({"messages": msgs(500)}, None, None),
    ({"messages": msgs(501)}, "messages", "at most 500 items"),
    ({"messages": []}, "messages", "at least 1 item"),
    ({"messages": [{"role": "user", "content": "x" * 8000}]}, None, None),
    (
        {"messages": [{"role": "user", "content": "x" * 8001}]},
        "messages[0].content",
        "at most 8000 characters",
    ),
    ({"messages": [{"role": "user", "content": ""}]}, "messages[0].content", "at least 1 character"),
    ({"messages": msgs(4, "x" * 8000)}, None, None),  # 32000 in all
    (
        {"messages": [*msgs(4, "x" * 8000), {"role": "user", "content": "y"}]},
        "messages",
        "32001 characters; at most 32000",
    ),
    ({"messages": [{"role": "system", "content": "s"}, *USER]}, None, None),
    ({"messages": [{"role": "bot", "content": "x"}]}, "messages[0].role", "'system', 'user' or 'assistant'"),
    (
        {"messages": [*USER, {"role": "tool", "content": "1"}]},
        "messages[1].role",
        "'system', 'user' or 'assistant'",
    ),
    ({"temperature": 0}, None, None),
    ({"temperature": 2.0}, None, None),
    ({"temperature": -0.01}, "temperature", "greater than or equal to 0"),
    ({"temperature": 2.01}, "temperature", "less than or equal to 2"),
    ({"top_k": 0}, None, None),
    ({"top_k": 200}, None, None),
    ({"top_k": -1}, "top_k", "greater than or equal to 0"),
    ({"top_k": 201}, "top_k", "less than or equal to 200"),
    ({"top_p": 1.0}, None, None),
    ({"top_p": 1e-6}, None, None),
    ({"top_p": 0}, "top_p", "greater than 0"),
    ({"top_p": 1.01}, "top_p", "less than or equal to 1"),
    ({"max_tokens": 1}, None, None),
    ({"max_tokens": 4096}, None, None),
    ({"max_tokens": 0}, "max_tokens", "greater than or equal to 1"),
    ({"max_tokens": 4097}, "max_tokens", "less than or equal to 4096"),
    ({"stop": ["a", "b", "c", "d"]}, None, None),
    ({"stop": ["a", "b", "c", "d", "e"]}, "stop", "1 to 4 strings, got 5"),
    ({"stop": "x" * 65}, "stop", "1 to 64 characters, got 65"),
    ({"seed": -1}, "seed", "greater than or equal to 0"),
]


@pytest.mark.parametrize("override,field,fragment", BOUNDS, ids=[f"{i}-{b[1]}" for i, b in enumerate(BOUNDS)])
def test_bounds(client, fake, override, field, fragment):
    resp = post(client, {"messages": USER, **override})
    if field is None:
        assert resp.status_code == 200, resp.text
        assert len(fake.requests) == 1
    else:
        assert_400(resp, field, fragment)
        assert fake.requests == []  # rejected before the engine saw it


WRONG_TYPES = [
    ({"temperature": "0.5"}, "temperature", "valid number"),
    ({"temperature": None}, "temperature", "valid number"),
    ({"top_k": 1.5}, "top_k", "valid integer"),
    ({"top_k": True}, "top_k", "valid integer"),
    ({"max_tokens": "10"}, "max_tokens", "valid integer"),
    ({"seed": 1.0}, "seed", "valid integer"),
    ({"stream": "yes"}, "stream", "valid boolean"),
    ({"stop": 3}, "stop", "string or a list of strings"),
    ({"messages": "hi"}, "messages", "valid list"),
    ({"messages": ["hi"]}, "messages[0]", "valid dictionary"),
    ({"messages": [{"role": "user", "content": 5}]}, "messages[0].content", "valid string"),
    ({"messages": [{"role": "user"}]}, "messages[0].content", "field required"),
    ({"messages": [{"content": "x"}]}, "messages[0].role", "field required"),
]


@pytest.mark.parametrize(
    "override,field,fragment", WRONG_TYPES, ids=[w[1] + "-" + str(i) for i, w in enumerate(WRONG_TYPES)]
)
def test_wrong_types_and_missing_fields(client, override, field, fragment):
    assert_400(post(client, {"messages": USER, **override}), field, fragment)


def test_missing_messages_and_bad_json(client, fake):
    assert_400(post(client, {"temperature": 1}), "messages", "field required")
    resp = client.post(
        "/chat/completions", content=b'{"messages": [', headers={"content-type": "application/json"}
    )
    assert_400(resp, "body", "JSON")
    assert_400(post(client, {"messages": USER, "top_k": 999}, path="/v1/chat/completions"), "top_k", "200")
    assert_400(post(client, {"messages": USER, "n": 3}), "n", "only 1 choice per request is supported, got 3")
    not_utf8 = client.post(
        "/chat/completions", content=b'{"messages": "\xff"}', headers={"content-type": "application/json"}
    )
    assert not_utf8.status_code == 400
    assert not_utf8.json()["error"] == {
        "message": "There was an error parsing the body", "type": "invalid_request_error", "param": "body", "code": None
    }  # fmt: skip
    missing = client.get("/no-such-page")
    assert missing.status_code == 404 and missing.json()["error"]["message"] == "Not Found"
    assert fake.requests == []


def test_oversized_body_is_413_before_parsing(client, fake):
    big = b"{" + b" " * MAX_BODY_BYTES + b"}"  # not even valid as a request: parsing never happens
    resp = client.post("/chat/completions", content=big, headers={"content-type": "application/json"})
    assert resp.status_code == 413
    assert resp.json()["error"]["message"] == f"request body exceeds {MAX_BODY_BYTES} bytes"

    def chunked():  # no Content-Length: the middleware counts the bytes
        for _ in range(9):
            yield b" " * (64 * 1024)

    resp = client.post(
        "/v1/chat/completions", content=chunked(), headers={"content-type": "application/json"}
    )
    assert resp.status_code == 413
    # the largest valid request (32000 characters, each a JSON-escaped surrogate pair) fits
    body = json.dumps({"messages": [{"role": "user", "content": "🙂" * 8000}] * 4}).encode()
    assert 384_000 < len(body) <= MAX_BODY_BYTES
    resp = client.post("/chat/completions", content=body, headers={"content-type": "application/json"})
    assert resp.status_code == 200
    assert len(fake.requests) == 1


def test_bearer_auth():
    fake = FakeEngine()
    client = TestClient(create_app(fake, api_key="s3cret"))
    assert client.post("/chat/completions", json={"messages": USER}).status_code == 401
    r = client.post("/chat/completions", json={"messages": USER}, headers={"Authorization": "Bearer nope"})
    assert r.status_code == 401 and r.headers["www-authenticate"] == "Bearer"
    assert client.get("/v1/models").status_code == 401
    assert (
        client.post(
            "/chat/completions", json={"messages": USER}, headers={"Authorization": "Bearer s3cret"}
        ).status_code
        == 200
    )
    assert client.get("/health").status_code == 200  # probes and the page stay open
    assert client.get("/").status_code == 200
    assert len(fake.requests) == 1


def test_sse_framing_and_final_event(client, fake):
    resp = post(client, {"messages": USER, "temperature": 0, "top_k": 0, "stop": "END"})
    assert resp.headers["content-type"].startswith("text/event-stream")
    raw = resp.text
    # one JSON line per event (a newline in the text is JSON-escaped); the empty delta is not sent
    assert raw.startswith('data: {"type":"delta","text":"Hel"}\n\n')
    assert '\ndata: {"type":"delta","text":"lo\\nworld"}\n\n' in raw
    events = [json.loads(e) for e in parse_sse(raw)]
    assert [e["type"] for e in events] == ["delta", "delta", "done"]
    assert "".join(e["text"] for e in events[:-1]) == "Hello\nworld"
    assert events[-1] == {"type": "done", "finish_reason": "stop", "usage": {"prompt_tokens": 5, "completion_tokens": 4, "total_tokens": 9, "ttft_s": 0.01}}  # fmt: skip
    assert fake.requests[0] == {"messages": USER, "temperature": 0.0, "top_k": None, "top_p": None, "max_tokens": 256, "seed": None, "stop": ["END"]}  # fmt: skip
    assert fake.closed == 1


def test_sse_event_roundtrip():
    for data in ['{"a":1}', "x\ny\n", "", "[DONE]"]:
        assert parse_sse(sse_event(data).decode()) == ([data] if data else [""])
    assert field_path(("body", "messages", 3, "content")) == "messages[3].content"


def test_sse_json_survives_splitlines_readers():
    """U+0085, U+2028, U+2029 end lines for str.splitlines (httpx's aiter_lines): they must arrive escaped."""
    text = "a\x85b\u2028c\u2029d\ne\u00e9"
    frame = sse_event({"type": "delta", "text": text}).decode()
    assert frame == 'data: {"type":"delta","text":"a\\u0085b\\u2028c\\u2029d\\ne\u00e9"}\n\n'
    lines = [line for line in frame.splitlines() if line]
    assert len(lines) == 1 and json.loads(lines[0][6:])["text"] == text


def test_openai_non_stream_and_stream(client):
    resp = post(client, {"model": "tiny", "messages": USER, "max_tokens": 4}, path="/v1/chat/completions")
    body = resp.json()
    assert body["object"] == "chat.completion" and body["model"] == "tiny"
    assert body["choices"][0]["message"] == {"role": "assistant", "content": "Hello\nworld"}
    assert body["choices"][0]["finish_reason"] == "stop"
    assert body["usage"] == {"prompt_tokens": 5, "completion_tokens": 4, "total_tokens": 9}

    req = {"messages": USER, "stream": True, "stream_options": {"include_usage": True}}
    events = parse_sse(post(client, req, path="/v1/chat/completions").text)
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert {c["object"] for c in chunks} == {"chat.completion.chunk"} and len({c["id"] for c in chunks}) == 1
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert (
        "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"]) == "Hello\nworld"
    )
    assert chunks[-2]["choices"][0]["finish_reason"] == "stop"
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["total_tokens"] == 9


def test_unknown_model_is_404(client, fake):
    resp = post(client, {"model": "gpt-4", "messages": USER}, path="/v1/chat/completions")
    assert resp.status_code == 404
    assert resp.json()["error"]["param"] == "model" and "'tiny'" in resp.json()["error"]["message"]
    assert fake.requests == []


def test_engine_rejection_is_400_not_a_stream():
    fake = FakeEngine(
        [
            {
                "type": "error",
                "status": 400,
                "message": "prompt has 300 tokens; rows hold max_len 256",
                "param": "messages",
            }
        ]
    )
    client = TestClient(create_app(fake))
    for path in ("/chat/completions", "/v1/chat/completions"):
        assert_400(post(client, {"messages": USER}, path=path), "messages", "prompt has 300 tokens")
    assert fake.closed == 2


def test_models_health_page(client):
    card = client.get("/v1/models").json()["data"][0]
    assert card["id"] == "tiny" and card["template_version"] == TEMPLATE_VERSION
    health = client.get("/health").json()
    assert health["status"] == "ok" and health["template_version"] == TEMPLATE_VERSION
    page = client.get("/").text
    for element in (
        'id="send"',
        'id="stop"',
        'id="regenerate"',
        'id="temperature"',
        'id="top_k"',
        "/chat/completions",
    ):
        assert element in page


# ---- the real engine, in-process -------------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny():
    return tiny_model_and_tokenizer()


@pytest.fixture(scope="module")
def real_engine(tiny):
    engine = ChatServer(*tiny, max_slots=4, model_id="tiny")
    yield engine
    engine.shutdown()


def test_real_engine_greedy_matches_generate_batch(tiny, real_engine):
    model, tokenizer = tiny
    client = TestClient(create_app(LocalClient(real_engine)))
    conv = [{"role": "user", "content": "Tell me about json."}]
    expected = ModelRunner(model, tokenizer).generate_batch(
        [render_for_completion(tokenizer, conv)], max_tokens=24, temperature=0
    )[0]
    events = [
        json.loads(e)
        for e in parse_sse(post(client, {"messages": conv, "max_tokens": 24, "temperature": 0}).text)
    ]
    assert "".join(e["text"] for e in events[:-1]) == expected.text
    assert events[-1]["finish_reason"] == expected.finish_reason
    assert events[-1]["usage"]["completion_tokens"] == len(expected.completion_tokens)
    assert events[-1]["usage"]["prompt_tokens"] == expected.num_prompt_tokens
    # a bad conversation (ends with an assistant message) is the template's 400, naming messages
    bad = [*conv, {"role": "assistant", "content": "ok"}]
    assert_400(post(client, {"messages": bad}), "messages", "ending with a 'user' message")
    too_long = [{"role": "user", "content": "json " * 400}]
    assert_400(post(client, {"messages": too_long}), "messages", "leaves no room to generate")
    assert real_engine.stats()["in_flight"] == 0 and real_engine.stats()["rejected"] == 2


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
    assert [e["tokens"] for e in every[:-1]] == [1] * 14
    text = "".join(e["text"] for e in every[:-1])
    assert "".join(e["text"] for e in grouped[:-1]) == text
    assert [e["tokens"] for e in grouped[:-1]] == [1, 4, 4, 4, 1]  # 14 tokens: 1 + 4 + 4 + 4 + the last
    with pytest.raises(ValueError, match="stream_interval must be an int >= 1, got 0"):
        ChatServer(*tiny, stream_interval=0)


def test_merge_deltas():
    d = lambda text, n: {"type": "delta", "text": text, "tokens": n}  # noqa: E731
    done = {"type": "done", "finish_reason": "stop", "usage": {}}
    assert merge_deltas([d("a", 1), d("", 1), d("bc", 2), done]) == [d("abc", 4), done]
    assert merge_deltas([d("a", 1)]) == [d("a", 1)]
    assert merge_deltas([done]) == [done]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_disconnect_mid_stream_frees_the_row(real_engine):
    """A real HTTP server (uvicorn on loopback): the client reads two events and hangs up."""
    import uvicorn

    port = _free_port()
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
        body = json.dumps(
            {"messages": USER, "max_tokens": 4000 // 16, "temperature": 1.0, "seed": 1}
        ).encode()
        with socket.create_connection(("127.0.0.1", port)) as sock:
            sock.sendall(b"POST /chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                         + f"Content-Length: {len(body)}\r\n\r\n".encode() + body)  # fmt: skip
            got = b""
            while got.count(b"data: ") < 2:
                got += sock.recv(4096)
            assert real_engine.stats()["in_flight"] == 1
        assert asyncio.run(real_engine.wait_idle(10.0)), real_engine.stats()
        stats = real_engine.stats()
        assert (
            stats["cancelled"] == before + 1
            and stats["running"] == 0
            and stats["free_rows"] == stats["max_slots"]
        )
    finally:
        server.should_exit = True
        thread.join(10)
