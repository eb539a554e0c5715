"""The error shape of every non-2xx answer (OpenAI's): {"error": {"message", "type", "param", "code"}}, where
`param` and the start of `message` name the offending field, e.g. "messages[3].content: ...".

Types: invalid_request_error (400, 404, 405, 413, 415), authentication_error (401), server_error (500, 503).
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel


class EngineUnavailableError(RuntimeError):
    """Raised by an engine client when no replica can take the request now (503, Retry-After)."""


class ParamError(ValueError):
    """A request the engine cannot serve, blamed on one field (`param`): answered 400."""

    def __init__(self, param: str | None, message: str):
        super().__init__(message)
        self.param = param


def error_body(message: str, param: str | None = None, kind: str = "invalid_request_error") -> dict:
    """OpenAI-style error body {"error": {"message", "type", "param", "code"}}."""
    return {"error": {"message": message, "type": kind, "param": param, "code": None}}


def field_path(loc: tuple[Any, ...] | list[Any]) -> str:
    """("body", "messages", 3, "content") -> "messages[3].content" (the "body" prefix and union tags dropped)."""
    out = ""
    for part in loc:
        if part == "body" and not out:
            continue
        if isinstance(part, int):
            out += f"[{part}]"
        elif isinstance(part, str) and (
            part.startswith(("function-", "list[", "constrained-", "literal[")) or part in _TYPE_TAGS
        ):
            continue  # pydantic's names of union members, not fields
        else:
            out += f".{part}" if out else str(part)
    return out or "body"


_TYPE_TAGS = {"str", "int", "float", "bool", "list", "dict", "none", "TextPart", "StrictStr"}
_MESSAGES = {
    "missing": "field required",
    "extra_forbidden": "unknown field (not part of the OpenAI Chat Completions request)",
}


def _reason(error: dict) -> str:
    if error.get("type") in _MESSAGES:
        return _MESSAGES[error["type"]]
    return error.get("msg", "invalid value").removeprefix("Value error, ")


def validation_error_body(errors: list[dict]) -> dict:
    """400 body from pydantic/FastAPI errors: the first error, "field: reason", plus every error listed."""
    first = errors[0]
    param = "body" if first.get("type") == "json_invalid" else field_path(first.get("loc", ()))
    body = error_body(f"{param}: {_reason(first)}", param)
    body["error"]["details"] = [f"{field_path(e.get('loc', ()))}: {_reason(e)}" for e in errors]
    return body


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None
    code: str | None
    details: list[str] | None = None


class ErrorResponse(BaseModel):
    """The schema of every error body (/openapi.json documents it for each error status)."""

    error: ErrorDetail


ERROR_STATUSES = {
    400: "invalid request (the field is named in error.param and at the start of error.message)",
    401: "missing or invalid bearer token (when the server has an API key)",
    404: "model not served here",
    413: "request body too large",
    500: "engine failure",
    503: "engine unavailable (restarting, or no replica can take the request): retry after Retry-After",
}
