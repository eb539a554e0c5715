"""The HTTP front of the chat service: a FastAPI app over any engine client (a Ray Serve handle in
production, an in-process ChatServer or a fake in tests).

Endpoints
  POST /chat/completions     SSE (raychat.serve.sse vocabulary): text deltas, tool calls and results, then
                             a "done" event per choice with finish_reason and usage; always streamed
                             ("stream": false -> 400 naming stream and /v1/chat/completions)
  POST /v1/chat/completions  OpenAI Chat Completions, stream true or false (raychat.serve.api lists every
                             parameter; docs/openai.md the tool-call shapes)
  POST /v1/completions       OpenAI legacy Completions: raw prompt (text or token ids, batched), echo,
                             prompt logprobs, stream true or false (raychat.serve.completions_api)
  GET  /v1/models            the served model, with template_version, tokenizer_version and its context length
                             (max_seq_len, and vLLM's name for it, max_model_len); "created": when its
                             checkpoint was committed (the engine's info), else when this app started
  GET  /v1/models/{model}    that model's card (openai's models.retrieve); the id may hold "/"; another id
                             -> 404 model_not_found naming the id served
  GET  /health               {"status": "ok", template_version, ..., "engine": replica stats}; 503,
                             "unavailable" and a "reason" while the replica's engine process is down or no
                             replica answers (the engine client's stats() raising EngineUnavailableError: with
                             a Serve handle, none answered within health_timeout_s). With an api_key set, a
                             request without it gets only {"status": "ok" | "unavailable"}
  GET  /                     the chat web page (static/chat.html)
  GET  /openapi.json         the schema of all of it (what the fuzzing test drives)

Before any parsing: with `api_key` set, every path but OPEN_PATHS needs `Authorization: Bearer <api_key>`
-> else 401; a body over `max_body_bytes` -> 413. The path checked is the one the router matches:
scope["path"] with scope["root_path"] removed (Ray Serve keeps the full path in "path" and puts a route
prefix, or http_options.root_path, in "root_path"), so no prefix moves a route out of the check.
Invalid requests -> 400 naming the field. Every error, 4xx or 5xx, has the OpenAI error shape
(raychat.serve.errors): an engine rejection keeps its status (400, 503 with Retry-After while the engine
process restarts or no replica can take the request), an engine failure or any unexpected exception is a
500 whose body says only INTERNAL_ERROR and a request id (the detail is logged under that id); once a
stream has started, a failure is an error event in it. A client that disconnects mid-stream closes the
engine streams, which frees their rows.

Client protocol (duck-typed):
  async info() -> dict        {model_id, template_version, tokenizer_version, max_seq_len, created (Unix
                              seconds the served checkpoint was committed; absent or None: unknown), ...}
  async stats() -> dict       the replica's counters (ChatServer.stats); info() and stats() raise
                              EngineUnavailableError when no replica answers
  generate(request: dict)     async iterator of event dicts (raychat.serve.server); closing it early
                              (aclose) must cancel the request; raises EngineUnavailableError when no
                              replica can take it
  async check(requests) -> dict | None   the 400 error event of the first of `requests` an engine would
                              refuse before submitting it, else None; submits nothing (ChatServer.check).
                              Asked first when a request opens several engine requests (n > 1, a
                              completions batch), so one refused prompt fails the request before any of
                              its siblings reaches the engine
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import aclosing
from pathlib import Path

import anyio
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.utils import get_openapi
from fastapi.responses import HTMLResponse, JSONResponse, StreamingResponse
from openai.types import Completion, Model
from openai.types.chat import ChatCompletion
from starlette.exceptions import HTTPException as StarletteHTTPException

from raychat.serve.api import MAX_BODY_BYTES, ChatRequest
from raychat.serve.completions_api import CompletionRequest
from raychat.serve.completions_api import engine_requests as completion_requests
from raychat.serve.completions_format import CompletionChunks, CompletionState, completion
from raychat.serve.completions_format import completion_id as text_completion_id
from raychat.serve.completions_format import total_usage as completion_usage
from raychat.serve.errors import (
    ERROR_STATUSES,
    INTERNAL_ERROR,
    PUBLIC_5XX,
    UNAVAILABLE_RETRY_AFTER_S,
    EngineOverloadedError,
    EngineUnavailableError,
    ErrorResponse,
    ParamError,
    error_body,
    error_headers,
    error_type,
    validation_error_body,
)
from raychat.serve.openai_format import ChoiceState, Chunks, chat_completion, completion_id, total_usage
from raychat.serve.openai_messages import engine_requests
from raychat.serve.sse import sse_event

STATIC_DIR = Path(__file__).parent / "static"
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
METRICS_ELSEWHERE = (
    "Not Found: raychat's metrics are on each Ray node's Prometheus endpoint (its metrics export port), not on "
    "this port; `raychat serve` prints its replicas' nodes' as `metrics: http://HOST:PORT/metrics` (docs/deployment.md §5)"
)
# the only paths answered without the key when one is set ("" is the route prefix itself, e.g. /api)
OPEN_PATHS = frozenset({"", "/", "/health", "/openapi.json"})
NO_FINAL_EVENT = "the engine's stream ended without a final event"
NOT_STREAMED = (
    "stream: POST /chat/completions always streams (leave stream out or send true); POST "
    "/v1/chat/completions answers a non-streamed reply"
)
ENGINE_DOWN = "the engine process of the replica that answered is down"
SSE_SCHEMA = {"text/event-stream": {"schema": {"type": "string"}}}
ERRORS = {status: {"model": ErrorResponse, "description": why} for status, why in ERROR_STATUSES.items()}
log = logging.getLogger(__name__)


def route_path(scope: dict) -> str:
    """The path the app's router matches: scope["path"] less scope["root_path"] when it starts with it
    ("/api/v1/models" under root_path "/api" -> "/v1/models"; Starlette's own rule)."""
    path, root = scope["path"], scope.get("root_path", "")
    if root and (path == root or path.startswith(root + "/")):
        return path[len(root) :]
    return path


def bearer_ok(authorization: str | None, api_key: str) -> bool:
    """Whether an Authorization header value is "Bearer <api_key>" (scheme case-insensitive; constant-time
    comparison of the key)."""
    scheme, _, value = (authorization or "").partition(" ")
    return scheme.lower() == "bearer" and hmac.compare_digest(value.strip().encode(), api_key.encode())


class BodyLimitAndAuth:
    """ASGI middleware: 401 without the bearer token (when one is configured) on every path but OPEN_PATHS
    (compared after route_path), and 413 for a body over `max_body_bytes` (by Content-Length, or by counting a
    chunked body), both before the app parses JSON."""

    def __init__(self, app, max_body_bytes: int, api_key: str | None):
        self.app, self.max_body_bytes, self.api_key = app, max_body_bytes, api_key

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers", [])}
        if self.api_key and route_path(scope) not in OPEN_PATHS:
            if not bearer_ok(headers.get("authorization"), self.api_key):
                body = error_body(
                    "missing or invalid bearer token: send 'Authorization: Bearer <key>'",
                    None,
                    "authentication_error",
                )
                return await _send_json(send, 401, body, {"www-authenticate": "Bearer"})
        if scope["method"] not in ("POST", "PUT", "PATCH"):
            return await self.app(scope, receive, send)
        too_big = error_body(f"body: request body exceeds {self.max_body_bytes} bytes", "body")
        length = headers.get("content-length")
        if length is not None and length.isdigit() and int(length) > self.max_body_bytes:
            return await _send_json(send, 413, too_big)
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_body_bytes:
                return await _send_json(send, 413, too_big)
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        body, replayed = b"".join(chunks), False

        async def replay():
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()  # after the body: wait for http.disconnect

        return await self.app(scope, replay, send)


async def _send_json(send, status: int, body: dict, extra_headers: dict | None = None) -> None:
    data = json.dumps(body).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(data)).encode())]
    headers += [(k.encode(), v.encode()) for k, v in (extra_headers or {}).items()]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": data})


def _error_response(event: dict) -> JSONResponse:
    """An error event (after _public) as HTTP: "param: message" (the field first, as for validation errors);
    a 500 also carries its request id in the body and the X-Request-Id header."""
    param, message, status = event.get("param"), event["message"], event.get("status", 500)
    if param and not message.startswith(f"{param}: "):
        message = f"{param}: {message}"
    kind, headers = error_type(status), error_headers(event)
    if event.get("request_id"):
        headers = {"X-Request-Id": event["request_id"]}
    body = error_body(message, param, kind, event.get("request_id"), event.get("code"))
    return JSONResponse(body, status_code=status, headers=headers)


def _model_card(meta: dict, started: int) -> dict:
    """OpenAI's Model object of the served model (engine info `meta`), with raychat's template_version,
    tokenizer_version and max_seq_len (the context length in tokens), which vLLM's card calls max_model_len;
    created: the Unix time (int seconds) its checkpoint was committed (meta's "created"), else `started`."""
    created = meta.get("created")
    card = {"id": meta["model_id"], "object": "model", "created": started if created is None else created}
    card["owned_by"] = "raychat"
    card |= {k: meta.get(k) for k in ("template_version", "tokenizer_version", "max_seq_len")}
    return card | {"max_model_len": meta.get("max_seq_len")}


def _model_not_found(requested: str, served: str) -> JSONResponse:
    """404 (code model_not_found) for a request naming a model other than the one served."""
    err = error_body(
        f"model: {requested!r} is not served here; available: [{served!r}]", "model", code="model_not_found"
    )
    return JSONResponse(err, status_code=404)


def _internal_error(detail: str, exc: BaseException | None = None) -> dict:
    """A 500 error event that tells the client only INTERNAL_ERROR and a fresh request id ("req_" + 16 hex
    digits); `detail` (and the traceback of `exc`) go to the log under that id."""
    request_id = f"req_{uuid.uuid4().hex[:16]}"
    log.error("%s: %s", request_id, detail, exc_info=exc)
    message = f"{INTERNAL_ERROR} (request id {request_id}; the details are in the server log)"
    return {"type": "error", "status": 500, "message": message, "param": None, "request_id": request_id}


def _public(event: dict) -> dict:
    """An event as a client may see it: an error of status 500 (or any 5xx not in PUBLIC_5XX, whose messages
    are raychat's own) becomes _internal_error of its message; everything else is unchanged."""
    status = event.get("status", 500)
    if event["type"] != "error" or status < 500 or status in PUBLIC_5XX or event.get("request_id"):
        return event
    return _internal_error(event["message"])


def _exception_event(e: BaseException) -> dict:
    """An exception from the engine client as an error event: 503 when no replica can take the request,
    else a 500 that names only a request id (the exception is logged under it)."""
    if isinstance(e, EngineOverloadedError):
        return {"type": "error", "status": 429, "message": f"overloaded: {e}", "param": None,
                "retry_after": e.retry_after_s}  # fmt: skip
    if isinstance(e, EngineUnavailableError):
        return {"type": "error", "status": 503, "message": f"engine unavailable: {e}", "param": None}
    return _internal_error(f"engine request failed: {type(e).__name__}: {e}", e)


def _stream_error(event: dict) -> bytes:
    """An error event inside a started OpenAI stream (the openai clients raise APIError on it)."""
    kind = error_type(event.get("status", 500))
    return sse_event(
        error_body(event["message"], event.get("param"), kind, event.get("request_id"), event.get("code"))
    )


async def _open(engine, requests: list[dict]) -> tuple[list, list[dict]]:
    """Open one engine stream per request (the n choices, submitted together) and wait for each first event,
    so that a rejection becomes an HTTP error status instead of an event inside a 200 stream. Several requests
    are checked first, all of them in one engine.check, so that a refused one fails the whole request before
    any is submitted. Returns (streams, first events); when the check refuses, a first event is an error, or
    opening raises, every stream is closed and the result is ([], [that error])."""
    streams: list = []
    no_event = {"type": "error", "status": 500, "message": NO_FINAL_EVENT}
    try:
        refused = await engine.check(requests) if len(requests) > 1 else None
        if refused is not None:
            return [], [_public(refused)]
        streams = [engine.generate(request) for request in requests]
        firsts = await asyncio.gather(*(anext(s, no_event) for s in streams), return_exceptions=True)
    except Exception as e:  # noqa: BLE001 - generate() itself raised: answered in the error shape
        firsts = [e]
    except BaseException:  # cancelled (the client left): nothing to answer
        await _close(streams)
        raise
    for first in firsts:
        if isinstance(first, BaseException) and not isinstance(first, Exception):
            await _close(streams)
            raise first
    firsts = [_exception_event(f) if isinstance(f, Exception) else f for f in firsts]
    failed = [f for f in firsts if f["type"] == "error"]
    if failed:
        await _close(streams)
        return [], [_public(failed[0])]
    return streams, firsts


class EventStream(StreamingResponse):
    """The SSE response of a streamed request: closes its frames generator and then the engine `streams`
    however the response ends. Starlette never closes a body iterator, and a client that leaves while a frame
    is being sent cancels the send, not the generator, which would stay suspended at its yield with the engine
    requests running to max_tokens; a generator never started has no finally at all. The closing is shielded
    from the cancellation that ended the response."""

    def __init__(self, frames: AsyncIterator[bytes], streams: list):
        super().__init__(frames, media_type="text/event-stream", headers=SSE_HEADERS)
        self.streams = streams

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            with anyio.CancelScope(shield=True):
                await self.body_iterator.aclose()
                await _close(self.streams)


async def _close(streams: list) -> None:
    for s in streams:
        try:
            await s.aclose()
        except Exception:  # noqa: BLE001 - closing a failed stream must not hide the answer
            log.exception("closing an engine stream failed")


async def _collect(streams, firsts, states):
    """Feed every event of a non-streamed request to its choice's state (states[i].add); the error response
    of the first error event (the request fails whole), else None."""
    async with aclosing(_events(streams, firsts)) as events:
        async for i, ev in events:
            if ev["type"] == "error":
                return _error_response(ev)
            states[i].add(ev)
    return None


def _include_usage(body: ChatRequest | CompletionRequest) -> bool:
    return bool(body.stream_options and body.stream_options.include_usage)


async def _chunk_frames(streams, firsts, states, chunks, usage, opening=()) -> AsyncIterator[bytes]:
    """The SSE frames of a streamed OpenAI response: the `opening` chunks, then per event of choice i the
    chunks.delta of each (piece, logprobs) that states[i].add returns and chunks.finish on its final event;
    the chunks.usage of usage(states) when chunks.include_usage; "[DONE]". The first error event ends the
    stream with an error frame, no usage chunk, then "[DONE]"."""
    for chunk in opening:
        yield sse_event(chunk)
    failed = False
    async with aclosing(_events(streams, firsts)) as events:
        async for i, ev in events:
            if ev["type"] == "error":
                failed = True
                yield _stream_error(ev)
                break
            for piece, logprobs in states[i].add(ev):
                yield sse_event(chunks.delta(i, piece, logprobs))
            if ev["type"] == "done":
                yield sse_event(chunks.finish(i, ev["finish_reason"]))
    if chunks.include_usage and not failed:
        yield sse_event(chunks.usage(usage(states)))
    yield sse_event("[DONE]")


async def _events(streams: list, firsts: list[dict]) -> AsyncIterator[tuple[int, dict]]:
    """(choice index, event) of every stream, each stream's first event first, then as they come; ends with
    an error event if a stream fails (any exception) or ends without its final event. Closes every stream
    however the consumer stops (a disconnect cancels the requests)."""
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(i: int, stream) -> None:
        final = None
        try:
            async for ev in stream:
                if ev["type"] in ("done", "error"):
                    final = ev
                await queue.put((i, ev))
            if final is None:
                await queue.put((i, {"type": "error", "status": 500, "message": NO_FINAL_EVENT}))
        except Exception as e:  # noqa: BLE001 - becomes the stream's error event
            await queue.put((i, _exception_event(e)))
        await queue.put((i, None))

    tasks = []
    try:
        for i, first in enumerate(firsts):
            yield i, first
        open_streams = 0
        for i, (stream, first) in enumerate(zip(streams, firsts)):
            if first["type"] in ("done", "error"):
                continue
            tasks.append(asyncio.create_task(pump(i, stream)))
            open_streams += 1
        while open_streams:
            i, ev = await queue.get()
            if ev is None:
                open_streams -= 1
                continue
            yield i, _public(ev)
            if ev["type"] == "error":
                return
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await _close(streams)


def create_app(engine, api_key: str | None = None, max_body_bytes: int = MAX_BODY_BYTES) -> FastAPI:
    """The FastAPI app over `engine` (see the module doc); wrapped in BodyLimitAndAuth."""
    app = FastAPI(title="raychat", docs_url=None, redoc_url=None)
    app.add_middleware(BodyLimitAndAuth, max_body_bytes=max_body_bytes, api_key=api_key)
    app.openapi = lambda: _openapi(app)
    cache: dict = {}
    started = int(time.time())  # the card's "created" when the engine does not know its checkpoint's commit

    async def info() -> dict:
        if "info" not in cache:
            cache["info"] = await engine.info()
        return cache["info"]

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError):
        """400 naming the field (validation_error_body); 415 for a body FastAPI did not read as JSON because
        of its Content-Type (`curl -d` sends application/x-www-form-urlencoded)."""
        errors = list(exc.errors())
        media_type = request.headers.get("content-type", "").split(";")[0].strip().lower()
        if errors[0].get("loc") == ("body",) and not _is_json(media_type):
            got = repr(media_type) if media_type else "none"
            message = f"Content-Type: send the body as application/json, got {got}"
            return JSONResponse(error_body(message, None), status_code=415)
        body_field = getattr(request.scope.get("route"), "body_field", None)
        model = body_field.field_info.annotation if body_field is not None else None
        return JSONResponse(validation_error_body(errors, model), status_code=400)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException):
        """FastAPI's own errors (unknown path, bad method, a body that is not UTF-8) in the same shape; a 400
        is the body's, named first in the message; a 404 for /metrics (vLLM's place) says where they are."""
        param, message = (
            ("body", f"body: {_unreadable(exc)}") if exc.status_code == 400 else (None, exc.detail)
        )
        if exc.status_code == 404 and route_path(request.scope) == "/metrics":
            message = METRICS_ELSEWHERE
        return JSONResponse(error_body(str(message), param), status_code=exc.status_code, headers=exc.headers)

    @app.exception_handler(ParamError)
    async def _param_error(_request: Request, exc: ParamError):
        return _error_response({"status": 400, "message": str(exc), "param": exc.param})

    @app.exception_handler(EngineUnavailableError)
    async def _unavailable(_request: Request, exc: EngineUnavailableError):
        """The engine client's info()/stats() found the replicas overloaded (429) or gone (503)."""
        return _error_response(_exception_event(exc))

    @app.exception_handler(Exception)
    async def _unexpected(_request: Request, exc: Exception):
        """Anything else (an engine client raising before a response started, a bug): 500 or 503."""
        return _error_response(_exception_event(exc))

    def authorized(request: Request) -> bool:
        return not api_key or bearer_ok(request.headers.get("authorization"), api_key)

    @app.get("/", response_class=HTMLResponse)
    async def page():
        return HTMLResponse((STATIC_DIR / "chat.html").read_text())

    @app.get("/health")
    async def health(request: Request):
        """200 {"status": "ok"} or 503 {"status": "unavailable"} (with Retry-After); versions and replica
        stats, or the reason of a 503, only for a request with the key (or when no key is set). The replicas'
        queue being full is a 429 (EngineOverloadedError), as on every route."""
        full = authorized(request)
        try:
            stats = await engine.stats()
            up = stats.get("engine_running", True)
            body = {"status": "ok" if up else "unavailable"}
            if full:
                meta = await info()
                body.update({k: meta.get(k) for k in ("model_id", "template_version", "tokenizer_version")})
                body |= {"engine": stats} if up else {"reason": ENGINE_DOWN, "engine": stats}
        except EngineOverloadedError:
            raise
        except EngineUnavailableError as e:
            up, body = False, {"status": "unavailable"} | ({"reason": str(e)} if full else {})
        headers = None if up else {"Retry-After": str(UNAVAILABLE_RETRY_AFTER_S)}
        return JSONResponse(body, status_code=200 if up else 503, headers=headers)

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [_model_card(await info(), started)]}

    @app.get(
        "/v1/models/{model:path}",
        response_model=None,
        responses={200: {"model": Model}, 401: ERRORS[401], 404: ERRORS[404]},
    )
    async def retrieve_model(model: str):
        """The served model's card (as /v1/models lists it) when `model` is its id, else 404 model_not_found
        naming the id served. `model` may hold "/" (the default id is the checkpoint path); "" (the path
        /v1/models/) is the list."""
        if not model:
            return await models()
        meta = await info()
        if model != meta["model_id"]:
            return _model_not_found(model, meta["model_id"])
        return _model_card(meta, started)

    @app.post("/chat/completions", responses={200: {"content": SSE_SCHEMA}, **ERRORS})
    async def chat(body: ChatRequest):
        if body.stream is False:
            raise ParamError("stream", NOT_STREAMED)
        meta = await info()
        if body.model is not None and body.model != meta["model_id"]:
            return _model_not_found(body.model, meta["model_id"])
        streams, firsts = await _open(engine, engine_requests(body))
        if firsts[0]["type"] == "error":
            return _error_response(firsts[0])

        async def frames():
            async with aclosing(_events(streams, firsts)) as events:
                async for i, ev in events:
                    kind = ev["type"]
                    if kind == "delta":
                        if ev["text"]:
                            delta = {"type": "delta", "index": i, "text": ev["text"]}
                            if body.logprobs:
                                delta["logprobs"] = ev.get("logprobs") or []
                            yield sse_event(delta)
                    elif kind == "tool_call":
                        call = {"id": ev["id"], "name": "calculator", "expression": ev["expression"]}
                        yield sse_event({"type": "tool_call", "index": i, **call})
                    elif kind == "tool_result":
                        yield sse_event(
                            {"type": "tool_result", "index": i, "id": ev["id"], "output": ev["output"]}
                        )
                    elif kind == "done":
                        done = {"finish_reason": ev["finish_reason"], "usage": ev["usage"]}
                        yield sse_event({"type": "done", "index": i, **done})
                    else:
                        yield sse_event({"type": "error", "index": i, "message": ev["message"]})

        return EventStream(frames(), streams)

    @app.post(
        "/v1/chat/completions",
        response_model=None,
        responses={200: {"model": ChatCompletion, "content": SSE_SCHEMA}, **ERRORS},
    )
    async def openai_chat(body: ChatRequest):
        meta = await info()
        if body.model is not None and body.model != meta["model_id"]:
            return _model_not_found(body.model, meta["model_id"])
        streams, firsts = await _open(engine, engine_requests(body))
        if firsts[0]["type"] == "error":
            return _error_response(firsts[0])
        states = [ChoiceState(i, body.client_tools, bool(body.logprobs)) for i in range(len(streams))]
        cid, model = completion_id(), meta["model_id"]
        if not body.stream:
            failed = await _collect(streams, firsts, states)
            return failed or chat_completion(cid, model, states)

        chunks = Chunks(cid, model, _include_usage(body))
        roles = [chunks.role(i) for i in range(len(states))]
        frames = _chunk_frames(streams, firsts, states, chunks, total_usage, roles)
        return EventStream(frames, streams)

    @app.post(
        "/v1/completions",
        response_model=None,
        responses={200: {"model": Completion, "content": SSE_SCHEMA}, **ERRORS},
    )
    async def openai_completions(body: CompletionRequest):
        """OpenAI legacy Completions (raychat.serve.completions_api): one choice per prompt of the batch."""
        meta = await info()
        if body.model is not None and body.model != meta["model_id"]:
            return _model_not_found(body.model, meta["model_id"])
        streams, firsts = await _open(engine, completion_requests(body))
        if firsts[0]["type"] == "error":
            return _error_response(firsts[0])
        states = [CompletionState(i, body.logprobs is not None) for i in range(len(streams))]
        cid, model = text_completion_id(), meta["model_id"]
        if not body.stream:
            failed = await _collect(streams, firsts, states)
            return failed or completion(cid, model, states)

        chunks = CompletionChunks(cid, model, _include_usage(body))
        frames = _chunk_frames(streams, firsts, states, chunks, completion_usage)
        return EventStream(frames, streams)

    return app


def _is_json(media_type: str) -> bool:
    """Whether FastAPI reads a body of this media type as JSON (application/json or application/*+json)."""
    kind, _, subtype = media_type.partition("/")
    return kind == "application" and (subtype == "json" or subtype.endswith("+json"))


def _unreadable(exc: StarletteHTTPException) -> str:
    """Why FastAPI could not read a body (its HTTPException 400 "There was an error parsing the body", raised
    from the cause): bytes that are not UTF-8 say which byte, where."""
    cause = exc.__cause__
    if isinstance(cause, UnicodeDecodeError):
        return (
            f"not UTF-8: byte 0x{cause.object[cause.start]:02x} at offset {cause.start} (send JSON in UTF-8)"
        )
    return str(exc.detail)


def _openapi(app: FastAPI) -> dict:
    """FastAPI's schema with its default 422 answers removed: invalid requests are 400 (ERRORS) here."""
    if app.openapi_schema is None:
        schema = get_openapi(title=app.title, version=app.version, routes=app.routes)
        for path in schema["paths"].values():
            for operation in path.values():
                operation.get("responses", {}).pop("422", None)
        for name in ("HTTPValidationError", "ValidationError"):
            schema.get("components", {}).get("schemas", {}).pop(name, None)
        app.openapi_schema = schema
    return app.openapi_schema


class LocalClient:
    """Client of an in-process ChatServer (tests, benchmarks without Ray)."""

    def __init__(self, chat_engine):
        self.engine = chat_engine

    async def info(self) -> dict:
        return self.engine.info()

    async def stats(self) -> dict:
        return self.engine.stats()

    async def check(self, requests: list[dict]) -> dict | None:
        return self.engine.check(requests)

    def generate(self, request: dict):
        return self.engine.generate(request)
