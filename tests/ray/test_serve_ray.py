"""The real app on a local Ray Serve with a tiny random model: streaming, disconnect frees the row, 16
concurrent streams equal their solo greedy outputs, the official openai client, autoscaling up and down."""

from __future__ import annotations

import json
import os
import re
import signal
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import requests
from support.cluster import init_local_ray
from support.serve_helpers import tiny_model_and_tokenizer, write_tiny_checkpoint
from support.stopped_writer import age

from raychat.chat.turn import turn_parts
from raychat.chat_template import TEMPLATE_VERSION, render_for_completion
from raychat.engine import ModelRunner
from raychat.ports import free_ports
from raychat.serve.sse import parse_sse

pytestmark = pytest.mark.ray

APP = "raychat"


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    import ray
    from ray import serve

    from raychat.serve.app import build_app

    # a long context, so a 2000-token reply is still being generated when the test disconnects
    ckpt = write_tiny_checkpoint(tmp_path_factory.mktemp("ckpt"), max_seq_len=2048)
    # replicas and handles report their load every 0.25 s instead of 10 s, so autoscaling reacts in seconds
    env = {
        "RAY_SERVE_REPLICA_AUTOSCALING_METRIC_PUSH_INTERVAL_S": "0.25",
        "RAY_SERVE_HANDLE_AUTOSCALING_METRIC_PUSH_INTERVAL_S": "0.25",
    }
    old = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    init_local_ray(num_cpus=2, include_dashboard=False, log_to_driver=False, runtime_env={"env_vars": env})
    port = free_ports(1)[0]
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    app = build_app(
        {
            "checkpoint": str(ckpt),
            "max_slots": 16,
            "num_cpus": 0.5,
            "torch_threads": 1,
            "min_replicas": 1,
            "max_replicas": 2,
            "target_ongoing_requests": 2,
            "upscale_delay_s": 0.5,
            "downscale_delay_s": 2,
            "look_back_period_s": 1,
            "model_id": "tiny",
            "allow_unauthenticated": True,
        }
    )
    serve.run(app, name=APP, route_prefix="/")
    yield f"http://127.0.0.1:{port}"
    serve.shutdown()
    ray.shutdown()
    for k, v in old.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


def engine_stats() -> dict:
    from ray import serve

    return serve.get_deployment_handle("ChatServer", app_name=APP).stats.remote().result(timeout_s=10)


def running_replicas() -> int:
    from ray import serve

    states = serve.status().applications[APP].deployments["ChatServer"].replica_states
    return states.get("RUNNING", 0)


def chat(url: str, content: str, **params) -> tuple[str, dict]:
    resp = requests.post(
        f"{url}/chat/completions",
        json={"messages": [{"role": "user", "content": content}], **params},
        timeout=60,
    )
    assert resp.status_code == 200, resp.text
    events = [json.loads(e) for e in parse_sse(resp.text)]
    assert events[-1]["type"] == "done"
    return "".join(e["text"] for e in events if e["type"] == "delta"), events[-1]


@pytest.fixture(scope="module")
def solo():
    """Greedy reference: each prompt generated alone by an in-process ModelRunner over the same weights."""
    model, tokenizer = tiny_model_and_tokenizer(max_seq_len=2048)
    engine = ModelRunner(model, tokenizer)

    def run(content: str, max_tokens: int) -> str:
        """The visible text (raychat.chat.turn: no special tokens, no calculator blocks)."""
        prompt = render_for_completion(tokenizer, [{"role": "user", "content": content}])
        result = engine.generate_batch([prompt], max_tokens=max_tokens, temperature=0)[0]
        return "".join(t for kind, t in turn_parts(tokenizer, result.completion_tokens) if kind == "text")

    return run


def test_stream_health_and_models(served, solo):
    health = requests.get(f"{served}/health", timeout=10).json()
    assert health["status"] == "ok" and health["template_version"] == TEMPLATE_VERSION
    assert requests.get(f"{served}/v1/models", timeout=10).json()["data"][0]["id"] == "tiny"
    assert "<title>raychat</title>" in requests.get(f"{served}/", timeout=10).text
    # events arrive one by one while the reply is generated (not buffered until the end). A long reply (the tiny
    # model's greedy "hello" stops after 245 tokens, ~0.4 s alone): 40 tokens once came out in one delta, all
    # generated before the first was sent (CI, 2026-12-07)
    body = {"messages": [{"role": "user", "content": "hello"}], "max_tokens": 400, "temperature": 0}
    with requests.post(f"{served}/chat/completions", json=body, stream=True, timeout=60) as resp:
        arrivals = [(time.perf_counter(), line) for line in resp.iter_lines() if line]
    assert len(arrivals) >= 3 and arrivals[-1][0] > arrivals[0][0]
    text, done = chat(served, "hello", max_tokens=40, temperature=0)
    assert text == solo("hello", 40)
    assert done["usage"]["completion_tokens"] >= 1 and done["finish_reason"] in ("stop", "length")


def test_disconnect_and_rejection_leave_nothing_in_flight(served):
    assert running_replicas() == 1
    before = engine_stats()
    body = {
        "messages": [{"role": "user", "content": "go on"}],
        "max_tokens": 1800,  # seconds of generation: still running when the stats are read
        "temperature": 1.0,
        "seed": 3,
    }
    with requests.post(f"{served}/chat/completions", json=body, stream=True, timeout=60) as resp:
        lines = resp.iter_lines()
        assert next(lines).startswith(b"data: ")  # streaming has started
        mid = engine_stats()
        assert mid["in_flight"] == 1 and mid["running"] == 1
    # the connection is closed here (mid-stream); the row must be freed
    deadline = time.time() + 60
    while time.time() < deadline and (s := engine_stats())["in_flight"] + s["running"] > 0:
        time.sleep(0.1)
    after = engine_stats()
    assert after["in_flight"] == 0 and after["running"] == 0 and after["free_rows"] == after["max_slots"]
    # normally the disconnect cancels the request; on a loaded machine the tiny model can finish its 1800
    # tokens before the disconnect reaches the replica: then it counts as completed. Either way exactly one
    # request ended and its row is free (cancel itself is tested in test_engine_scheduler and in-process).
    ended = (after["cancelled"] - before["cancelled"], after["completed"] - before["completed"])
    assert ended in ((1, 0), (0, 1)), ended
    # a rejection (prompt longer than the model's context) also leaves nothing in flight
    resp = requests.post(
        f"{served}/chat/completions",
        json={"messages": [{"role": r, "content": "json " * 1600} for r in ("user", "assistant", "user")]},
        timeout=30,
    )
    assert resp.status_code == 400 and resp.json()["error"]["param"] == "messages"
    final = engine_stats()
    assert final["in_flight"] == 0 and final["rejected"] == after["rejected"] + 1


def test_16_concurrent_streams_equal_solo_greedy(served, solo):
    prompts = [f"question number {i}: what is {i} + {i}?" for i in range(16)]
    with ThreadPoolExecutor(16) as pool:
        results = list(pool.map(lambda p: chat(served, p, max_tokens=32, temperature=0), prompts))
    for prompt, (text, done) in zip(prompts, results):
        assert text == solo(prompt, 32), prompt
        assert done["finish_reason"] in ("stop", "length")
    assert len({text for text, _ in results}) > 1  # different prompts, different replies


def test_openai_client_with_and_without_streaming(served, solo):
    openai = pytest.importorskip("openai", reason="the official openai client is in the test extra")
    client = openai.OpenAI(base_url=f"{served}/v1", api_key="unused", max_retries=0)
    messages = [{"role": "user", "content": "Say something."}]
    reply = client.chat.completions.create(model="tiny", messages=messages, max_tokens=16, temperature=0)
    text = reply.choices[0].message.content
    assert text == solo("Say something.", 16)
    assert reply.usage.completion_tokens >= 1 and reply.choices[0].finish_reason in ("stop", "length")
    stream = client.chat.completions.create(
        model="tiny",
        messages=messages,
        max_tokens=16,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == text
    assert chunks[-1].usage.completion_tokens == reply.usage.completion_tokens
    with pytest.raises(openai.BadRequestError, match="temperature"):
        client.chat.completions.create(model="tiny", messages=messages, temperature=3)


def _wait_for_failed_start(app: str):
    """ChatServer's status in `app` once Serve's message says a replica failed to start (120 s at most)."""
    from ray import serve

    deadline = time.monotonic() + 120
    while (
        "failed to start"
        not in (server := serve.status().applications[app].deployments["ChatServer"]).message
    ):
        assert time.monotonic() < deadline, f"no failed start within 120 s: {server}"
        time.sleep(0.5)
    return server


def test_a_deleted_checkpoint_fails_new_replicas_by_name_and_every_route_answers_503(served, tmp_path):
    """A checkpoint outside any run (served in place) is deleted after the app deployed, then the replica dies.
    Every new replica fails to start with an error naming the checkpoint, and /health and a request on each
    chat route answer 503 with that reason once health_timeout_s (default 5 s) has passed, instead of waiting
    for a replica that never comes (/health hung before; the chat routes still did). A second app on the
    module's Serve, so the shared one is untouched."""
    import shutil

    from ray import serve

    from raychat.serve.app import build_app

    ckpt = write_tiny_checkpoint(tmp_path / "model")
    args = {
        "checkpoint": str(ckpt),
        "num_cpus": 0.25,
        "torch_threads": 1,
        "max_slots": 1,
        "allow_unauthenticated": True,
    }
    serve.run(build_app(args), name="gone", route_prefix="/gone")
    try:
        url = f"{served}/gone"
        assert requests.get(f"{url}/health", timeout=30).json()["model_id"] == str(
            ckpt
        )  # caches the model info
        pid = (
            serve.get_deployment_handle("ChatServer", app_name="gone")
            .stats.remote()
            .result(timeout_s=30)["pid"]
        )
        shutil.rmtree(ckpt)
        os.kill(pid, signal.SIGKILL)  # the replica crashes: Serve starts a new one, which cannot load
        server = _wait_for_failed_start("gone")
        error = server.message.strip().splitlines()[-1]  # Serve's traceback of the replica ends with it
        assert error.startswith(
            f"raychat.checkpoint_manager.CheckpointError: checkpoint {ckpt} no longer exists: "
        )
        assert "--keep-checkpoints" in error and "cp -r" in error
        reason = r"no ChatServer replica answered within 5 s; ChatServer is [A-Z_]+ \(replicas: [^)]*\): (.*)"
        t0 = time.monotonic()
        resp = requests.get(f"{url}/health", timeout=30)
        took = time.monotonic() - t0
        assert resp.status_code == 503 and resp.headers["retry-after"] == "5", resp.text
        assert 5 <= took < 20, took
        body = resp.json()
        assert body["status"] == "unavailable" and re.fullmatch(reason, body["reason"])[1] == error, body
        messages = [{"role": "user", "content": "hi"}]
        for path, request in [
            ("/chat/completions", {"messages": messages}),
            ("/v1/chat/completions", {"messages": messages}),
            ("/v1/chat/completions", {"messages": messages, "stream": True}),
            ("/v1/completions", {"prompt": "hi"}),
        ]:
            t0 = time.monotonic()
            resp = requests.post(f"{url}{path}", json=request, timeout=60)  # waited for ever before
            took = time.monotonic() - t0
            assert resp.status_code == 503 and resp.headers["retry-after"] == "5", (path, resp.text)
            assert 5 <= took < 20, (path, took)
            err = resp.json()["error"]
            assert err["type"] == "server_error" and err["param"] is None, err
            assert re.fullmatch(f"engine unavailable: {reason}", err["message"])[1] == error, err
    finally:
        serve.delete("gone")


def test_a_runs_checkpoint_is_served_from_a_snapshot_that_pruning_leaves(served, tmp_path):
    """`<run>/latest` pins the run's newest checkpoint when the app deploys, and build_app serves it from a
    snapshot (<run>/served/checkpoint_000001-<12 hex>: hard links). Training goes on and prunes that checkpoint
    (CheckpointManager keep=1, i.e. --keep-checkpoints 1), then the replica dies: the new replica loads the
    snapshot and serves the same model (before, every new replica failed: checkpoint ... no longer exists); the
    request the dead replica held is answered 503 in one line (it carried Ray's actor id, pid and node IP).
    The app marks its snapshot in use while it runs (every 0.5 s here), so a snapshot of the run's newer
    checkpoint, which deletes the run's snapshots unused for a day, keeps it."""
    from ray import serve

    from raychat.checkpoint_manager import SNAPSHOT_UNUSED_S, CheckpointManager, snapshot_checkpoint
    from raychat.serve.app import build_application
    from raychat.storage import open_storage

    first = write_tiny_checkpoint(tmp_path / "run" / "checkpoint_000001")
    args = {
        "checkpoint": f"{tmp_path}/run/latest",
        "num_cpus": 0.25,
        "torch_threads": 1,
        "max_slots": 1,
        "allow_unauthenticated": True,
    }
    serve.run(build_application(args, mark_every_s=0.5), name="pruned", route_prefix="/pruned")
    try:
        url = f"{served}/pruned"
        assert requests.get(f"{url}/health", timeout=30).json()["model_id"] == args["checkpoint"]
        handle = serve.get_deployment_handle("ChatServer", app_name="pruned")
        pid = handle.stats.remote().result(timeout_s=30)["pid"]
        (snapshot,) = (tmp_path / "run" / "served").iterdir()
        assert re.fullmatch(r"checkpoint_000001-[0-9a-f]{12}", snapshot.name), snapshot
        age(snapshot, SNAPSHOT_UNUSED_S + 60)  # as if unused for a day: the app marks it again
        deadline = time.monotonic() + 30
        while time.time() - snapshot.stat().st_mtime > 60:
            assert time.monotonic() < deadline, "the app did not mark its snapshot in use within 30 s"
            time.sleep(0.2)
        second = write_tiny_checkpoint(tmp_path / "run" / "checkpoint_000002")  # training saves on and prunes
        assert CheckpointManager(open_storage(tmp_path), "run", keep=1).prune() == [str(first)]
        newer = snapshot_checkpoint(second)  # another app serves the newer checkpoint: this one's stays
        assert sorted(p.name for p in snapshot.parent.iterdir()) == sorted([snapshot.name, newer.name])
        resp = _request_in_flight_when_the_replica_dies(url, handle, pid)
        assert resp.status_code == 503 and resp.headers["retry-after"] == "5", resp.text
        # one line of Ray's ActorDiedError: the rest (the replica's actor id, pid, node IP) is the log's
        died = "engine unavailable: ActorDiedError: The actor died unexpectedly before finishing this task."
        assert resp.json()["error"]["message"] == died, resp.text
        deadline = time.monotonic() + 120
        while _replica_pid(handle) in (None, pid):
            assert time.monotonic() < deadline, (
                serve.status().applications["pruned"].deployments["ChatServer"]
            )
            time.sleep(0.5)
        health = requests.get(f"{url}/health", timeout=30)
        assert health.status_code == 200 and health.json()["model_id"] == args["checkpoint"], health.text
        resp = requests.post(
            f"{url}/v1/chat/completions",
            json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4},
            timeout=60,
        )
        assert resp.status_code == 200 and resp.json()["model"] == args["checkpoint"], resp.text
        assert not first.exists() and (snapshot / "commit.json").is_file()
    finally:
        serve.delete("pruned")


def _request_in_flight_when_the_replica_dies(url: str, handle, pid: int) -> requests.Response:
    """The answer to a chat request that the replica `pid` holds when it is killed (SIGKILL): its engine
    process is stopped (SIGSTOP) first, so the request waits there for its first token; killed after."""
    engine = handle.stats.remote().result(timeout_s=30)["child_pids"][0]
    os.kill(engine, signal.SIGSTOP)
    try:
        with ThreadPoolExecutor(1) as pool:
            body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
            answer = pool.submit(requests.post, f"{url}/v1/chat/completions", json=body, timeout=60)
            deadline = time.monotonic() + 30
            while handle.stats.remote().result(timeout_s=10)["in_flight"] < 1:
                assert time.monotonic() < deadline, "the request did not reach the replica within 30 s"
                time.sleep(0.1)
            os.kill(pid, signal.SIGKILL)
            return answer.result()
    finally:
        os.kill(engine, signal.SIGKILL)


def _replica_pid(handle) -> int | None:
    """The pid of a ChatServer replica that answers within 5 s, or None."""
    try:
        return handle.stats.remote().result(timeout_s=5)["pid"]
    except Exception:  # noqa: BLE001 - no replica running yet (a timeout, or the dead one's error)
        return None


def deployment_state() -> str:
    """The ChatServer deployment's status and replica states, for a failure message."""
    from ray import serve

    d = serve.status().applications[APP].deployments["ChatServer"]
    return f"status {d.status}, replicas {dict(d.replica_states)}"


@pytest.mark.slow
def test_autoscaling_up_under_load_and_down_after(served):
    """8 streams against target_ongoing_requests 2 (upscale_delay_s 0.5) bring up a second replica; idle, the
    deployment goes back to min_replicas. The 300 s bound is for the replica's start-up: 52 s under load here,
    and none was RUNNING after 120 s on a CI machine busy with the other pytest worker's clusters (stop 56); the
    message then names the deployment's status and replica states."""
    assert running_replicas() >= 1
    stop_at = time.time() + 300
    scaled_up = False

    def load(i: int) -> int:
        n = 0
        while time.time() < stop_at and not scaled_up:
            chat(served, f"load {i}", max_tokens=200, temperature=1.0, seed=i)
            n += 1
        return n

    with ThreadPoolExecutor(8) as pool:
        futures = [pool.submit(load, i) for i in range(8)]
        t0 = time.time()
        while time.time() < stop_at and running_replicas() < 2:
            time.sleep(0.2)
        scaled_up = running_replicas() == 2
        up_after = time.time() - t0
        state = "" if scaled_up else deployment_state()
        served_requests = sum(f.result() for f in futures)
    assert scaled_up, (
        f"no second replica within 300 s under 8 concurrent streams (target_ongoing_requests=2): {state}"
    )
    assert served_requests >= 1
    t0 = time.time()
    while time.time() - t0 < 120 and running_replicas() > 1:
        time.sleep(0.5)
    assert running_replicas() == 1, "did not scale back to min_replicas=1 within 120 s of idleness"
    print(f"scaled up after {up_after:.1f} s of load; down after {time.time() - t0:.1f} s idle")
