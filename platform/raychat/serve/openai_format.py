"""OpenAI Chat Completions responses built from ChatServer events: "chat.completion" objects (stream false)
and "chat.completion.chunk" objects (stream true). The shapes are openai's own types (the tests validate
every object with openai.types.chat.ChatCompletion / ChatCompletionChunk); raychat adds one field, "raychat",
to a tool call the server ran itself (docs/openai.md):

  {"id": "call_...", "type": "function",
   "function": {"name": "calculator", "arguments": "{\\"expression\\": \\"47 * 12\\"}"},
   "raychat": {"offset": 19, "output": "564"}}     offset: characters of the message's content before the
                                                     call; output: the calculator's result (absent when
                                                     it refused the expression)
A call for the client to run (the request declared the calculator in `tools`) has no "raychat" field and
ends the message (finish_reason "tool_calls").

Streamed, a server-run call is two tool_calls deltas of the same index: the call when it is closed
(id, function, "raychat": {"offset"}), then its result ({"function": {"arguments": ""}, "raychat": {"output"}}).
"""

from __future__ import annotations

import json
import time
import uuid

from raychat.serve.api import CALCULATOR

USAGE_KEYS = ("prompt_tokens", "completion_tokens", "total_tokens")


def completion_id() -> str:
    return f"chatcmpl-{uuid.uuid4().hex}"


def calculator_call(call_id: str, expression: str, offset: int | None) -> dict:
    """An OpenAI tool call of the calculator; offset (a server-run call) adds the "raychat" field."""
    call = {
        "id": call_id,
        "type": "function",
        "function": {"name": CALCULATOR, "arguments": json.dumps({"expression": expression})},
    }
    if offset is not None:
        call["raychat"] = {"offset": offset}
    return call


class ChoiceState:
    """One choice's reply, built event by event: `add` returns the chunk deltas of each event (streaming)
    and `choice()` the finished choice (non-streaming).

    Args:
        index: the choice's index (0..n-1).
        client_tools: calls are the client's to run (no "raychat" field, finish_reason "tool_calls").
        logprobs: the request asked for logprobs (choices carry {"content": [...]}, else null).
    """

    def __init__(self, index: int, client_tools: bool, logprobs: bool):
        self.index, self.client_tools, self.want_logprobs = index, client_tools, logprobs
        self.content: list[str] = []
        self.length = 0  # characters of content so far (a server-run call's offset)
        self.tool_calls: list[dict] = []
        self.logprobs: list[dict] = []
        self.finish_reason: str | None = None
        self.usage: dict | None = None

    def add(self, event: dict) -> list[tuple[dict, list | None]]:
        """Record a ChatServer event; returns [(delta, logprobs content or None), ...] for its chunks."""
        kind = event["type"]
        if kind == "delta":
            text, lps = event["text"], event.get("logprobs") or []
            self.content.append(text)
            self.length += len(text)
            self.logprobs += lps
            return [({"content": text}, lps if self.want_logprobs else None)] if text or lps else []
        if kind == "tool_call":
            offset = None if self.client_tools else self.length
            call = calculator_call(event["id"], event["expression"], offset)
            self.tool_calls.append(call)
            return [({"tool_calls": [{"index": len(self.tool_calls) - 1, **call}]}, None)]
        if kind == "tool_result":
            if not self.tool_calls or "raychat" not in self.tool_calls[-1]:
                return []
            self.tool_calls[-1]["raychat"]["output"] = event["output"]
            k = len(self.tool_calls) - 1
            # "function" with empty arguments: openai's stream accumulators expect it in every delta
            result = {"index": k, "function": {"arguments": ""}, "raychat": {"output": event["output"]}}
            return [({"tool_calls": [result]}, None)]
        if kind == "done":
            self.finish_reason, self.usage = event["finish_reason"], event["usage"]
        return []

    def message(self) -> dict:
        text = "".join(self.content)
        message = {"role": "assistant", "content": text if text or not self.tool_calls else None}
        if self.tool_calls:
            message["tool_calls"] = self.tool_calls
        return message

    def choice(self) -> dict:
        return {
            "index": self.index,
            "message": self.message(),
            "logprobs": {"content": self.logprobs, "refusal": None} if self.want_logprobs else None,
            "finish_reason": self.finish_reason,
        }


def total_usage(states: list[ChoiceState]) -> dict:
    """OpenAI usage of n choices (openai.types.CompletionUsage): the prompt once, the completions summed;
    prompt_tokens_details.cached_tokens: the prompt tokens choice 0 reused from the engine's prefix cache
    (its USAGE's cached_tokens; 0 when the engine reports none)."""
    prompt = states[0].usage["prompt_tokens"]
    completion = sum(s.usage["completion_tokens"] for s in states)
    details = {"cached_tokens": states[0].usage.get("cached_tokens", 0)}
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": details}  # fmt: skip


def chat_completion(cid: str, model: str, states: list[ChoiceState]) -> dict:
    """The non-streamed "chat.completion" object of finished choices."""
    return {
        "id": cid,
        "object": "chat.completion",
        "created": int(time.time()),
        "model": model,
        "choices": [s.choice() for s in states],
        "usage": total_usage(states),
    }


class Chunks:
    """The "chat.completion.chunk" objects of one streamed response (same id and created); with
    include_usage (stream_options.include_usage), every chunk before the usage chunk has "usage": null, as
    OpenAI's."""

    def __init__(self, cid: str, model: str, include_usage: bool = False):
        self.id, self.model, self.created = cid, model, int(time.time())
        self.include_usage = include_usage

    def chunk(self, choices: list[dict], **extra) -> dict:
        return {
            "id": self.id,
            "object": "chat.completion.chunk",
            "created": self.created,
            "model": self.model,
            "choices": choices,
            **({"usage": None} if self.include_usage else {}),
            **extra,
        }

    def delta(self, index: int, delta: dict, logprobs: list | None = None, finish: str | None = None) -> dict:
        lp = None if logprobs is None else {"content": logprobs, "refusal": None}
        return self.chunk([{"index": index, "delta": delta, "logprobs": lp, "finish_reason": finish}])

    def role(self, index: int) -> dict:
        return self.delta(index, {"role": "assistant", "content": ""})

    def finish(self, index: int, finish_reason: str) -> dict:
        return self.delta(index, {}, None, finish_reason)

    def usage(self, usage: dict) -> dict:
        return self.chunk([], usage=usage)
