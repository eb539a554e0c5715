"""OpenAI legacy Completions responses built from the events of raychat.serve.completion_server:
"text_completion" objects, whole (stream false) or as chunks (stream true, then `data: [DONE]`). The shapes
are openai's own types (the tests validate every object with openai.types.Completion).

A choice's `logprobs` (when the request set logprobs) is {"tokens", "token_logprobs", "top_logprobs",
"text_offset"}: one entry per token of the choice's text (the prompt's tokens first when echo), text_offset
= the sum of the lengths of the previous tokens' strings (vLLM's rule). That is the token's position in the
choice's text while every token decodes to whole characters; after a character whose UTF-8 bytes span two
tokens (each token's string then holds U+FFFD, and the text the character once) it is past that position.
"""

from __future__ import annotations

import time
import uuid


def completion_id() -> str:
    return f"cmpl-{uuid.uuid4().hex}"


class CompletionState:
    """One choice (one prompt) built event by event: `add` returns the (text, logprobs) pieces of each event
    for the chunks (streaming) and `choice()` the finished choice (non-streaming).

    Args:
        index: the choice's index (= the prompt's index in the batch).
        logprobs: the request set logprobs (choices carry the logprobs object, else null).
    """

    def __init__(self, index: int, logprobs: bool):
        self.index, self.want_logprobs = index, logprobs
        self.text: list[str] = []
        self.tokens: list[str] = []
        self.token_logprobs: list[float | None] = []
        self.top_logprobs: list[dict | None] = []
        self.text_offset: list[int] = []
        self.offset = 0  # characters of the tokens so far
        self.finish_reason: str | None = None
        self.usage: dict | None = None

    def _logprobs(self, entries: list[dict]) -> dict:
        """The legacy logprobs object of `entries`, recorded for the whole choice too."""
        out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for e in entries:
            out["tokens"].append(e["token"])
            out["token_logprobs"].append(e["logprob"])
            out["top_logprobs"].append(e["top_logprobs"])
            out["text_offset"].append(self.offset)
            self.offset += len(e["token"])
        self.tokens += out["tokens"]
        self.token_logprobs += out["token_logprobs"]
        self.top_logprobs += out["top_logprobs"]
        self.text_offset += out["text_offset"]
        return out

    def add(self, event: dict) -> list[tuple[str, dict | None]]:
        """Record an event; returns [(text, logprobs object or None)] for its chunk (none for "done")."""
        if event["type"] in ("prompt", "delta"):
            self.text.append(event["text"])
            logprobs = self._logprobs(event.get("logprobs") or []) if self.want_logprobs else None
            return [(event["text"], logprobs)] if event["text"] or logprobs else []
        if event["type"] == "done":
            self.finish_reason, self.usage = event["finish_reason"], event["usage"]
        return []

    def choice(self) -> dict:
        logprobs = None
        if self.want_logprobs:
            logprobs = {"tokens": self.tokens, "token_logprobs": self.token_logprobs,
                        "top_logprobs": self.top_logprobs, "text_offset": self.text_offset}  # fmt: skip
        text = "".join(self.text)
        return {"index": self.index, "text": text, "logprobs": logprobs, "finish_reason": self.finish_reason}


def total_usage(states: list[CompletionState]) -> dict:
    """OpenAI usage of a batch (openai.types.CompletionUsage): prompt and completion tokens summed over its
    prompts; prompt_tokens_details.cached_tokens: the prompt tokens reused from the engine's prefix cache,
    summed (each USAGE's cached_tokens; 0 when the engine reports none)."""
    prompt = sum(s.usage["prompt_tokens"] for s in states)
    completion = sum(s.usage["completion_tokens"] for s in states)
    details = {"cached_tokens": sum(s.usage.get("cached_tokens", 0) for s in states)}
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": details}  # fmt: skip


def completion(cid: str, model: str, states: list[CompletionState]) -> dict:
    """The non-streamed "text_completion" object of finished choices."""
    return {
        "id": cid,
        "object": "text_completion",
        "created": int(time.time()),
        "model": model,
        "choices": [s.choice() for s in states],
        "usage": total_usage(states),
    }


class CompletionChunks:
    """The "text_completion" chunks of one streamed response (same id and created); with include_usage
    (stream_options.include_usage), every chunk before the usage chunk has "usage": null, as OpenAI's."""

    def __init__(self, cid: str, model: str, include_usage: bool = False):
        self.id, self.model, self.created = cid, model, int(time.time())
        self.include_usage = include_usage

    def chunk(self, choices: list[dict], **extra) -> dict:
        usage = {"usage": None} if self.include_usage else {}
        return {"id": self.id, "object": "text_completion", "created": self.created, "model": self.model,
                "choices": choices, **usage, **extra}  # fmt: skip

    def delta(self, index: int, text: str, logprobs: dict | None = None, finish: str | None = None) -> dict:
        return self.chunk([{"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish}])

    def finish(self, index: int, finish_reason: str) -> dict:
        return self.delta(index, "", None, finish_reason)

    def usage(self, usage: dict) -> dict:
        return self.chunk([], usage=usage)
