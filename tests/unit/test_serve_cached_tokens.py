"""OpenAI usage reports the prefix cache: `usage.prompt_tokens_details.cached_tokens` of /v1/chat/completions
and /v1/completions (whole and in the streamed usage chunk) is the engine's Usage.cached_tokens, on the real
engine in-process (no Ray). The same prompt sent twice: the second reuses every whole 16-token block except
that the last prompt token is always recomputed, i.e. 16 * ((P - 1) // 16) of its P tokens
(engine/prefix_cache.py)."""

from __future__ import annotations

import json

import pytest
from fastapi.testclient import TestClient
from openai.types import Completion
from openai.types.chat import ChatCompletion, ChatCompletionChunk
from support.serve_helpers import tiny_model_and_tokenizer

from raychat.chat_template import render_for_completion
from raychat.serve.ingress import LocalClient, create_app
from raychat.serve.server import ChatServer
from raychat.serve.sse import parse_sse


@pytest.fixture(scope="module")
def served():
    model, tokenizer = tiny_model_and_tokenizer()
    engine = ChatServer(model, tokenizer, max_slots=2, model_id="tiny")  # prefix cache: "auto" (on)
    yield TestClient(create_app(LocalClient(engine))), tokenizer
    engine.shutdown()


def last_chunk(client, url, body):
    resp = client.post(url, json={**body, "stream": True, "stream_options": {"include_usage": True}})
    events = parse_sse(resp.text)
    assert events[-1] == "[DONE]"
    return json.loads(events[-2])


def test_completions_report_the_reused_whole_blocks(served):
    client, _ = served
    ids48, ids50 = list(range(100, 148)), list(range(200, 250))  # token ids no other request sends
    body = {"max_tokens": 2, "temperature": 0}
    first = Completion.model_validate(client.post("/v1/completions", json={"prompt": ids48, **body}).json())
    assert first.usage.prompt_tokens == 48 and first.usage.prompt_tokens_details.cached_tokens == 0
    second = Completion.model_validate(client.post("/v1/completions", json={"prompt": ids48, **body}).json())
    # 48 tokens = 3 whole blocks, but the last token is recomputed: (48 - 1) // 16 = 2 blocks = 32 tokens
    assert second.usage.prompt_tokens_details.cached_tokens == 32
    client.post("/v1/completions", json={"prompt": ids50, **body})
    # a batch sums its prompts: 32 + (50 - 1) // 16 * 16 = 32 + 48
    both = client.post("/v1/completions", json={"prompt": [ids48, ids50], **body}).json()
    assert both["usage"]["prompt_tokens_details"] == {"cached_tokens": 80}
    chunk = last_chunk(client, "/v1/completions", {"prompt": ids50, **body})
    assert chunk["choices"] == [] and chunk["usage"]["prompt_tokens_details"] == {"cached_tokens": 48}


def test_chat_completions_report_the_reused_whole_blocks(served):
    client, tokenizer = served
    messages = [{"role": "system", "content": "You answer in one short line. " * 6},
                {"role": "user", "content": "What is the capital of France?"}]  # fmt: skip
    p = len(render_for_completion(tokenizer, messages))  # the prompt the server renders
    assert p > 32
    body = {"messages": messages, "max_completion_tokens": 2, "temperature": 0}
    first = ChatCompletion.model_validate(client.post("/v1/chat/completions", json=body).json())
    assert first.usage.prompt_tokens == p and first.usage.prompt_tokens_details.cached_tokens == 0
    second = ChatCompletion.model_validate(client.post("/v1/chat/completions", json=body).json())
    assert second.usage.prompt_tokens_details.cached_tokens == (p - 1) // 16 * 16
    chunk = ChatCompletionChunk.model_validate(last_chunk(client, "/v1/chat/completions", body))
    assert chunk.choices == [] and chunk.usage.prompt_tokens_details.cached_tokens == (p - 1) // 16 * 16
