"""Server-sent events framing (WHATWG HTML "Server-sent events": `data: <line>\\n` per line, a blank line ends
an event) and the two event vocabularies the endpoints stream.

raychat's POST /chat/completions (one JSON object per event):
  {"type": "delta", "text": str}                                       a piece of the reply (never empty)
  {"type": "done", "finish_reason": "stop"|"length", "usage": USAGE}   always the last event of a success
  {"type": "error", "message": str}                                    last event when generation failed
  USAGE = {"prompt_tokens", "completion_tokens", "total_tokens", "ttft_s"}

OpenAI's POST /v1/chat/completions with stream=true ("chat.completion.chunk" objects, then `data: [DONE]`).
"""

from __future__ import annotations

import json
import time

# Characters that str.splitlines() (and so httpx's aiter_lines and other line readers) treats as line ends
# although SSE does not; JSON leaves them unescaped with ensure_ascii=False, so escape them by hand.
_LINE_BREAKS = str.maketrans({"\x85": "\\u0085", "\u2028": "\\u2028", "\u2029": "\\u2029"})


def sse_event(data: dict | str) -> bytes:
    """One SSE event whose data is `data` (a dict is JSON-encoded on one line, UTF-8, with U+0085, U+2028 and
    U+2029 escaped so that clients splitting lines like str.splitlines still see one line)."""
    if isinstance(data, str):
        text = data
    else:
        text = json.dumps(data, ensure_ascii=False, separators=(",", ":")).translate(_LINE_BREAKS)
    return "".join(f"data: {line}\n" for line in text.split("\n")).encode() + b"\n"


def parse_sse(body: str) -> list[str]:
    """The data of every event in an SSE body (multi-line data joined with "\\n"); used by tests and clients."""
    events, lines = [], []
    for line in body.split("\n"):
        if line == "":
            if lines:
                events.append("\n".join(lines))
                lines = []
        elif line.startswith("data:"):
            lines.append(line[5:].removeprefix(" "))
    if lines:
        events.append("\n".join(lines))
    return events


def usage_dict(prompt_tokens: int, completion_tokens: int, ttft_s: float | None = None) -> dict:
    out = {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }
    if ttft_s is not None:
        out["ttft_s"] = round(ttft_s, 6)
    return out


class OpenAIChunks:
    """Builds the "chat.completion.chunk" objects of one streamed OpenAI response (same id and created)."""

    def __init__(self, completion_id: str, model: str):
        self.id, self.model, self.created = completion_id, model, int(time.time())

    def _chunk(self, choices: list, **extra) -> dict:
        return {
            "id": self.id,
            "object": "chat.completion.chunk",
            "created": self.created,
            "model": self.model,
            "choices": choices,
            **extra,
        }

    def role(self) -> dict:
        return self._chunk(
            [{"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}]
        )

    def content(self, text: str) -> dict:
        return self._chunk([{"index": 0, "delta": {"content": text}, "finish_reason": None}])

    def finish(self, finish_reason: str) -> dict:
        return self._chunk([{"index": 0, "delta": {}, "finish_reason": finish_reason}])

    def usage(self, usage: dict) -> dict:
        return self._chunk([], usage=usage)


def openai_completion(completion_id: str, model: str, text: str, finish_reason: str, usage: dict) -> dict:
    """A non-streamed OpenAI "chat.completion" object."""
    return {
        "id": completion_id,
        "object": "chat.completion",
        "created": int(time.time()),
        "model": model,
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": text},
                "finish_reason": finish_reason,
                "logprobs": None,
            }
        ],
        "usage": usage,
    }
