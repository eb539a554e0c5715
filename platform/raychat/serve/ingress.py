"""The HTTP front of the chat service: a FastAPI app over any engine client (a Ray Serve handle in
production, an in-process ChatServer or a fake in tests).

Endpoints
  POST /chat/completions     SSE (raychat.serve.sse vocabulary): text deltas, then a "done" event with
                             finish_reason and usage
  POST /v1/chat/completions  OpenAI-compatible, stream true or false (usage, finish_reason, stop,
                             temperature, top_p, max_tokens, seed; top_k as an extension)
  GET  /v1/models            the served model, with template_version and tokenizer_version
  GET  /health               {"status": "ok", template_version, ..., "engine": replica stats}; 503 and
                             "unavailable" while the replica's engine process is down
  GET  /                     the chat web page (static/chat.html)

Before any parsing: a body over `max_body_bytes` -> 413; with `api_key` set, POST endpoints and /v1/models
need `Authorization: Bearer <api_key>` -> else 401. Invalid requests -> 400 naming the field
(raychat.serve.api). A client that disconnects mid-stream closes the engine stream, which frees its row.

Client protocol (duck-typed):
  async info() -> dict        {model_id, template_version, tokenizer_version, max_seq_len, ...}
  async stats() -> dict       the replica's counters (ChatServer.stats)
  generate(request: dict)     async iterator of event dicts (raychat.serve.server); closing it early
                              (aclose) must cancel the request
"""

from __future__ import annotations

import hmac
import json
import uuid
from pathlib import Path

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import HTMLResponse, JSONResponse, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from raychat.serve.api import MAX_BODY_BYTES, ChatRequest, error_body, validation_error_body
from raychat.serve.sse import OpenAIChunks, openai_completion, sse_event

STATIC_DIR = Path(__file__).parent / "static"
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
PROTECTED_PREFIXES = ("/chat/", "/v1/")


class BodyLimitAndAuth:
    """ASGI middleware: 401 without the bearer token (when one is configured) and 413 for a body over
    `max_body_bytes` (by Content-Length, or by counting a chunked body), both before the app parses JSON."""

    def __init__(self, app, max_body_bytes: int, api_key: str | None):
        self.app, self.max_body_bytes, self.api_key = app, max_body_bytes, api_key

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers", [])}
        if self.api_key and scope["path"].startswith(PROTECTED_PREFIXES):
            token = headers.get("authorization", "")
            scheme, _, value = token.partition(" ")
            if scheme.lower() != "bearer" or not hmac.compare_digest(
                value.strip().encode(), self.api_key.encode()
            ):
                body = error_body(
                    "missing or invalid bearer token: send 'Authorization: Bearer <key>'",
                    None,
                    "authentication_error",
                )
                return await _send_json(send, 401, body, {"www-authenticate": "Bearer"})
        if scope["method"] not in ("POST", "PUT", "PATCH"):
            return await self.app(scope, receive, send)
        too_big = error_body(f"request body exceeds {self.max_body_bytes} bytes", "body", "request_too_large")
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
    """An engine's rejection as HTTP: "param: message" (the field first, as for validation errors)."""
    param, message, status = event.get("param"), event["message"], event.get("status", 500)
    if param and not message.startswith(f"{param}: "):
        message = f"{param}: {message}"
    kind = "server_error" if status >= 500 else "invalid_request_error"
    headers = {"Retry-After": "5"} if status == 503 else None
    return JSONResponse(error_body(message, param, kind), status_code=status, headers=headers)


async def _start(engine, request: ChatRequest):
    """Open the engine stream and wait for its first event, so a rejection becomes an HTTP error status
    instead of an event inside a 200 stream. Returns (events, first_event)."""
    events = engine.generate(request.to_engine())
    try:
        first = await anext(events)
    except BaseException:
        await events.aclose()
        raise
    return events, first


async def _chain(first: dict, events):
    """first, then the rest of `events`; closes `events` however the consumer stops (cancel on disconnect)."""
    try:
        yield first
        async for ev in events:
            yield ev
    finally:
        await events.aclose()


def create_app(engine, api_key: str | None = None, max_body_bytes: int = MAX_BODY_BYTES) -> FastAPI:
    """The FastAPI app over `engine` (see the module doc); wrapped in BodyLimitAndAuth."""
    app = FastAPI(title="raychat", docs_url=None, redoc_url=None)
    app.add_middleware(BodyLimitAndAuth, max_body_bytes=max_body_bytes, api_key=api_key)
    cache: dict = {}

    async def info() -> dict:
        if "info" not in cache:
            cache["info"] = await engine.info()
        return cache["info"]

    @app.exception_handler(RequestValidationError)
    async def _invalid(_request: Request, exc: RequestValidationError):
        return JSONResponse(validation_error_body(list(exc.errors())), status_code=400)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_request: Request, exc: StarletteHTTPException):
        """FastAPI's own errors (unknown path, bad method, a body that is not JSON/UTF-8) in the same shape."""
        param = "body" if exc.status_code == 400 else None
        return JSONResponse(
            error_body(str(exc.detail), param), status_code=exc.status_code, headers=exc.headers
        )

    @app.get("/", response_class=HTMLResponse)
    async def page():
        return HTMLResponse((STATIC_DIR / "chat.html").read_text())

    @app.get("/health")
    async def health():
        meta = await info()
        stats = await engine.stats()
        up = stats.get("engine_running", True)
        body = {"status": "ok" if up else "unavailable",
                **{k: meta.get(k) for k in ("model_id", "template_version", "tokenizer_version")}, "engine": stats}  # fmt: skip
        return JSONResponse(body, status_code=200 if up else 503)

    @app.get("/v1/models")
    async def models():
        meta = await info()
        card = {"id": meta["model_id"], "object": "model", "created": 0, "owned_by": "raychat"}
        card.update({k: meta.get(k) for k in ("template_version", "tokenizer_version", "max_seq_len")})
        return {"object": "list", "data": [card]}

    @app.post("/chat/completions")
    async def chat(body: ChatRequest):
        events, first = await _start(engine, body)
        if first["type"] == "error":
            await events.aclose()
            return _error_response(first)

        async def frames():
            async for ev in _chain(first, events):
                if ev["type"] == "delta":
                    if ev["text"]:
                        yield sse_event({"type": "delta", "text": ev["text"]})
                elif ev["type"] == "done":
                    yield sse_event(
                        {"type": "done", "finish_reason": ev["finish_reason"], "usage": ev["usage"]}
                    )
                else:
                    yield sse_event({"type": "error", "message": ev["message"]})

        return StreamingResponse(frames(), media_type="text/event-stream", headers=SSE_HEADERS)

    @app.post("/v1/chat/completions")
    async def openai_chat(body: ChatRequest):
        meta = await info()
        if body.model is not None and body.model != meta["model_id"]:
            err = error_body(
                f"model: {body.model!r} is not served here; available: [{meta['model_id']!r}]", "model"
            )
            err["error"]["code"] = "model_not_found"
            return JSONResponse(err, status_code=404)
        events, first = await _start(engine, body)
        if first["type"] == "error":
            await events.aclose()
            return _error_response(first)
        completion_id = f"chatcmpl-{uuid.uuid4().hex}"
        if not body.stream:
            text, done = [], None
            async for ev in _chain(first, events):
                if ev["type"] == "delta":
                    text.append(ev["text"])
                elif ev["type"] == "done":
                    done = ev
                else:
                    return JSONResponse(error_body(ev["message"], None, "server_error"), status_code=500)
            usage = {k: done["usage"][k] for k in ("prompt_tokens", "completion_tokens", "total_tokens")}
            return openai_completion(
                completion_id, meta["model_id"], "".join(text), done["finish_reason"], usage
            )

        chunks = OpenAIChunks(completion_id, meta["model_id"])
        include_usage = bool(body.stream_options and body.stream_options.include_usage)

        async def frames():
            yield sse_event(chunks.role())
            async for ev in _chain(first, events):
                if ev["type"] == "delta":
                    if ev["text"]:
                        yield sse_event(chunks.content(ev["text"]))
                elif ev["type"] == "done":
                    yield sse_event(chunks.finish(ev["finish_reason"]))
                    if include_usage:
                        u = ev["usage"]
                        yield sse_event(
                            chunks.usage(
                                {k: u[k] for k in ("prompt_tokens", "completion_tokens", "total_tokens")}
                            )
                        )
                else:
                    yield sse_event(error_body(ev["message"], None, "server_error"))
            yield sse_event("[DONE]")

        return StreamingResponse(frames(), media_type="text/event-stream", headers=SSE_HEADERS)

    return app


class LocalClient:
    """Client of an in-process ChatServer (tests, benchmarks without Ray)."""

    def __init__(self, chat_engine):
        self.engine = chat_engine

    async def info(self) -> dict:
        return self.engine.info()

    async def stats(self) -> dict:
        return self.engine.stats()

    def generate(self, request: dict):
        return self.engine.generate(request)
