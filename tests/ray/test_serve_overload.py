"""Backpressure and deadlines over HTTP, without a Ray cluster: a burst beyond the engine's queue bound is
answered 429 with Retry-After on both chat routes while the admitted requests complete; a request past its
deadline ends with a 504-status error and its slot runs the next request; Serve's backpressure (a handle's
BackPressureError) is a 429 too; build_app sets Serve's queue bounds; the official openai client retries a
429 after its Retry-After and does not retry a 504. One test (marked ray) runs the burst on a real Ray Serve."""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import time
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace

import httpx
import openai
import pytest
import requests
from fastapi.testclient import TestClient
from ray.serve.exceptions import BackPressureError
from support.cluster import init_local_ray
from support.serve_helpers import HELLO, FakeEngine, write_tiny_checkpoint

import raychat.serve.app as serve_app
from raychat.ports import free_ports
from raychat.serve.ingress import LocalClient, create_app
from raychat.serve.server import ChatServer
from raychat.serve.sse import parse_sse

MAX_SLOTS, MAX_PENDING = 2, 3
FULL = f"engine queue full: {MAX_PENDING} requests already wait for a KV slot (max_pending={MAX_PENDING})"
USER = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """Rows of 4,096 tokens: a request that runs to the end of its row lasts seconds on this tiny model."""
    return write_tiny_checkpoint(tmp_path_factory.mktemp("ckpt"), max_seq_len=4096)


@pytest.fixture(scope="module")
def server(checkpoint):
    engine = ChatServer.from_checkpoint(checkpoint, engine_process=True, max_slots=MAX_SLOTS, max_pending=MAX_PENDING,
                                        retry_after_s=2)  # fmt: skip
    yield engine
    engine.shutdown()


def asgi_client(app) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test", timeout=120)


async def burst_while_stopped(server: ChatServer, path: str, body: dict, n: int) -> list[httpx.Response]:
    """POST `body` n times at once while the engine child is stopped (SIGSTOP): no request can finish, so
    exactly MAX_SLOTS + MAX_PENDING are taken and the rest are refused; SIGCONT once the refusals have
    answered."""
    pid = server.scheduler._proc.pid
    async with asgi_client(create_app(LocalClient(server))) as client:
        os.kill(pid, signal.SIGSTOP)
        try:
            tasks = [asyncio.create_task(client.post(path, json=body)) for _ in range(n)]
            deadline = time.monotonic() + 60
            while sum(t.done() for t in tasks) < n - MAX_SLOTS - MAX_PENDING and time.monotonic() < deadline:
                await asyncio.sleep(0.02)
        finally:
            os.kill(pid, signal.SIGCONT)
        return await asyncio.gather(*tasks)


def assert_overloaded(resp: httpx.Response) -> None:
    assert resp.status_code == 429 and resp.headers["retry-after"] == "2"
    assert resp.json() == {
        "error": {"message": FULL, "type": "rate_limit_error", "param": None, "code": None}
    }


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/chat/completions"])
def test_a_burst_beyond_the_queue_gets_429_and_the_admitted_requests_complete(server, path):
    body = {"messages": USER, "max_tokens": 8, "temperature": 0}
    responses = asyncio.run(burst_while_stopped(server, path, body, n=MAX_SLOTS + MAX_PENDING + 3))
    refused = [r for r in responses if r.status_code != 200]
    assert len(refused) == 3
    for resp in refused:
        assert_overloaded(resp)
    for resp in (r for r in responses if r.status_code == 200):
        if path.startswith("/v1/"):
            reply = resp.json()
            assert (
                reply["choices"][0]["finish_reason"] == "length" and reply["usage"]["completion_tokens"] == 8
            )
        else:
            done = json.loads(parse_sse(resp.text)[-1])
            assert done["type"] == "done" and done["finish_reason"] == "length"
            assert done["usage"]["completion_tokens"] == 8
    stats = server.stats()
    assert (stats["in_flight"], stats["free_rows"], stats["waiting"]) == (0, 2, 0)


def test_a_request_past_its_deadline_ends_with_504_and_its_slot_runs_the_next(checkpoint):
    """request_timeout_s=3: the engine child is stopped for 3.2 s while the request decodes, so its next step
    ends it ("timeout"); the answer is 504 with x-should-retry: false, and the next request runs."""
    server = ChatServer.from_checkpoint(checkpoint, engine_process=True, max_slots=2, request_timeout_s=3.0)
    proc = server.scheduler

    async def scenario():
        async with asgi_client(create_app(LocalClient(server))) as client:
            body = {"messages": USER, "temperature": 1.0, "seed": 3}  # no max_tokens: to the end of the row
            task = asyncio.create_task(client.post("/v1/chat/completions", json=body))
            deadline = time.monotonic() + 60
            while proc.num_active == 0 and time.monotonic() < deadline:
                await asyncio.sleep(0.01)
            os.kill(proc._proc.pid, signal.SIGSTOP)
            try:
                await asyncio.sleep(3.2)
            finally:
                os.kill(proc._proc.pid, signal.SIGCONT)
            timed_out = await task
            after = await client.post("/v1/chat/completions", json={"messages": USER, "max_tokens": 4})
            return timed_out, after, server.stats(), proc.restarts

    try:
        timed_out, after, stats, restarts = asyncio.run(scenario())
    finally:
        server.shutdown()
    assert timed_out.status_code == 504 and timed_out.headers["x-should-retry"] == "false"
    error = timed_out.json()["error"]
    assert error["type"] == "server_error" and re.fullmatch(
        r"request timed out: ran \d+\.\d s, past request_timeout_s=3; it was ended and its KV slot freed",
        error["message"],
    )
    assert after.status_code == 200 and after.json()["usage"]["completion_tokens"] == 4
    assert (stats["free_rows"], stats["in_flight"], restarts) == (2, 0, 0)


def back_pressure() -> BackPressureError:
    """What Serve's router raises in the ingress when the ChatServer queue at this caller is full."""
    return BackPressureError(
        num_queued_requests=64, max_queued_requests=64, status_code=429, retry_after_s=1.5
    )


class BackPressureHandle:
    """A DeploymentHandle stand-in whose streaming generate call and check call (and, with info_too, its
    info call: all share the replicas' queue) raise back_pressure()."""

    def __init__(self, info_too: bool):
        self.info = SimpleNamespace(remote=self._refuse if info_too else FakeEngine().info)
        self.generate = SimpleNamespace(remote=lambda _request: self._stream())
        self.check = SimpleNamespace(remote=lambda _requests: self._refuse())

    def options(self, **_):
        return self

    async def _refuse(self):
        raise back_pressure()

    async def _stream(self):
        raise back_pressure()
        yield  # an async generator


@pytest.mark.parametrize("info_too", [False, True])
def test_serve_backpressure_at_the_ingress_is_a_429_with_retry_after(info_too):
    http = TestClient(create_app(serve_app.HandleClient(BackPressureHandle(info_too))))
    for path, n in [("/v1/chat/completions", 1), ("/chat/completions", 1), ("/v1/chat/completions", 2)]:
        resp = http.post(path, json={"messages": USER, "n": n})  # n=2: refused at the check of its choices
        assert resp.status_code == 429 and resp.headers["retry-after"] == "2"  # 1.5 s rounded up
        assert resp.json()["error"] == {
            "message": "overloaded: Request dropped due to backpressure (num_queued_requests=64, "
            "max_queued_requests=64).",
            "type": "rate_limit_error",
            "param": None,
            "code": None,
        }


def test_build_app_bounds_serve_queues(checkpoint):
    args = {"checkpoint": str(checkpoint), "max_queued_requests": 16, "ingress_max_queued_requests": 100,
            "retry_after_s": 3, "max_pending": 5, "request_timeout_s": 30, "stall_timeout_s": 20,
            "health_timeout_s": 2, "allow_unauthenticated": True}  # fmt: skip
    ingress = serve_app.build_app(args)._bound_deployment
    engine = ingress.init_args[0]._bound_deployment
    assert (engine.max_queued_requests, ingress.max_queued_requests) == (16, 100)
    assert ingress.init_kwargs["health_timeout_s"] == 2.0  # how long /health waits for a replica
    for deployment in (engine, ingress):
        bp = deployment.backpressure_config
        assert (bp.status_code, bp.retry_after_s) == (429, 3)
    assert engine.init_kwargs["limits"] == {
        "max_pending": 5,
        "request_timeout_s": 30.0,
        "stall_timeout_s": 20.0,
        "retry_after_s": 3,
        "prefix_cache_tokens": "auto",  # 8 x max_seq_len, allocated as it fills (docs/engine.md)
        "kv_dtype": "model",  # the weights' dtype (ServeConfig kv_dtype)
    }
    default = serve_app.build_app(
        {"checkpoint": str(checkpoint), "allow_unauthenticated": True}
    )._bound_deployment
    limits = default.init_args[0]._bound_deployment.init_kwargs["limits"]
    assert (default.max_queued_requests, limits["request_timeout_s"], limits["max_pending"]) == (
        256,
        300.0,
        32,
    )
    assert default.init_kwargs["health_timeout_s"] == 5.0
    for key, value, message in (
        ("max_pending", "0", "max_pending must be >= 1, got 0"),
        ("request_timeout_s", "0", "request_timeout_s must be > 0, got 0"),
        ("max_queued_requests", "0", "max_queued_requests must be >= 1, got 0"),
        ("retry_after_s", "0", "retry_after_s must be >= 1, got 0"),
    ):
        with pytest.raises(ValueError, match=re.escape(message)):
            serve_app.serve_config({"checkpoint": "/x", key: value})


def openai_client(app, max_retries: int) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(api_key="none", base_url="http://test/v1", max_retries=max_retries,
                              http_client=asgi_client(app))  # fmt: skip


def test_the_openai_client_retries_a_429_after_retry_after_and_not_a_504():
    overloaded = {"type": "error", "status": 429, "message": FULL, "param": None, "retry_after": 1}
    timed_out = {"type": "error", "status": 504, "message": "request timed out: ...", "param": None}

    async def ask(script: list[list[dict]], max_retries: int):
        scripts = iter(script)
        fake = FakeEngine(lambda request: next(scripts))
        try:
            reply = await openai_client(create_app(fake), max_retries).chat.completions.create(
                model="tiny", messages=USER
            )
            return reply, len(fake.requests)
        except openai.APIStatusError as e:
            return e, len(fake.requests)

    reply, calls = asyncio.run(ask([[overloaded], HELLO], max_retries=1))
    assert reply.choices[0].message.content == "Hello\nworld" and calls == 2  # retried after Retry-After: 1
    error, calls = asyncio.run(ask([[overloaded], HELLO], max_retries=0))
    assert isinstance(error, openai.RateLimitError) and error.status_code == 429 and calls == 1
    error, calls = asyncio.run(ask([[timed_out], HELLO], max_retries=2))
    assert isinstance(error, openai.InternalServerError) and error.status_code == 504 and calls == 1


@pytest.mark.ray
def test_serve_refuses_a_burst_beyond_its_queue_with_429(tmp_path):
    """One replica that takes one request at a time (max_ongoing_requests=1) and one more queued at the
    ingress (max_queued_requests=1): of 6 requests sent at once at least 4 are refused with Serve's
    BackPressureError as OpenAI's 429 with Retry-After, and the admitted ones complete."""
    import ray
    from ray import serve

    ckpt = write_tiny_checkpoint(tmp_path / "ckpt", max_seq_len=4096)
    init_local_ray(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        port = free_ports(1)[0]
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        args = {"checkpoint": str(ckpt), "max_slots": 1, "max_ongoing_requests": 1, "max_queued_requests": 1,
                "num_cpus": 0.5, "torch_threads": 1, "retry_after_s": 2, "model_id": "tiny",
                "allow_unauthenticated": True}  # fmt: skip
        serve.run(serve_app.build_app(args), name="raychat", route_prefix="/")
        url = f"http://127.0.0.1:{port}/v1/chat/completions"
        body = {"messages": USER, "max_tokens": 1000, "temperature": 0}  # greedy: all 1000 tokens, seconds
        with ThreadPoolExecutor(6) as pool:
            responses = list(pool.map(lambda _: requests.post(url, json=body, timeout=300), range(6)))
        refused = [r for r in responses if r.status_code == 429]
        done = [r for r in responses if r.status_code == 200]
        seen = [(r.status_code, r.headers.get("content-type"), r.text[:200]) for r in responses]
        assert len(refused) >= 4 and len(done) >= 1 and len(refused) + len(done) == 6, seen
        assert all(r.headers.get("content-type") == "application/json" for r in refused), seen
        for resp in refused:
            assert resp.headers["retry-after"] == "2"
            error = resp.json()["error"]
            assert error["type"] == "rate_limit_error" and error["message"].startswith(
                "overloaded: Request dropped due to backpressure"
            )
        assert all(r.json()["usage"]["completion_tokens"] == 1000 for r in done)
    finally:
        serve.shutdown()
        ray.shutdown()
