"""The error shape of every non-2xx answer (OpenAI's): {"error": {"message", "type", "param", "code"}}, where
`param` and the start of `message` name the offending field, e.g. "messages[3].content: ...".

Types: invalid_request_error (400, 404, 405, 413, 415), authentication_error (401), rate_limit_error (429:
overloaded, retry after Retry-After), server_error (500, 503, 504).
A 500 never carries internal exception text: its message is INTERNAL_ERROR and a request id (also in
error.request_id); the server logs the detail under that id.
"""

from __future__ import annotations

from typing import Any, get_args

from pydantic import BaseModel

from raychat.cli_parser import did_you_mean

INTERNAL_ERROR = "internal server error"
FIELDS_DOC = "docs/openai.md"  # where the fields each endpoint accepts are listed


class EngineUnavailableError(RuntimeError):
    """Raised by an engine client when no replica can take the request now (503, Retry-After)."""


class EngineOverloadedError(EngineUnavailableError):
    """Raised by an engine client when the replicas' queues are full (429, Retry-After: retry_after_s)."""

    def __init__(self, message: str, retry_after_s: int = 1):
        super().__init__(message)
        self.retry_after_s = retry_after_s


UNAVAILABLE_RETRY_AFTER_S = 5  # Retry-After of a 503 (an engine process restarting, no replica)
PUBLIC_5XX = (503, 504)  # 5xx whose message is raychat's own (unavailable, past the deadline), not internal


def error_type(status: int) -> str:
    """The OpenAI error `type` of an HTTP status (see the module doc)."""
    if status == 429:
        return "rate_limit_error"
    return "server_error" if status >= 500 else "invalid_request_error"


def error_headers(event: dict) -> dict | None:
    """Headers of an engine error event's answer: Retry-After (seconds) for 429 and 503; for 504 (past the
    request's deadline) `x-should-retry: false`, so the openai clients do not run it again."""
    status = event.get("status", 500)
    if status in (429, 503):
        return {"Retry-After": str(event.get("retry_after", UNAVAILABLE_RETRY_AFTER_S))}
    if status == 504:
        return {"x-should-retry": "false"}
    return None


class ContextLengthError(ValueError):
    """A prompt that leaves no room for a completion in a row of max_len tokens, or for the max_tokens asked:
    answered 400 with OpenAI's code "context_length_exceeded" (CODE); `param` the field to blame, when it is
    not the prompt (max_tokens or max_completion_tokens, as sent)."""

    CODE = "context_length_exceeded"

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


class ParamError(ValueError):
    """A request the engine cannot serve, blamed on one field (`param`): answered 400."""

    def __init__(self, param: str | None, message: str):
        super().__init__(message)
        self.param = param


def refusal(e: ValueError, param: str | None) -> dict:
    """The 400 error event (raychat.serve.server's vocabulary) of a request refused before the engine took it:
    `e`'s message and the field to blame: a ContextLengthError's own param, else `param`, with its code
    context_length_exceeded; a ParamError's param; any other ValueError's `param`."""
    if isinstance(e, ContextLengthError):
        return {"type": "error", "status": 400, "message": str(e), "param": e.param or param, "code": e.CODE}
    return {"type": "error", "status": 400, "message": str(e), "param": getattr(e, "param", param)}


def error_body(
    message: str,
    param: str | None = None,
    kind: str = "invalid_request_error",
    request_id: str | None = None,
    code: str | None = None,
) -> dict:
    """OpenAI-style error body {"error": {"message", "type", "param", "code"}}, plus "request_id" when given
    (a 500's id in the server log); `code` as OpenAI's where one applies (model_not_found,
    context_length_exceeded), else None."""
    body = {"error": {"message": message, "type": kind, "param": param, "code": code}}
    if request_id:
        body["error"]["request_id"] = request_id
    return body


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
_MESSAGES = {"missing": "field required"}


def _models_in(annotation) -> list[type[BaseModel]]:
    """The pydantic models a field's type holds (through Optional, unions, lists and Annotated)."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation]
    return [m for arg in get_args(annotation) for m in _models_in(arg)]


def _fields_around(model: type[BaseModel], loc: tuple | list) -> list[str]:
    """The fields of the (nested) model that holds the field at pydantic's `loc` ("body" first, then field
    names, list indices and union tags), given the request's model."""
    models = [model]
    for part in loc[1:-1] if loc[:1] == ("body",) else loc[:-1]:
        fields = [parent.model_fields[part] for parent in models if part in parent.model_fields]
        inner = [m for field in fields for m in _models_in(field.annotation)]
        models = inner or models  # an index or a union tag stays in the same model
    return [name for m in models for name in m.model_fields]


# The most fields in error a 400's `details` lists (validation_error_body).
MAX_DETAILS = 20


def unknown_field(name: str, accepted: list[str]) -> str:
    """The reason given for a field the request model does not have: the accepted field it misspells (the
    closest of `accepted` by cli_parser.did_you_mean), else that raychat does not support it and where the
    accepted fields are listed (FIELDS_DOC)."""
    close = did_you_mean(name, [a for a in accepted if a != name])
    if close:
        return f"unknown field; did you mean {close}?"
    return f"unknown field (raychat does not support it here; {FIELDS_DOC} lists the accepted fields)"


def _reason(error: dict, model: type[BaseModel] | None = None) -> str:
    if error.get("type") == "json_invalid":  # loc ("body", character offset), ctx {"error": json's message}
        loc, why = error.get("loc", ()), (error.get("ctx") or {}).get("error")
        where = f" at character {loc[1]}" if len(loc) > 1 else ""
        return f"invalid JSON{where}" + (f" ({why})" if why else "")
    if error.get("type") == "extra_forbidden":
        loc = tuple(error.get("loc", ()))
        return unknown_field(str(loc[-1]), _fields_around(model, loc) if model and loc else [])
    if error.get("type") in _MESSAGES:
        return _MESSAGES[error["type"]]
    return error.get("msg", "invalid value").removeprefix("Value error, ")


def validation_error_body(errors: list[dict], model: type[BaseModel] | None = None) -> dict:
    """400 body from pydantic/FastAPI errors: the first error, "field: reason", and `details`: one "field:
    reason" per field in error, in the order pydantic reports them (the first is the message). A field that
    failed every member of a union (a number that is neither float nor int) is listed once, with its first
    reason. An unknown field's reason (unknown_field) suggests the field of `model`, the request's body model
    (or of the nested model holding it), it misspells. At most MAX_DETAILS fields are listed, then one line
    "... and N more fields in error": a body of 24,000 unknown fields (under the body limit) is answered in
    0.1-0.3 s, not 3.9 s, so it does not hold up the replica's other requests (this runs on its event loop)."""
    first = errors[0]
    param = "body" if first.get("type") == "json_invalid" else field_path(first.get("loc", ()))
    body = error_body(f"{param}: {_reason(first, model)}", param)
    details: dict[str, str | None] = {}
    for e in errors:
        field = "body" if e.get("type") == "json_invalid" else field_path(e.get("loc", ()))
        if field not in details:
            details[field] = _reason(e, model) if len(details) < MAX_DETAILS else None
    listed = [f"{field}: {reason}" for field, reason in details.items() if reason is not None]
    if len(details) > len(listed):
        listed.append(f"... and {len(details) - len(listed)} more fields in error")
    body["error"]["details"] = listed
    return body


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None
    code: str | None
    details: list[str] | None = None
    request_id: str | None = None


class ErrorResponse(BaseModel):
    """The schema of every error body (/openapi.json documents it for each error status)."""

    error: ErrorDetail


ERROR_STATUSES = {
    400: "invalid request (the field is named in error.param and at the start of error.message)",
    401: "missing or invalid bearer token (when the server has an API key)",
    404: "model not served here",
    413: "request body too large",
    415: "request body not sent as application/json (its Content-Type)",
    429: "overloaded (the engine's or Serve's queue is full): retry after Retry-After",
    500: "engine failure: the message names only a request id (error.request_id); the detail is in the server log",
    503: "engine unavailable (restarting, or no replica can take the request): retry after Retry-After",
    504: "the request ran past its deadline (request_timeout_s)",
}
