"""Fast tier for the chat endpoints over a scripted engine: every request field at and past its bounds,
OpenAI's parameter list classified, auth, body limit, SSE framing, and every 5xx path in the error shape."""

from __future__ import annotations

import json
import re
import typing
from pathlib import Path

import pytest
from fastapi.testclient import TestClient
from openai.types.chat import completion_create_params
from support.serve_helpers import FakeEngine

from raychat.chat_template import TEMPLATE_VERSION
from raychat.serve import api
from raychat.serve.api import MAX_BODY_BYTES
from raychat.serve.errors import INTERNAL_ERROR, EngineUnavailableError, ErrorResponse, field_path
from raychat.serve.ingress import METRICS_ELSEWHERE, NO_FINAL_EVENT, create_app
from raychat.serve.sse import parse_sse, sse_event

USER = [{"role": "user", "content": "hi"}]
V1 = "/v1/chat/completions"


@pytest.fixture
def fake():
    return FakeEngine()


@pytest.fixture
def client(fake):
    return TestClient(create_app(fake))


JSON = {"content-type": "application/json"}


def post(client, body, path="/chat/completions", **kw):
    return client.post(path, json=body, **kw)


def assert_error(resp, status, field, fragment):
    assert resp.status_code == status, resp.text
    body = resp.json()
    ErrorResponse.model_validate(body)
    err = body["error"]
    assert err["param"] == field, err
    if field:
        assert err["message"].startswith(f"{field}: "), err["message"]
    assert fragment in err["message"], err["message"]
    assert err["type"] == ("server_error" if status >= 500 else "invalid_request_error")


def assert_400(resp, field, fragment):
    assert_error(resp, 400, field, fragment)


def chat(n, content="a"):
    """n messages alternating user/assistant, ending with a user message (n odd)."""
    return [{"role": "assistant" if i % 2 else "user", "content": content} for i in range(n)]


def call(expression="2*3", call_id="call_1", **raychat):
    c = {"id": call_id, "type": "function",
         "function": {"name": "calculator", "arguments": json.dumps({"expression": expression})}}  # fmt: skip
    if raychat:
        c["raychat"] = raychat
    return c


CALC_TOOL = {"type": "function", "function": {"name": "calculator", "parameters": {"type": "object"}}}

# (body overrides, field, message fragment or None when valid)
BOUNDS = [
    ({"messages": chat(1)}, None, None),
    ({"messages": [{"role": "system", "content": "s"}, *chat(499)]}, None, None),  # 500
    ({"messages": [{"role": "system", "content": "s"}, *chat(501)]}, "messages", "at most 500 items"),
    ({"messages": []}, "messages", "at least 1 item"),
    ({"messages": [{"role": "user", "content": "x" * 8000}]}, None, None),
    ({"messages": [{"role": "user", "content": "x" * 8001}]}, "messages[0].content", "8001 characters; at most 8000"),
    ({"messages": [{"role": "user", "content": [{"type": "text", "text": "x" * 4000}] * 2}]}, "messages[0].content", "8001 characters"),  # joined with "\n"
    ({"messages": [{"role": "user", "content": ""}]}, None, None),
    ({"messages": [*chat(3, "x" * 8000), {"role": "assistant", "content": "x" * 7999}, {"role": "user", "content": "y"}]}, None, None),  # 32000
    ({"messages": [*chat(3, "x" * 8000), {"role": "assistant", "content": "x" * 8000}, {"role": "user", "content": "y"}]}, "messages", "32001 characters; at most 32000"),
    ({"messages": [{"role": "developer", "content": "be brief"}, *USER]}, None, None),
    ({"messages": [{"role": "system", "content": [{"type": "text", "text": "s"}]}, *USER]}, None, None),
    ({"messages": [{"role": "bot", "content": "x"}]}, "messages[0].role", "'system', 'developer', 'user', 'assistant' or 'tool'"),
    ({"messages": [*USER, {"role": "system", "content": "late"}, *USER]}, "messages", "messages[1]: role 'system' not allowed after 'user'"),
    ({"messages": [*USER, *USER]}, "messages", "messages[1]: role 'user' not allowed after 'user'"),
    ({"messages": [*USER, {"role": "assistant", "content": "a"}]}, "messages", "last message must be a user (or tool) message"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}, "messages[0].content", "part 0: only text parts are supported here, got 'image_url'"),
    ({"messages": [{"role": "user", "content": "x", "name": "bob"}]}, "messages[0].name", "participant names are not supported"),
    ({"messages": [{"role": "user", "content": None}]}, "messages[0].content", "field required (null only for an assistant message with tool_calls)"),
    ({"messages": [{"role": "user", "content": "x", "refusal": "no"}]}, "messages[0].refusal", "None"),
    # tool calls in the history (docs/openai.md)
    ({"messages": [*USER, {"role": "assistant", "content": None, "tool_calls": [call()]}, {"role": "tool", "tool_call_id": "call_1", "content": "6"}]}, None, None),
    ({"messages": [*USER, {"role": "assistant", "content": "", "tool_calls": [call()]}, {"role": "tool", "tool_call_id": "call_2", "content": "6"}]}, "messages[2].tool_call_id", "'call_2' answers no call"),
    ({"messages": [*USER, {"role": "assistant", "content": "a", "tool_calls": [call()]}, *USER]}, "messages[2]", "needs a tool message answering it"),
    ({"messages": [*USER, {"role": "assistant", "content": "a", "tool_calls": [call(), call(call_id="c2")]}, {"role": "tool", "tool_call_id": "call_1", "content": "6"}]}, "messages[1].tool_calls", "one tool at a time"),
    ({"messages": [*USER, {"role": "assistant", "content": "ab", "tool_calls": [call(offset=1, output="6")]}, *USER]}, None, None),
    ({"messages": [*USER, {"role": "assistant", "content": "ab", "tool_calls": [call(offset=3, output="6")]}, *USER]}, "messages[1].tool_calls[0].raychat.offset", "3 is outside 0..2"),
    ({"messages": [*USER, {"role": "assistant", "content": "ab", "tool_calls": [call(offset=1), call(call_id="c2")]}, *USER]}, "messages[1].tool_calls", "mixes calls"),
    ({"messages": [*USER, {"role": "assistant", "content": "a", "tool_calls": [{**call(), "function": {"name": "search", "arguments": "{}"}}]}, *USER]}, "messages[1].tool_calls[0].function", "only the built-in 'calculator' function"),
    ({"messages": [*USER, {"role": "assistant", "content": "a", "tool_calls": [{**call(), "function": {"name": "calculator", "arguments": "{2*3"}}]}, *USER]}, "messages[1].tool_calls[0].function", "arguments must be a JSON object, got invalid JSON"),
    ({"messages": [*USER, {"role": "assistant", "content": "a", "tool_calls": [{**call(), "function": {"name": "calculator", "arguments": "[" * 15000 + "]" * 15000}}]}, *USER]}, "messages[1].tool_calls[0].function", "got JSON nested over 32 deep"),  # refused before json.loads, which would recurse
    ({"messages": [*USER, {"role": "assistant", "content": "a", "tool_calls": [{**call(), "function": {"name": "calculator", "arguments": "[" * 33 + "]" * 33}}]}, *USER]}, "messages[1].tool_calls[0].function", "got JSON nested over 32 deep"),
    ({"messages": [*USER, {"role": "assistant", "content": "a", "tool_calls": [{**call(), "function": {"name": "calculator", "arguments": "[" * 32 + "]" * 32}}]}, *USER]}, "messages[1].tool_calls[0].function", '{"expression": "<arithmetic>"}'),
    ({"messages": [*USER, {"role": "assistant", "content": "a", "tool_calls": [{**call(), "function": {"name": "calculator", "arguments": '{"expr": "1"}'}}]}, *USER]}, "messages[1].tool_calls[0].function", '{"expression": "<arithmetic>"}'),
    ({"messages": [{"role": "user", "content": "x", "tool_calls": [call()]}]}, "messages[0].tool_calls", "only an assistant message has tool_calls"),
    ({"messages": [{"role": "tool", "content": "x"}]}, "messages[0].tool_call_id", "field required"),
    ({"messages": [{"role": "user", "content": "x", "tool_call_id": "c"}]}, "messages[0].tool_call_id", "only a tool message"),
    # sampling
    ({"temperature": 0}, None, None),
    ({"temperature": 2.0}, None, None),
    ({"temperature": None}, None, None),
    ({"temperature": -0.01}, "temperature", "greater than or equal to 0"),
    ({"temperature": 2.01}, "temperature", "less than or equal to 2"),
    ({"top_k": 0}, None, None),
    ({"top_k": 200}, None, None),
    ({"top_k": -1}, None, None),  # vLLM's "off": the engine gets 0 (tests/unit/test_serve_openai.py)
    ({"top_k": -2}, "top_k", "greater than or equal to -1"),
    ({"top_k": 201}, "top_k", "less than or equal to 200"),
    ({"top_p": 1.0}, None, None),
    ({"top_p": 1e-6}, None, None),
    ({"top_p": None}, None, None),
    ({"top_p": 0}, "top_p", "greater than 0"),
    ({"top_p": 1.01}, "top_p", "less than or equal to 1"),
    ({"seed": 0}, None, None),
    ({"seed": 2**63 - 1}, None, None),
    ({"seed": -1}, "seed", "greater than or equal to 0"),
    ({"seed": 2**63}, "seed", "less than or equal to 9223372036854775807"),
    # limits
    ({"max_tokens": 1}, None, None),
    ({"max_tokens": 4096}, None, None),
    ({"max_tokens": None}, None, None),
    ({"max_tokens": 0}, "max_tokens", "greater than or equal to 1"),
    ({"max_tokens": 4097}, "max_tokens", "less than or equal to 4096"),
    ({"max_completion_tokens": 1}, None, None),
    ({"max_completion_tokens": 4096}, None, None),
    ({"max_completion_tokens": 0}, "max_completion_tokens", "greater than or equal to 1"),
    ({"max_completion_tokens": 4097}, "max_completion_tokens", "less than or equal to 4096"),
    ({"max_completion_tokens": 7, "max_tokens": 7}, None, None),
    ({"max_completion_tokens": 7, "max_tokens": 8}, "max_completion_tokens", "conflicts with max_tokens (8)"),
    ({"n": 1}, None, None),
    ({"n": 8}, None, None),
    ({"n": 0}, "n", "greater than or equal to 1"),
    ({"n": 9}, "n", "less than or equal to 8"),
    ({"stop": ["a", "b", "c", "d"]}, None, None),
    ({"stop": []}, None, None),
    ({"stop": "x" * 64}, None, None),
    ({"stop": ["a", "b", "c", "d", "e"]}, "stop", "0 to 4 strings, got 5"),
    ({"stop": "x" * 65}, "stop", "1 to 64 characters, got 65"),
    ({"stop": [""]}, "stop", "1 to 64 characters, got 0"),
    # streaming, logprobs, tools, format
    ({"stream": True, "stream_options": {"include_usage": True, "include_obfuscation": False}}, None, None),
    ({"stream_options": {"include_usage": True}}, "stream_options", "only allowed when stream is true"),
    ({"stream": True, "stream_options": {"include_usage": True, "chunk": 1}}, "stream_options.chunk", "unknown field"),
    ({"logprobs": True, "top_logprobs": 0}, None, None),
    ({"logprobs": True, "top_logprobs": 20}, None, None),
    ({"logprobs": True, "top_logprobs": 21}, "top_logprobs", "less than or equal to 20"),
    ({"logprobs": True, "top_logprobs": -1}, "top_logprobs", "greater than or equal to 0"),
    ({"top_logprobs": 2}, "top_logprobs", "needs logprobs: true"),
    ({"tools": [CALC_TOOL], "tool_choice": "auto", "parallel_tool_calls": False}, None, None),
    ({"tools": [{"type": "function", "function": {"name": "search"}}]}, "tools[0].function", "only the built-in 'calculator' tool"),
    ({"tools": [CALC_TOOL, CALC_TOOL]}, "tools", "at most 1 item"),
    ({"tools": [{"type": "custom", "custom": {"name": "x"}}]}, "tools[0].type", "'function'"),
    ({"tools": [CALC_TOOL], "tool_choice": "required"}, "tool_choice", "only 'auto' is supported"),
    ({"tools": [CALC_TOOL], "tool_choice": "none"}, "tool_choice", "only 'auto' is supported"),
    ({"tool_choice": "auto"}, "tool_choice", "only allowed when tools are given"),
    ({"response_format": {"type": "text"}}, None, None),
    ({"response_format": {"type": "json_object"}}, "response_format.type", "only 'text' is supported"),
    # accepted, no effect on the reply
    ({"user": "u1", "safety_identifier": "s", "prompt_cache_key": "k", "prompt_cache_retention": "24h", "metadata": {"a": "b"}, "store": False, "service_tier": "auto"}, None, None),
    ({"user": "u" * 256}, None, None),
    ({"user": "u" * 257}, "user", "at most 256 characters"),
    ({"messages": [*USER, {"role": "assistant", "content": "a", "tool_calls": [call(call_id=f"c{i}", offset=1) for i in range(16)]}, *USER]}, None, None),
    ({"messages": [*USER, {"role": "assistant", "content": "a", "tool_calls": [call(call_id=f"c{i}", offset=1) for i in range(17)]}, *USER]}, "messages[1].tool_calls", "at most 16 items"),
    ({"store": True}, "store", "False"),
    ({"service_tier": "flex"}, "service_tier", "'auto' or 'default'"),
    ({"metadata": {str(i): "v" for i in range(17)}}, "metadata", "at most 16 items"),
    ({"stream_mode": "fast"}, "stream_mode", "unknown field"),
]  # fmt: skip


@pytest.mark.parametrize("override,field,fragment", BOUNDS, ids=[f"{i}-{b[1]}" for i, b in enumerate(BOUNDS)])
def test_bounds(client, fake, override, field, fragment):
    resp = post(client, {"messages": USER, **override}, path=V1)
    if field is None:
        assert resp.status_code == 200, resp.text
        assert len(fake.requests) == (override.get("n") or 1)
    else:
        assert_400(resp, field, fragment)
        assert fake.requests == []  # rejected before the engine saw it


@pytest.mark.parametrize("name", sorted(api.REFUSED))
def test_refused_parameters_name_themselves_unless_they_change_nothing(client, fake, name):
    for noop in api.REFUSED[name]:
        assert post(client, {"messages": USER, name: noop}, path=V1).status_code == 200, (name, noop)
    bad = {
        "logit_bias": {"5": 10},
        "functions": [{"name": "f"}],
        "function_call": "auto",
        "modalities": ["audio"],
    }
    assert_400(
        post(client, {"messages": USER, name: bad.get(name, 0.5)}, path=V1), name, "not supported by raychat"
    )
    assert len(fake.requests) == len(api.REFUSED[name])


def test_every_openai_parameter_is_classified():
    """openai's own list of Chat Completions parameters (its TypedDict), so a new one fails here first."""
    openai_params = set(typing.get_type_hints(completion_create_params.CompletionCreateParamsBase)) | {
        "stream"
    }
    ours = set(api.HONOURED) | set(api.NO_EFFECT) | set(api.REFUSED)
    assert ours == openai_params
    assert set(api.ChatRequest.model_fields) == ours | set(api.EXTENSIONS) | set(api.VLLM_CHAT_NOOP)


WRONG_TYPES = [
    ({"temperature": "0.5"}, "temperature", "valid number"),
    ({"top_k": 1.5}, "top_k", "valid integer"),
    ({"top_k": True}, "top_k", "valid integer"),
    ({"max_tokens": "10"}, "max_tokens", "valid integer"),
    ({"seed": 1.0}, "seed", "valid integer"),
    ({"stream": "yes"}, "stream", "valid boolean"),
    ({"logprobs": 1}, "logprobs", "valid boolean"),
    ({"stop": 3}, "stop", "valid string"),
    ({"messages": "hi"}, "messages", "valid list"),
    ({"messages": ["hi"]}, "messages[0]", "valid dictionary"),
    ({"messages": [{"role": "user", "content": 5}]}, "messages[0].content", "valid string"),
    ({"messages": [{"role": "user"}]}, "messages[0].content", "field required"),
    ({"messages": [{"content": "x"}]}, "messages[0].role", "field required"),
    (
        {"messages": [{"role": "user", "content": "x", "colour": "red"}]},
        "messages[0].colour",
        "unknown field",
    ),
]


@pytest.mark.parametrize("override,field,fragment", WRONG_TYPES, ids=[w[1] + "-" + str(i) for i, w in enumerate(WRONG_TYPES)])  # fmt: skip
def test_wrong_types_and_missing_fields(client, override, field, fragment):
    assert_400(post(client, {"messages": USER, **override}), field, fragment)


def test_a_body_of_thousands_of_unknown_fields_lists_the_first_20_and_counts_the_rest(client, fake):
    """Every unknown field got its own "did you mean" search and a line in `details`, on the replica's event
    loop: 24,000 of them (a 517 KB body, under the 512 KiB limit) took 3.9 s and a 1.4 MB answer, during
    which no other request or stream of the replica moved. The answer now names the first error as always,
    lists MAX_DETAILS (20) fields and counts the rest in one line."""
    extra = {f"x{i}": 0 for i in range(5000)}
    resp = post(client, {"messages": USER, "temperatur": 0.5, **extra}, path=V1)
    assert_400(resp, "temperatur", "unknown field; did you mean temperature?")
    details = resp.json()["error"]["details"]
    assert details[0] == "temperatur: unknown field; did you mean temperature?"
    assert details[1].startswith("x0: unknown field (raychat does not support it here; ")
    assert [d.split(":")[0] for d in details[1:20]] == [f"x{i}" for i in range(19)]
    assert details[20:] == ["... and 4981 more fields in error"] and fake.requests == []
    assert post(client, {"messages": USER}, path=V1).status_code == 200  # the next request is served


def test_engine_request_from_an_openai_request(client, fake):
    history = [
        {"role": "developer", "content": [{"type": "text", "text": "be"}, {"type": "text", "text": "brief"}]},
        {"role": "user", "content": "What is 2*3?"},
        {"role": "assistant", "content": "Let me. #### 6", "tool_calls": [call(offset=8, output="6")]},
        {"role": "user", "content": "And 1+1?"},
    ]
    body = {
        "messages": history,
        "max_completion_tokens": 9,
        "stop": "END",
        "temperature": None,
        "n": 3,
        "seed": 5,
    }
    assert post(client, body, path=V1).status_code == 200
    first, second, third = fake.requests
    assert first == {
        "messages": [
            {"role": "system", "content": "be\nbrief"},
            {"role": "user", "content": "What is 2*3?"},
            {"role": "assistant", "content": [{"type": "text", "text": "Let me. "}, {"type": "python", "text": "2*3"},
                                              {"type": "python_output", "text": "6"}, {"type": "text", "text": "#### 6"}]},
            {"role": "user", "content": "And 1+1?"},
        ],
        "temperature": None, "top_k": None, "top_p": None, "max_tokens": 9, "stop": ["END"], "logprobs": False,
        "top_logprobs": 0, "client_tools": False, "seed": 5, "max_tokens_param": "max_completion_tokens",
    }  # fmt: skip
    from raychat.engine.runner import derive_seed

    assert (second["seed"], third["seed"]) == (derive_seed(5, 1), derive_seed(5, 2))
    assert {k: v for k, v in second.items() if k != "seed"} == {k: v for k, v in first.items() if k != "seed"}
    post(client, {"messages": USER, "tools": [CALC_TOOL], "max_tokens": 3}, path=V1)
    assert fake.requests[-1]["client_tools"] is True and fake.requests[-1]["max_tokens"] == 3
    post(client, {"messages": USER}, path=V1)
    assert fake.requests[-1]["max_tokens"] is None and fake.requests[-1]["seed"] is None  # defaults


@pytest.mark.parametrize("field", ["temperature", "top_p"])
@pytest.mark.parametrize("value", ["NaN", "Infinity", "-Infinity"])
def test_nan_and_infinity_are_not_finite_numbers(client, fake, field, value):
    """NaN read as "Input should be greater than or equal to 0" (temperature) or "greater than 0" (top_p)."""
    body = f'{{"messages": [{{"role": "user", "content": "hi"}}], "{field}": {value}}}'.encode()
    resp = client.post(V1, content=body, headers={"content-type": "application/json"})
    assert_400(resp, field, "finite number")
    assert fake.requests == []


def test_missing_messages_and_bad_json(client, fake):
    assert_400(post(client, {"temperature": 1}), "messages", "field required")
    resp = client.post(
        "/chat/completions", content=b'{"messages": [', headers={"content-type": "application/json"}
    )
    assert_400(resp, "body", "JSON")
    not_utf8 = client.post(V1, content=b'{"messages": "\xff"}', headers={"content-type": "application/json"})
    assert not_utf8.status_code == 400
    assert not_utf8.json()["error"] == {
        "message": "body: not UTF-8: byte 0xff at offset 14 (send JSON in UTF-8)", "type": "invalid_request_error",
        "param": "body", "code": None,
    }  # fmt: skip
    valid = json.dumps({"messages": USER}).encode()
    for path in ("/chat/completions", V1, "/v1/completions"):  # `curl -d` sends a form's Content-Type
        form = client.post(path, content=valid, headers={"content-type": "application/x-www-form-urlencoded"})
        message = "Content-Type: send the body as application/json, got 'application/x-www-form-urlencoded'"
        assert_error(form, 415, None, message)
        assert_error(client.post(path, content=valid), 415, None, "application/json, got none")
    resp = post(client, {"prompt": "hi", "messages": USER}, path="/v1/completions")
    assert resp.json()["error"]["details"] == [
        "messages: unknown field (raychat does not support it here; docs/openai.md lists the accepted fields)"
    ]
    assert_error(client.get("/no-such-page"), 404, None, "Not Found")
    assert_error(client.get("/metrics"), 404, None, METRICS_ELSEWHERE)  # where vLLM serves them
    assert_error(client.get(V1), 405, None, "Method Not Allowed")
    assert fake.requests == []


def test_oversized_body_is_413_before_parsing(client, fake):
    big = b"{" + b" " * MAX_BODY_BYTES + b"}"  # not even valid as a request: parsing never happens
    resp = client.post("/chat/completions", content=big, headers={"content-type": "application/json"})
    assert_error(resp, 413, "body", f"body: request body exceeds {MAX_BODY_BYTES} bytes")

    def chunked():  # no Content-Length: the middleware counts the bytes
        for _ in range(9):
            yield b" " * (64 * 1024)

    resp = client.post(V1, content=chunked(), headers={"content-type": "application/json"})
    assert resp.status_code == 413
    # the largest valid request (32000 characters, each a JSON-escaped surrogate pair) fits
    body = json.dumps(
        {"messages": chat(3, "🙂" * 8000) + [{"role": "assistant", "content": "🙂" * 7998}, USER[0]]}
    )
    assert 384_000 < len(body) <= MAX_BODY_BYTES
    resp = client.post(
        "/chat/completions", content=body.encode(), headers={"content-type": "application/json"}
    )
    assert resp.status_code == 200
    assert len(fake.requests) == 1


KEY = {"Authorization": "Bearer s3cret"}
# every route that needs the key: (method, path relative to the app, json body)
PROTECTED = [
    ("POST", "/chat/completions", {"messages": USER}),
    ("POST", V1, {"messages": USER}),
    ("GET", "/v1/models", None),
    ("GET", "/v1/models/tiny", None),
]


def at_route_prefix(app, prefix: str):
    """The app as Ray Serve's proxy hands it a request under `route_prefix` (ray/serve/_private/proxy.py:
    root_path += route_prefix, scope["path"] stays the full path)."""

    async def proxied(scope, receive, send):
        if scope["type"] == "http":
            scope = {**scope, "root_path": scope.get("root_path", "") + prefix}
        return await app(scope, receive, send)

    return proxied


def mounted(app, where: str) -> tuple[TestClient, str]:
    """(client, URL prefix) of `app` served at the root, at a Serve route prefix (/api), behind
    http_options.root_path (/proxy: uvicorn puts it in root_path and in front of the path), or both."""
    if where == "root":
        return TestClient(app), ""
    if where == "route_prefix":
        return TestClient(at_route_prefix(app, "/api")), "/api"
    if where == "root_path":
        return TestClient(app, root_path="/proxy"), "/proxy"
    return TestClient(at_route_prefix(app, "/api"), root_path="/proxy"), "/proxy/api"


MOUNTS = ["root", "route_prefix", "root_path", "root_path+route_prefix"]


@pytest.mark.parametrize("where", MOUNTS)
@pytest.mark.parametrize("method,path,body", PROTECTED, ids=[f"{m} {p}" for m, p, _ in PROTECTED])
def test_every_keyed_route_needs_the_key_wherever_the_app_is_mounted(where, method, path, body):
    fake = FakeEngine()
    client, base = mounted(create_app(fake, api_key="s3cret"), where)
    for headers in ({}, {"Authorization": "Bearer nope"}, {"Authorization": "s3cret"}, {"Authorization": "Basic s3cret"}):  # fmt: skip
        r = client.request(method, base + path, json=body, headers=headers)
        assert r.status_code == 401, (headers, r.text)
        assert r.headers["www-authenticate"] == "Bearer"
        assert r.json()["error"]["type"] == "authentication_error"
    assert fake.requests == []  # nothing reached the engine
    ok = client.request(method, base + path, json=body, headers=KEY)
    assert ok.status_code == 200, ok.text
    assert len(fake.requests) == (1 if method == "POST" else 0)


@pytest.mark.parametrize("where", MOUNTS)
def test_only_the_page_schema_and_health_status_are_open(where):
    fake = FakeEngine()
    client, base = mounted(create_app(fake, api_key="s3cret"), where)
    assert client.get(base + "/").status_code == 200
    assert client.get(base + "/openapi.json").status_code == 200
    # paths no route has are refused before routing too: a new route cannot be open by accident
    assert client.get(base + "/v2/anything").status_code == 401
    assert client.get(base + "/health").json() == {"status": "ok"}  # no versions, no replica stats
    full = client.get(base + "/health", headers=KEY).json()
    assert full == {"status": "ok", "model_id": "tiny", "template_version": TEMPLATE_VERSION,
                    "tokenizer_version": "abc", "engine": {"in_flight": 0}}  # fmt: skip


def test_health_without_the_key_says_only_unavailable():
    class Down(FakeEngine):
        async def stats(self):
            return {"engine_running": False, "pid": 4242, "rss_bytes": 123456}

    client = TestClient(create_app(Down(), api_key="s3cret"))
    r = client.get("/health")
    assert (r.status_code, r.json()) == (503, {"status": "unavailable"})
    r = client.get("/health", headers=KEY)
    assert r.status_code == 503 and r.json()["engine"]["pid"] == 4242
    assert r.json()["reason"] == "the engine process of the replica that answered is down"
    # without a configured key the service is open (the CLI refuses that off loopback) and says everything
    assert TestClient(create_app(Down())).get("/health").json()["engine"]["pid"] == 4242


def test_health_answers_503_with_the_reason_when_no_replica_answers():
    """The engine client found no replica (with a Serve handle: none answered within health_timeout_s): 503
    with Retry-After and, for a request with the key, the client's reason; not the error shape of a failed
    request."""
    why = "no ChatServer replica answered within 5 s; ChatServer is UNHEALTHY (replicas: 1 STARTING): gone"

    class NoReplica(FakeEngine):
        async def stats(self):
            raise EngineUnavailableError(why)

    client = TestClient(create_app(NoReplica(), api_key="s3cret"))
    r = client.get("/health")
    assert (r.status_code, r.headers["retry-after"], r.json()) == (503, "5", {"status": "unavailable"})
    r = client.get("/health", headers=KEY)
    assert (r.status_code, r.json()) == (503, {"status": "unavailable", "reason": why})


def test_no_key_configured_leaves_every_route_open():
    fake = FakeEngine()
    client, base = mounted(create_app(fake), "route_prefix")
    for method, path, body in PROTECTED:
        assert client.request(method, base + path, json=body).status_code == 200, path


def test_sse_framing_and_final_event(client, fake):
    resp = post(client, {"messages": USER, "temperature": 0, "top_k": 0, "stop": "END"})
    assert resp.headers["content-type"].startswith("text/event-stream")
    raw = resp.text
    # one JSON line per event (a newline in the text is JSON-escaped); the empty delta is not sent
    assert raw.startswith('data: {"type":"delta","index":0,"text":"Hel"}\n\n')
    assert '\ndata: {"type":"delta","index":0,"text":"lo\\nworld"}\n\n' in raw
    events = [json.loads(e) for e in parse_sse(raw)]
    assert [e["type"] for e in events] == ["delta", "delta", "done"]
    assert events[-1] == {"type": "done", "index": 0, "finish_reason": "stop", "usage": {"prompt_tokens": 5, "completion_tokens": 4, "total_tokens": 9, "ttft_s": 0.01}}  # fmt: skip
    assert fake.requests[0]["temperature"] == 0.0 and fake.requests[0]["stop"] == ["END"]
    assert fake.closed == 1


def test_raychat_stream_refuses_stream_false(client, fake):
    """POST /chat/completions is the page's stream; it streamed a request that asked for stream: false."""
    resp = post(client, {"messages": USER, "stream": False})
    assert_400(resp, "stream", "always streams (leave stream out or send true); POST /v1/chat/completions")
    assert fake.requests == []
    for stream in (True, None):
        resp = post(client, {"messages": USER, "stream": stream})
        assert resp.headers["content-type"].startswith("text/event-stream")


def test_raychat_stream_carries_tool_calls_and_results():
    script = [
        {"type": "delta", "text": "Let me. ", "tokens": 3, "logprobs": None},
        {"type": "tool_call", "id": "call_a", "expression": "2*3"},
        {"type": "tool_result", "id": "call_a", "output": "6"},
        {"type": "delta", "text": "#### 6", "tokens": 4, "logprobs": None},
        {"type": "done", "finish_reason": "stop", "usage": {"prompt_tokens": 5, "completion_tokens": 12, "total_tokens": 17, "ttft_s": 0.01}},
    ]  # fmt: skip
    client = TestClient(create_app(FakeEngine(script)))
    events = [json.loads(e) for e in parse_sse(post(client, {"messages": USER}).text)]
    assert events[1:3] == [
        {"type": "tool_call", "index": 0, "id": "call_a", "name": "calculator", "expression": "2*3"},
        {"type": "tool_result", "index": 0, "id": "call_a", "output": "6"},
    ]
    assert "".join(e.get("text", "") for e in events) == "Let me. #### 6"


def test_raychat_stream_carries_logprobs_when_asked():
    """logprobs: true on POST /chat/completions puts each delta's entries (OpenAI's per-token shape) in its
    event; they were dropped, the request answered without them (a field accepted and ignored)."""
    entry = {"token": "Hi", "bytes": [72, 105], "logprob": -0.5, "top_logprobs": []}
    script = [{"type": "delta", "text": "Hi", "tokens": 1, "logprobs": [entry]},
              {"type": "done", "finish_reason": "stop", "usage": {"prompt_tokens": 5, "completion_tokens": 1}}]  # fmt: skip
    client = TestClient(create_app(FakeEngine(script)))
    events = [json.loads(e) for e in parse_sse(post(client, {"messages": USER, "logprobs": True}).text)]
    assert events[0] == {"type": "delta", "index": 0, "text": "Hi", "logprobs": [entry]}
    events = [json.loads(e) for e in parse_sse(post(client, {"messages": USER}).text)]
    assert events[0] == {"type": "delta", "index": 0, "text": "Hi"}


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


def test_unknown_model_is_404(client, fake):
    """On both chat routes (POST /chat/completions answered another model's name with this one's reply)."""
    for path in (V1, "/chat/completions"):
        resp = post(client, {"model": "gpt-4", "messages": USER}, path=path)
        assert_error(resp, 404, "model", "'tiny'")
        assert resp.json()["error"]["code"] == "model_not_found" and fake.requests == []
    assert post(client, {"model": "tiny", "messages": USER}).status_code == 200


def test_engine_rejection_is_400_not_a_stream():
    why = "the prompt has 300 tokens, but the model's context length is 256 tokens"
    reject = {"type": "error", "status": 400, "message": why, "param": "messages"}
    fake = FakeEngine([reject])
    client = TestClient(create_app(fake))
    for path in ("/chat/completions", V1):
        assert_400(post(client, {"messages": USER}, path=path), "messages", why)
    assert fake.closed == 2


# ---- every 5xx path answers in the error shape ------------------------------------------------------------
class Boom(RuntimeError):
    pass


def assert_internal(message: str, detail: str, caplog) -> str:
    """A 500's client-facing message: INTERNAL_ERROR and a request id, never `detail`, which the log holds
    under that id. Returns the id."""
    assert message.startswith(f"{INTERNAL_ERROR} (request id req_"), message
    assert detail not in message
    request_id = message.split("request id ")[1].split(";")[0]
    assert len(request_id) == 20
    logged = [r for r in caplog.records if request_id in r.getMessage()]
    assert len(logged) == 1 and detail in logged[0].getMessage(), [r.getMessage() for r in caplog.records]
    return request_id


FAILURES = [
    # (engine, status, message fragment): before the first event, so the answer is an HTTP status; a 500's
    # fragment is the internal detail, which only the log may hold
    (FakeEngine(fail={0: Boom("replica crashed while submitting")}), 500, "Boom: replica crashed"),
    (FakeEngine(fail={0: EngineUnavailableError("RayActorError: died")}), 503, "engine unavailable: RayActorError"),
    (FakeEngine([]), 500, NO_FINAL_EVENT),
    (FakeEngine([{"type": "error", "status": 503, "message": "engine unavailable: restarting", "param": None}]), 503, "restarting"),
    (FakeEngine([{"type": "error", "status": 500, "message": "RuntimeError: engine process exited", "param": None}]), 500, "engine process exited"),
]  # fmt: skip


@pytest.mark.parametrize("engine,status,fragment", FAILURES)
def test_failures_before_the_first_event(engine, status, fragment, caplog):
    client = TestClient(create_app(engine), raise_server_exceptions=False)
    for path in ("/chat/completions", V1):
        for stream in (None if path == "/chat/completions" else False, True):  # the page's only streams
            resp = post(client, {"messages": USER, "stream": stream}, path=path)
            assert (resp.headers.get("retry-after") == "5") == (status == 503)
            if status != 500:
                assert_error(resp, status, None, fragment)
                continue
            assert_error(resp, 500, None, INTERNAL_ERROR)
            request_id = assert_internal(resp.json()["error"]["message"], fragment, caplog)
            assert resp.json()["error"]["request_id"] == resp.headers["x-request-id"] == request_id
    assert engine.closed == len(engine.requests) == 4


HEL = [{"type": "delta", "text": "Hel", "tokens": 1, "logprobs": None}]
MID_STREAM = [  # (engine, status, fragment: a 500's is the internal detail, which only the log may hold)
    (FakeEngine(HEL), 500, NO_FINAL_EVENT),
    (FakeEngine([*HEL, {"type": "error", "status": 500, "message": "RuntimeError: engine process exited", "param": None}]), 500, "engine process exited"),
    (FakeEngine([*HEL, {"type": "error", "status": 503, "message": "engine unavailable: restarting", "param": None}]), 503, "restarting"),
    (FakeEngine([*HEL, *HEL], fail={1: Boom("lost the replica")}), 500, "Boom: lost the replica"),
    (FakeEngine([*HEL, *HEL], fail={1: EngineUnavailableError("ActorDiedError")}), 503, "engine unavailable"),
]  # fmt: skip


@pytest.mark.parametrize("engine,status,fragment", MID_STREAM)
def test_failures_after_the_first_event(engine, status, fragment, caplog):
    """Non-streaming: a 500/503 error body. Streaming: the stream has started (200), so the failure is an
    error event in it (OpenAI's chunk form is the error body itself, which the openai clients raise). A 500
    names only a request id, in all three forms."""

    def check(message: str) -> None:
        if status == 500:
            assert_internal(message, fragment, caplog)
        else:
            assert fragment in message

    client = TestClient(create_app(engine), raise_server_exceptions=False)
    resp = post(client, {"messages": USER}, path=V1)
    assert_error(resp, status, None, INTERNAL_ERROR if status == 500 else fragment)
    check(resp.json()["error"]["message"])
    streamed = post(client, {"messages": USER, "stream": True}, path=V1)
    assert streamed.status_code == 200
    events = parse_sse(streamed.text)
    assert events[-1] == "[DONE]"
    error = json.loads(events[-2])
    ErrorResponse.model_validate(error)
    assert error["error"]["type"] == "server_error"
    check(error["error"]["message"])
    raw = [json.loads(e) for e in parse_sse(post(client, {"messages": USER}).text)]
    assert raw[0] == {"type": "delta", "index": 0, "text": "Hel"}
    assert set(raw[-1]) == {"type", "index", "message"}  # the shape of the stream's other events
    assert raw[-1]["type"] == "error" and raw[-1]["index"] == 0
    check(raw[-1]["message"])
    assert engine.closed == len(engine.requests) == 3


def test_health_and_models_survive_a_failing_engine_client(caplog):
    class Broken(FakeEngine):
        async def stats(self):
            raise Boom("stats unavailable")

    client = TestClient(create_app(Broken()), raise_server_exceptions=False)
    resp = client.get("/health")
    assert_error(resp, 500, None, INTERNAL_ERROR)
    assert_internal(resp.json()["error"]["message"], "Boom: stats unavailable", caplog)
    assert client.get("/v1/models").status_code == 200


def test_models_health_page(client):
    card = client.get("/v1/models").json()["data"][0]
    assert card["id"] == "tiny" and card["template_version"] == TEMPLATE_VERSION
    assert client.get("/v1/models/tiny").json() == card
    assert client.get("/v1/models/", follow_redirects=False).json() == {"object": "list", "data": [card]}
    health = client.get("/health").json()
    assert health["status"] == "ok" and health["template_version"] == TEMPLATE_VERSION
    page = client.get("/").text
    for element in ('id="send"', 'id="stop"', 'id="regenerate"', 'id="temperature"', 'id="top_k"', "/chat/completions"):  # fmt: skip
        assert element in page
    schema = client.get("/openapi.json").json()
    responses = schema["paths"][V1]["post"]["responses"]
    assert set(responses) == {
        "200",
        "400",
        "401",
        "404",
        "413",
        "415",
        "429",
        "500",
        "503",
        "504",
    }  # never 422
    assert set(responses["200"]["content"]) == {"application/json", "text/event-stream"}


def test_details_as_documented(client):
    """docs/openai.md's `details` example is the server's answer to the request the doc names; a field that
    fails both members of a union (a number given as a string) is listed once; JSON that does not parse is
    "body" in details too, with where and why."""
    doc = (Path(__file__).resolve().parents[2] / "docs" / "openai.md").read_text()
    asked = re.search(r"Asked `(\{.*?\})`, the server answers", doc, re.S)
    answer = re.search(r"the server answers .*?```json\n(.*?)```", doc, re.S)
    resp = post(client, json.loads(asked.group(1)), path=V1)
    assert resp.status_code == 400 and resp.json() == json.loads(answer.group(1))
    resp = post(client, {"messages": USER, "temperature": "hot"}, path=V1)
    assert resp.json()["error"]["details"] == ["temperature: Input should be a valid number"]
    resp = client.post(V1, content=b'{"messages": [', headers={"content-type": "application/json"})
    error = resp.json()["error"]
    assert error["message"] == "body: invalid JSON at character 14 (Expecting value)"
    assert error["details"] == [error["message"]]


def test_a_lone_surrogate_in_a_tool_call_or_a_stop_string_is_refused_by_name(client, fake):
    """The same refusal where a call's arguments (whose expression the template renders), a server-run call's
    output, or a stop string (which could never match the text) holds one: each was accepted, and the
    rendered prompt held U+FFFD. (json.dumps writes a lone surrogate as its \\u escape.)"""
    bodies = {
        "messages[1].tool_calls[0].function": (
            [call("2\ud800", offset=0)],
            "arguments: the expression has a lone surrogate (U+D800)",
        ),
        "messages[1].tool_calls[0].raychat.output": (
            [call(offset=0, output="\udc00")],
            "has a lone surrogate (U+DC00)",
        ),
    }
    for field, (calls, said) in bodies.items():
        history = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "x", "tool_calls": calls},
                   {"role": "user", "content": "ok"}]  # fmt: skip
        body = json.dumps({"messages": history}).encode()
        assert_400(client.post(V1, content=body, headers=JSON), field, said)
    body = json.dumps({"messages": USER, "stop": ["ok", "\ud800"]}).encode()
    assert_400(client.post(V1, content=body, headers=JSON), "stop", "has a lone surrogate (U+D800)")
    assert fake.requests == []


def test_a_lone_surrogate_in_content_is_refused_by_name(client, fake):
    """JSON's "\\ud800" escape decodes to a lone surrogate, which has no UTF-8 encoding: the template read it as
    U+FFFD, so the model answered other text than sent; refused as /v1/completions refuses it in a prompt."""
    for content, where in [
        ('"ab\\ud800cd"', 2),
        ('[{"type": "text", "text": "ok"}, {"type": "text", "text": "\\udfff"}]', 3),
    ]:
        body = f'{{"messages": [{{"role": "user", "content": {content}}}]}}'.encode()
        resp = client.post(V1, content=body, headers={"content-type": "application/json"})
        assert_400(resp, "messages[0].content", "has a lone surrogate (U+D")
        assert f"at character {where}: not valid Unicode text" in resp.json()["error"]["message"]
    assert fake.requests == []
