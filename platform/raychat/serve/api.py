"""Request models and limits of the chat endpoints, with errors that name the offending field.

Limits (a request outside any of them is answered 400, body {"error": {"message", "type", "param"}}, where
`param` and the start of `message` name the field, e.g. "messages[3].content"):
  messages             1..500 items
  messages[i].role     one of ROLES
  messages[i].content  a string of 1..8000 characters
  all contents         at most 32000 characters in total
  temperature          0..2 (0 = greedy)                 top_k   integer 0..200 (0 = off)
  top_p                (0, 1]  (1 = off)                   max_tokens  integer 1..4096
  seed                 integer 0..2**63-1                  stop    a string or a list of 1..4 strings of
  n                    1 (one choice per request)                  1..64 characters
Numbers are strict: "0.5" (a string) or true is a wrong type, not a number; integers are accepted for
floats. Unknown fields are ignored (OpenAI clients send extras such as "user").

Body size: MAX_BODY_BYTES = 512 KiB, refused with 413 before JSON parsing. Bound on a valid body: 32000
characters written as JSON \\u escapes of UTF-16 surrogate pairs take 6 bytes per UTF-16 unit, at most
12 bytes per character = 384000 bytes, plus field names and punctuation of 500 messages (< 40 kB).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StrictBool,
    StrictFloat,
    StrictInt,
    StrictStr,
    field_validator,
)

ROLES = ("system", "user", "assistant")
MAX_MESSAGES = 500
MAX_CONTENT_CHARS = 8000
MAX_TOTAL_CHARS = 32000
MAX_TOKENS = 4096
MAX_TOP_K = 200
MAX_TEMPERATURE = 2.0
MAX_STOP = 4
MAX_STOP_CHARS = 64
MAX_BODY_BYTES = 512 * 1024

Number = StrictFloat | StrictInt


class Message(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: Literal["system", "user", "assistant"]
    content: Annotated[StrictStr, Field(min_length=1, max_length=MAX_CONTENT_CHARS)]


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")

    include_usage: StrictBool = False


class ChatRequest(BaseModel):
    """Body of POST /chat/completions and POST /v1/chat/completions (see the module doc for the limits)."""

    model_config = ConfigDict(extra="ignore")

    messages: Annotated[list[Message], Field(min_length=1, max_length=MAX_MESSAGES)]
    model: StrictStr | None = None
    temperature: Annotated[Number, Field(ge=0.0, le=MAX_TEMPERATURE)] = 1.0
    top_k: Annotated[StrictInt, Field(ge=0, le=MAX_TOP_K)] | None = None
    top_p: Annotated[Number, Field(gt=0.0, le=1.0)] | None = None
    max_tokens: Annotated[StrictInt, Field(ge=1, le=MAX_TOKENS)] = 256
    seed: Annotated[StrictInt, Field(ge=0, le=2**63 - 1)] | None = None
    stop: Any = None
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    n: StrictInt | None = None

    @field_validator("n")
    @classmethod
    def _one_choice(cls, n: int | None) -> int | None:
        if n not in (None, 1):
            raise ValueError(f"only 1 choice per request is supported, got {n}")
        return n

    @field_validator("messages")
    @classmethod
    def _total_chars(cls, messages: list[Message]) -> list[Message]:
        total = sum(len(m.content) for m in messages)
        if total > MAX_TOTAL_CHARS:
            raise ValueError(f"total content is {total} characters; at most {MAX_TOTAL_CHARS} allowed")
        return messages

    @field_validator("stop")
    @classmethod
    def _stop(cls, stop: Any) -> list[str] | None:
        if stop is None:
            return None
        items = [stop] if isinstance(stop, str) else stop
        if not isinstance(items, list) or not all(isinstance(s, str) for s in items):
            raise ValueError("must be a string or a list of strings")
        if not 1 <= len(items) <= MAX_STOP:
            raise ValueError(f"must hold 1 to {MAX_STOP} strings, got {len(items)}")
        for s in items:
            if not 1 <= len(s) <= MAX_STOP_CHARS:
                raise ValueError(f"each stop string must have 1 to {MAX_STOP_CHARS} characters, got {len(s)}")
        return items

    def stop_list(self) -> list[str]:
        return list(self.stop or [])

    def to_engine(self) -> dict:
        """The plain dict sent to an engine replica: messages as dicts plus the sampling parameters."""
        return {
            "messages": [{"role": m.role, "content": m.content} for m in self.messages],
            "temperature": float(self.temperature),
            "top_k": self.top_k or None,
            "top_p": None if self.top_p is None else float(self.top_p),
            "max_tokens": self.max_tokens,
            "seed": self.seed,
            "stop": self.stop_list(),
        }


def field_path(loc: tuple[Any, ...] | list[Any]) -> str:
    """("body", "messages", 3, "content") -> "messages[3].content" (the "body" prefix and union tags dropped)."""
    out = ""
    for part in loc:
        if part == "body" and not out:
            continue
        if isinstance(part, int):
            out += f"[{part}]"
        elif isinstance(part, str) and (
            part.startswith(("function-", "list[", "constrained-")) or part in _TYPE_TAGS
        ):
            continue  # pydantic's names of union members, not fields
        else:
            out += f".{part}" if out else str(part)
    return out or "body"


_TYPE_TAGS = {"str", "int", "float", "bool", "list", "dict", "none"}


def error_body(message: str, param: str | None = None, kind: str = "invalid_request_error") -> dict:
    """OpenAI-style error body {"error": {"message", "type", "param", "code"}}."""
    return {"error": {"message": message, "type": kind, "param": param, "code": None}}


def validation_error_body(errors: list[dict]) -> dict:
    """400 body from pydantic/FastAPI errors: the first error, "field: reason", plus every error listed."""
    first = errors[0]
    param = field_path(first.get("loc", ()))
    if first.get("type") == "json_invalid":
        param = "body"
    msg = first.get("msg", "invalid value").removeprefix("Value error, ")
    if first.get("type") == "missing":
        msg = "field required"
    body = error_body(f"{param}: {msg}", param)
    body["error"]["details"] = [
        f"{field_path(e.get('loc', ()))}: {e.get('msg', '').removeprefix('Value error, ')}" for e in errors
    ]
    return body
