"""Server-sent events framing (WHATWG HTML "Server-sent events": `data: <line>\\n` per line, a blank line ends
an event) and the two event vocabularies the endpoints stream.

raychat's POST /chat/completions, always streamed (one JSON object per event; `index` is the choice, 0..n-1):
  {"type": "delta", "index": int, "text": str}         a piece of the visible reply (never empty); with
                                                        "logprobs": [...] of its tokens when the request set
                                                        logprobs (OpenAI's ChatCompletionTokenLogprob dicts)
  {"type": "tool_call", "index": int, "id": str, "name": "calculator", "expression": str}
  {"type": "tool_result", "index": int, "id": str, "output": str}      the calculator's output for that call
  {"type": "done", "index": int, "finish_reason": "stop"|"length"|"tool_calls", "usage": USAGE}
                                                        last event of each choice
  {"type": "error", "index": int, "message": str}      last event when generation failed (of choice index)
  USAGE = {"prompt_tokens", "completion_tokens", "total_tokens", "ttft_s", "cached_tokens"}
                 cached_tokens: prompt tokens whose keys/values came from the engine's prefix cache

OpenAI's POST /v1/chat/completions with stream=true: "chat.completion.chunk" objects, then `data: [DONE]`
(raychat.serve.openai_format).
"""

from __future__ import annotations

import json

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


def usage_dict(
    prompt_tokens: int, completion_tokens: int, ttft_s: float | None = None, cached_tokens: int = 0
) -> dict:
    """USAGE of a finished request (token counts; ttft_s in seconds, rounded to 1 us, absent when None;
    cached_tokens: prompt tokens served by the prefix cache, engine.stream.Usage.cached_tokens)."""
    out = {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }
    if ttft_s is not None:
        out["ttft_s"] = round(ttft_s, 6)
    out["cached_tokens"] = cached_tokens
    return out
