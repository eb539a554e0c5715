"""OpenAI response shapes over a scripted engine, each validated with openai's own types (ChatCompletion,
ChatCompletionChunk) and streams accumulated by openai's own ChatCompletionStreamState: text, tool calls the
server ran (with the "raychat" record), client-run calls (finish_reason "tool_calls"), n choices, logprobs,
and a returned message sent back as history. The official client itself: models.retrieve (ids holding "/"),
and vLLM's extra_body parameters, accepted at vLLM's defaults and refused by name otherwise; an unknown
field refused with the field it misspells or where the accepted ones are listed."""

from __future__ import annotations

import json
import time
from functools import partial

import openai
import pytest
from fastapi.testclient import TestClient
from openai.lib.streaming.chat import ChatCompletionStreamState
from openai.types.chat import ChatCompletion, ChatCompletionChunk
from support.serve_helpers import HELLO, FakeEngine, write_tiny_checkpoint

from raychat.checkpoint_manager import snapshot_checkpoint
from raychat.serve import api
from raychat.serve.engine_adapter import MIN_LOGPROB, LogprobGate, sampling_params, text_logprobs
from raychat.serve.ingress import LocalClient, create_app
from raychat.serve.server import ChatServer, committed_at
from raychat.serve.sse import parse_sse

USER = [{"role": "user", "content": "What is 2*3?"}]
V1 = "/v1/chat/completions"
USAGE = {"prompt_tokens": 5, "completion_tokens": 12, "total_tokens": 17, "ttft_s": 0.01}
TOOL_TURN = [
    {"type": "delta", "text": "Let me. ", "tokens": 3, "logprobs": None},
    {"type": "tool_call", "id": "call_a", "expression": "2*3"},
    {"type": "tool_result", "id": "call_a", "output": "6"},
    {"type": "delta", "text": "#### 6", "tokens": 4, "logprobs": None},
    {"type": "done", "finish_reason": "stop", "usage": USAGE},
]
CLIENT_CALL = [*TOOL_TURN[:2], {"type": "done", "finish_reason": "tool_calls", "usage": USAGE}]


def completion(script, **body):
    resp = TestClient(create_app(FakeEngine(script))).post(V1, json={"messages": USER, **body})
    assert resp.status_code == 200, resp.text
    return ChatCompletion.model_validate(resp.json()), resp.json()


def chunks(script, **body):
    fake = FakeEngine(script)
    resp = TestClient(create_app(fake)).post(V1, json={"messages": USER, "stream": True, **body})
    events = parse_sse(resp.text)
    assert events[-1] == "[DONE]"
    return [ChatCompletionChunk.model_validate(json.loads(e)) for e in events[:-1]], fake


def accumulated(chunk_list):
    """The final completion as openai's own stream helper builds it from the chunks."""
    state = ChatCompletionStreamState()
    for c in chunk_list:
        state.handle_chunk(c)
    return state.get_final_completion()


def official_client(engine) -> openai.OpenAI:
    """openai's own client over the app (no network: TestClient is an httpx.Client)."""
    return openai.OpenAI(base_url="http://testserver/v1", api_key="unused", max_retries=0,
                         http_client=TestClient(create_app(engine)))  # fmt: skip


# the default id is --checkpoint as typed: relative, absolute and URI ids hold "/" (the client sends %2F)
@pytest.mark.parametrize(
    "model_id", ["tiny", "runs/sft", "/mnt/checkpoints/runs/rl/latest", "s3://b/runs/rl/latest"]
)
def test_models_retrieve_finds_the_served_id_and_names_it_for_another(model_id):
    client = official_client(FakeEngine(model_id=model_id))
    listed = client.models.list().data
    card = client.models.retrieve(model_id)
    assert [m.id for m in listed] == [card.id] == [model_id]
    assert card.model_dump() == listed[0].model_dump()
    assert (card.object, card.owned_by) == ("model", "raychat")
    assert card.model_extra["max_seq_len"] == card.model_extra["max_model_len"] == 256  # vLLM's name too
    for other in ("gpt-4", f"{model_id}/x", "runs"):
        with pytest.raises(openai.NotFoundError) as err:
            client.models.retrieve(other)
        assert err.value.status_code == 404 and err.value.code == "model_not_found"
        assert err.value.param == "model"
        assert err.value.body["message"] == f"model: {other!r} is not served here; available: [{model_id!r}]"


def test_the_model_card_is_created_when_its_checkpoint_was_committed(tmp_path):
    """`created` was 0 (1970) in both routes: it is the Unix time (whole seconds) the served checkpoint's commit
    marker records, else, for an engine that does not know it, the time the app started."""
    ckpt = write_tiny_checkpoint(tmp_path / "checkpoint_000000")
    marker = json.loads((ckpt / "commit.json").read_text())
    marker["committed_at"] = 1767225600.75  # 2026-01-01T00:00:00.75Z
    (ckpt / "commit.json").write_text(json.dumps(marker))
    served = snapshot_checkpoint(ckpt)  # what serve deploys of a run's checkpoint: its marker as it is
    server = ChatServer.from_checkpoint(served, model_id="tiny", max_slots=1)
    try:
        client = official_client(LocalClient(server))
        (listed,) = client.models.list().data
        assert listed.created == client.models.retrieve("tiny").created == 1767225600
    finally:
        server.shutdown()
    del marker["committed_at"]  # a marker written without it
    (ckpt / "commit.json").write_text(json.dumps(marker))
    assert committed_at(ckpt) is None
    (ckpt / "commit.json").unlink()  # none at all (the engine process' child refuses to load it)
    assert committed_at(ckpt) is None
    before = int(time.time())
    client = official_client(FakeEngine())  # its info() has no "created"
    after = int(time.time())
    (listed,) = client.models.list().data
    assert before <= listed.created <= after and client.models.retrieve("tiny").created == listed.created


# vLLM's extensions as a vLLM user sends them (extra_body): its default, and a value that would change the reply
VLLM_DEFAULT_AND_OTHER = {
    "min_p": (0.0, 0.1, "null or 0"),
    "repetition_penalty": (1.0, 1.1, "null or 1"),
    "min_tokens": (0, 2, "null or 0"),
    "ignore_eos": (False, True, "null or false"),
    "stop_token_ids": ([], [5], "null or []"),
    "include_stop_str_in_output": (False, True, "null or false"),
    "skip_special_tokens": (True, False, "null or true"),
    "add_generation_prompt": (True, False, "null or true"),
    "continue_final_message": (False, True, "null or false"),
}


def test_vllm_extensions_work_at_their_default_and_are_refused_by_name_otherwise():
    assert set(VLLM_DEFAULT_AND_OTHER) == set(api.VLLM_CHAT_NOOP)
    fake = FakeEngine(HELLO)
    client = official_client(fake)
    client.chat.completions.create(model="tiny", messages=USER)
    plain = fake.requests[-1]
    defaults = {name: default for name, (default, _, _) in VLLM_DEFAULT_AND_OTHER.items()}
    reply = client.chat.completions.create(model="tiny", messages=USER, extra_body=defaults)
    assert reply.choices[0].message.content == "Hello\nworld" and fake.requests[-1] == plain
    client.chat.completions.create(model="tiny", messages=USER, extra_body={"top_k": -1})  # vLLM's "off"
    assert plain["top_k"] is None and fake.requests[-1] == {**plain, "top_k": 0}  # raychat's "off"
    for name, (_, other, allowed) in VLLM_DEFAULT_AND_OTHER.items():
        with pytest.raises(openai.BadRequestError) as err:
            client.chat.completions.create(model="tiny", messages=USER, extra_body={name: other})
        assert err.value.param == name
        assert err.value.body["message"] == f"{name}: not supported by raychat; only {allowed} is accepted"
    # vLLM's stream option: usage in every chunk
    stream = {"stream": True, "stream_options": {"include_usage": True, "continuous_usage_stats": False}}
    assert (
        list(client.chat.completions.create(model="tiny", messages=USER, **stream))[-1].usage.total_tokens
        == 9
    )
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model="tiny", messages=USER, stream=True,
                                       stream_options={"continuous_usage_stats": True})  # fmt: skip
    assert err.value.body["message"] == (
        "stream_options.continuous_usage_stats: not supported by raychat; only null or false is accepted"
    )
    assert len(fake.requests) == 4  # the refused ones never reached the engine


VLLM_UNSUPPORTED = {
    "best_of": 2,
    "use_beam_search": True,
    "guided_json": {"type": "object"},
    "chat_template_kwargs": {"enable_thinking": False},
    "priority": 1,
    "prompt_logprobs": 1,
    "truncate_prompt_tokens": 8,
}
NOT_SUPPORTED = "unknown field (raychat does not support it here; docs/openai.md lists the accepted fields)"


def refusal(name: str, reason: str) -> dict:
    return {"message": f"{name}: {reason}", "type": "invalid_request_error", "param": name, "code": None,
            "details": [f"{name}: {reason}"]}  # fmt: skip


def misspelt(name: str, meant: str) -> dict:
    return refusal(name, f"unknown field; did you mean {meant}?")


def test_an_unknown_field_is_refused_with_the_field_meant_or_where_the_accepted_ones_are():
    fake = FakeEngine(HELLO)
    client = official_client(fake)
    chat = partial(client.chat.completions.create, model="tiny", messages=USER)  # messages=... overrides
    text = partial(client.completions.create, model="tiny", prompt="2*3=")
    refused = []
    for name, value in VLLM_UNSUPPORTED.items():  # vLLM's own parameters: no near miss of raychat's
        refused += [(chat, {"extra_body": {name: value}}, refusal(name, NOT_SUPPORTED))]
        if name != "best_of":  # a Completions parameter (only 1)
            refused += [(text, {"extra_body": {name: value}}, refusal(name, NOT_SUPPORTED))]
    for create in (chat, text):  # misspelt: the field meant, also inside a nested object
        refused += [
            (create, {"extra_body": {"max_token": 5}}, misspelt("max_token", "max_tokens")),
            (create, {"extra_body": {"temprature": 0}}, misspelt("temprature", "temperature")),
            (create, {"stream": True, "stream_options": {"include_usages": True}},
             misspelt("stream_options.include_usages", "include_usage")),
        ]  # fmt: skip
    tools = [{"type": "function", "function": {"name": "calculator", "descripton": "2*3"}}]
    refused += [
        (
            text,
            {"extra_body": {"messages": USER}},
            refusal("messages", NOT_SUPPORTED),
        ),  # chat's, not this route's
        (chat, {"messages": [{**USER[0], "nmae": "ann"}]}, misspelt("messages[0].nmae", "name")),
        (chat, {"tools": tools}, misspelt("tools[0].function.descripton", "description")),
    ]
    for create, kwargs, body in refused:
        with pytest.raises(openai.BadRequestError) as err:
            create(**kwargs)
        assert err.value.status_code == 400 and err.value.body == body
    # a refused request harms no other: the next one is answered as if it were the first
    assert chat().choices[0].message.content == "Hello\nworld"
    assert len(fake.requests) == 1


def test_text_reply_with_and_without_streaming():
    reply, raw = completion(HELLO, max_completion_tokens=4)
    assert raw["choices"][0]["message"] == {"role": "assistant", "content": "Hello\nworld"}
    assert reply.choices[0].finish_reason == "stop" and reply.choices[0].logprobs is None
    # the scripted engine reports no cached_tokens: 0
    details = {"cached_tokens": 0}
    assert raw["usage"] == {"prompt_tokens": 5, "completion_tokens": 4, "total_tokens": 9, "prompt_tokens_details": details}  # fmt: skip
    got, _ = chunks(HELLO, stream_options={"include_usage": True})
    raw_chunks = parse_sse(
        TestClient(create_app(FakeEngine(HELLO)))
        .post(V1, json={"messages": USER, "stream": True, "stream_options": {"include_usage": True}})
        .text
    )[:-1]
    # with include_usage every chunk has "usage": null but the last (OpenAI's stream_options documentation)
    assert [json.loads(c)["usage"] for c in raw_chunks][:-1] == [None] * (len(raw_chunks) - 1)
    assert len({c.id for c in got}) == 1 and got[0].choices[0].delta.role == "assistant"
    assert got[-2].choices[0].finish_reason == "stop"
    assert got[-1].choices == [] and got[-1].usage.total_tokens == 9
    final = accumulated(got)
    assert final.choices[0].message.content == "Hello\nworld"


def test_a_call_the_server_ran_is_a_tool_call_with_its_output():
    reply, raw = completion(TOOL_TURN)
    message = raw["choices"][0]["message"]
    assert message == {
        "role": "assistant",
        "content": "Let me. #### 6",
        "tool_calls": [{"id": "call_a", "type": "function",
                        "function": {"name": "calculator", "arguments": '{"expression": "2*3"}'},
                        "raychat": {"offset": 8, "output": "6"}}],
    }  # fmt: skip
    call = reply.choices[0].message.tool_calls[0]
    assert call.function.name == "calculator" and json.loads(call.function.arguments) == {"expression": "2*3"}
    assert reply.choices[0].finish_reason == "stop"
    got, _ = chunks(TOOL_TURN)
    deltas = [c.choices[0].delta.model_dump(exclude_none=True) for c in got if c.choices]
    assert deltas[2]["tool_calls"] == [{"index": 0, **message["tool_calls"][0], "raychat": {"offset": 8}}]
    assert deltas[3]["tool_calls"] == [
        {"index": 0, "function": {"arguments": ""}, "raychat": {"output": "6"}}
    ]
    final = accumulated(got)
    assert final.choices[0].message.content == "Let me. #### 6"
    assert final.choices[0].message.tool_calls[0].function.arguments == '{"expression": "2*3"}'


def test_a_call_for_the_client_ends_the_message():
    tools = [{"type": "function", "function": {"name": "calculator"}}]
    reply, raw = completion(CLIENT_CALL, tools=tools)
    assert raw["choices"][0]["finish_reason"] == "tool_calls"
    assert raw["choices"][0]["message"]["content"] == "Let me. "
    assert raw["choices"][0]["message"]["tool_calls"][0] == {
        "id": "call_a", "type": "function", "function": {"name": "calculator", "arguments": '{"expression": "2*3"}'}
    }  # fmt: skip
    only_call, raw = completion(CLIENT_CALL[1:], tools=tools)
    assert raw["choices"][0]["message"]["content"] is None  # OpenAI's null content next to tool calls
    final = accumulated(chunks(CLIENT_CALL, tools=tools)[0])
    assert final.choices[0].finish_reason == "tool_calls"
    assert final.choices[0].message.tool_calls[0].id == "call_a"


def test_the_returned_message_sent_back_is_the_turn_the_engine_generated():
    """`messages.append(reply.choices[0].message)` (as model_dump, nulls and all): the engine receives the
    template's parts in generation order."""
    reply, _ = completion(TOOL_TURN)
    history = [*USER, reply.choices[0].message.model_dump(), {"role": "user", "content": "And 1+1?"}]
    fake = FakeEngine(HELLO)
    assert TestClient(create_app(fake)).post(V1, json={"messages": history}).status_code == 200
    assert fake.requests[0]["messages"][1] == {"role": "assistant", "content": [
        {"type": "text", "text": "Let me. "}, {"type": "python", "text": "2*3"},
        {"type": "python_output", "text": "6"}, {"type": "text", "text": "#### 6"}]}  # fmt: skip


def test_n_choices_stream_side_by_side():
    def script(request):  # each choice's text names its seed; choice 0 (seed 1) reused 16 prompt tokens
        text = f"seed {request['seed']}"
        usage = {**USAGE, "completion_tokens": 2, "cached_tokens": 16 if request["seed"] == 1 else 0}
        return [{"type": "delta", "text": text, "tokens": 2, "logprobs": None},
                {"type": "done", "finish_reason": "stop", "usage": usage}]  # fmt: skip

    reply, raw = completion(script, n=3, seed=1)
    fake_seeds = [c.message.content for c in reply.choices]
    assert [c.index for c in reply.choices] == [0, 1, 2] and fake_seeds[0] == "seed 1"
    assert len(set(fake_seeds)) == 3
    # the prompt once (choice 0's, with its cached tokens), the completions summed
    details = {"cached_tokens": 16}
    assert raw["usage"] == {"prompt_tokens": 5, "completion_tokens": 6, "total_tokens": 11, "prompt_tokens_details": details}  # fmt: skip
    got, fake = chunks(script, n=3, seed=1, stream_options={"include_usage": True})
    assert len(fake.requests) == 3 and fake.closed == 3
    final = accumulated(got)
    assert [c.message.content for c in final.choices] == fake_seeds
    assert {c.choices[0].index for c in got if c.choices} == {0, 1, 2}
    assert got[-1].usage.completion_tokens == 6 and got[-1].usage.prompt_tokens_details.cached_tokens == 16


def test_logprobs_reach_the_choice_and_the_chunks():
    entry = {"token": "Hi", "bytes": [72, 105], "logprob": -0.25,
             "top_logprobs": [{"token": "Hi", "bytes": [72, 105], "logprob": -0.25}]}  # fmt: skip
    script = [{"type": "delta", "text": "Hi", "tokens": 1, "logprobs": [entry]},
              {"type": "done", "finish_reason": "length", "usage": USAGE}]  # fmt: skip
    reply, raw = completion(script, logprobs=True, top_logprobs=1)
    assert raw["choices"][0]["logprobs"] == {"content": [entry], "refusal": None}
    assert reply.choices[0].logprobs.content[0].top_logprobs[0].logprob == -0.25
    got, fake = chunks(script, logprobs=True, top_logprobs=1)
    assert fake.requests[0]["logprobs"] is True and fake.requests[0]["top_logprobs"] == 1
    content = [c for c in got if c.choices and c.choices[0].delta.content]
    assert content[0].choices[0].logprobs.content[0].token == "Hi"


def test_engine_logprobs_become_openai_entries_for_text_tokens_only():
    """The adapter over the engine's per-token logprobs (raychat.serve.engine_adapter): text tokens only (None
    for the others), token text and raw bytes, -inf as OpenAI's -9999.0."""
    import math
    from types import SimpleNamespace

    from support.engine_fixtures import byte_tokenizer

    tok = byte_tokenizer()
    euro = "€".encode()
    entry = lambda lp, top: SimpleNamespace(logprob=lp, top_logprobs=top)  # noqa: E731
    event = SimpleNamespace(
        token_ids=[ord("H"), tok.special_id("<|python_start|>"), euro[0]],
        logprobs=[entry(-0.5, [(ord("H"), -0.5), (ord("h"), -math.inf)]), entry(-1.0, []), entry(-2.0, [(euro[0], -2.0)])],
    )  # fmt: skip
    out = text_logprobs(tok, event, ["text", "marker", "text"])
    assert out == [
        {"token": "H", "bytes": [72], "logprob": -0.5,
         "top_logprobs": [{"token": "H", "bytes": [72], "logprob": -0.5}, {"token": "h", "bytes": [104], "logprob": MIN_LOGPROB}]},
        None,
        {"token": "\ufffd", "bytes": [0xE2], "logprob": -2.0, "top_logprobs": [{"token": "\ufffd", "bytes": [0xE2], "logprob": -2.0}]},
    ]  # fmt: skip
    assert text_logprobs(tok, SimpleNamespace(token_ids=[72], logprobs=None), ["text"]) == []


def test_logprob_gate_releases_an_entry_with_the_text_its_token_starts():
    """Characters as the engine releases them: "€" split over 3 byte tokens starts at character 1 with its
    first byte (which shows nothing yet); the request ends with "b" held back (a stop string): dropped."""
    from support.engine_fixtures import byte_tokenizer

    gate = LogprobGate(byte_tokenizer())
    euro = list("€".encode())
    assert gate.push([ord("a"), euro[0]], ["a", "e0"], "a", final=False) == ["a"]
    assert gate.push(euro[1:], ["e1", "e2"], "", final=False) == []
    assert gate.push([ord("b"), ord("c")], ["b", None], "€", final=True) == ["e0", "e1", "e2"]


def test_logprobs_request_against_this_engine():
    """A logprobs request asks the engine's SamplingParams for them; max_tokens None is the row's max_len."""

    request = {"logprobs": True, "top_logprobs": 3, "max_tokens": None, "client_tools": True, "stop": ["x"]}
    params = sampling_params(request, max_len=64)
    assert (params.logprobs, params.top_logprobs, params.max_tokens) == (True, 3, 64)
    params = sampling_params({**request, "logprobs": False}, max_len=64)
    assert params.stop == ("x", "<|python_end|>") and params.max_tokens == 64 and params.temperature == 1.0
    assert sampling_params({"stop": "xyz"}, max_len=64).stop == ("xyz",)  # one stop string, not x, y and z
    assert sampling_params({"stop": None}, max_len=64).stop == ()
