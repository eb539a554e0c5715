"""Clients nobody here wrote against a real `raychat serve` (its own local Ray cluster, the calculator model
of tests/support/tool_model.py): the official openai Python client, the official openai Node client (tests/node,
installed by `make test-deps`), and schemathesis fuzzing the served /openapi.json. Expected values are
worked out in-process with the same weights."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import httpx
import openai
import pytest
import schemathesis
import torch
from hypothesis import HealthCheck, Phase, given, settings
from schemathesis import GenerationMode
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    negative_data_rejection,
    response_schema_conformance,
    status_code_conformance,
)
from support.serve_process import ServeProcess

from raychat.chat.turn import turn_parts
from raychat.chat_template import render_for_completion
from raychat.checkpoint import load_model
from raychat.engine import ModelRunner

pytestmark = pytest.mark.ray

NODE_DIR = Path(__file__).parents[1] / "node"
STORY = [{"role": "user", "content": "Tell me a story."}]
Q1, Q2 = "What is 47 * 12?", "And 5 + 6?"


@pytest.fixture(scope="module")
def served(tool_checkpoint, tmp_path_factory):
    log = tmp_path_factory.mktemp("serve") / "serve.log"
    with ServeProcess(tool_checkpoint, args=["--stream-interval", "2"], log=log) as server:
        yield server


@pytest.fixture(scope="module")
def expected(tool_checkpoint) -> dict:
    """What the served model must answer, computed in-process from the same checkpoint."""
    model, tokenizer, _ = load_model(tool_checkpoint)
    runner = ModelRunner(model, tokenizer)
    prompt = render_for_completion(tokenizer, STORY)

    def visible(max_tokens: int) -> str:
        result = runner.generate_batch([prompt], max_tokens=max_tokens, temperature=0)[0]
        return "".join(
            text for kind, text in turn_parts(tokenizer, result.completion_tokens) if kind == "text"
        )

    story5, story40 = visible(5), visible(40)
    assert "upon" in story40
    ids, logprobs = list(prompt), []
    with torch.no_grad():
        for _ in range(3):
            lp = torch.log_softmax(model(torch.tensor([ids]))[0, -1].float(), -1)
            best = int(lp.argmax())
            logprobs.append(
                {"bytes": list(b"".join(tokenizer.iter_tokens([best]))), "logprob": float(lp[best])}
            )
            ids.append(best)
    return {"model": str(tool_checkpoint), "story5": story5, "story_tokens": len(prompt),
            "context": model.config.max_seq_len, "story_before_upon": story40[: story40.index("upon")],
            "logprobs": logprobs}  # fmt: skip


def test_openai_python_client(served, expected):
    client = openai.OpenAI(base_url=f"{served.url}/v1", api_key="unused", max_retries=0)
    model = expected["model"]
    assert [m.id for m in client.models.list()] == [model]
    # the id is the checkpoint's absolute path: the client sends each "/" as %2F, through Serve's proxy
    assert client.models.retrieve(model).model_dump() == client.models.list().data[0].model_dump()
    with pytest.raises(openai.NotFoundError) as missing:
        client.models.retrieve(f"{model}/other")
    assert (missing.value.code, missing.value.param) == ("model_not_found", "model")
    for limit in ({"max_completion_tokens": 5}, {"max_tokens": 5}):
        reply = client.chat.completions.create(model=model, messages=STORY, temperature=0, **limit)
        assert reply.choices[0].message.content == expected["story5"]
        assert reply.choices[0].finish_reason == "length" and reply.usage.completion_tokens == 5
    stopped = client.chat.completions.create(model=model, messages=STORY, temperature=0, stop="upon")
    assert stopped.choices[0].message.content == expected["story_before_upon"]
    assert stopped.choices[0].finish_reason == "stop"
    chunks = list(client.chat.completions.create(model=model, messages=STORY, temperature=0, max_tokens=5,
                                                 stream=True, stream_options={"include_usage": True}))  # fmt: skip
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == expected["story5"]
    assert chunks[-1].usage.completion_tokens == 5

    # a completion budget the context cannot hold after the prompt: OpenAI's 400, raised by the client
    # (streaming too: the status comes before any chunk), naming the field sent and the numbers
    n, ctx = expected["story_tokens"], expected["context"]
    over = ctx - n + 1
    for create, kw, param, tokens in [
        (client.chat.completions.create, {"messages": STORY, "max_tokens": over}, "max_tokens", n),
        (client.chat.completions.create, {"messages": STORY, "max_completion_tokens": over, "stream": True},
         "max_completion_tokens", n),
        (client.completions.create, {"prompt": [1] * 10, "max_tokens": ctx - 9}, "max_tokens", 10),
    ]:  # fmt: skip
        with pytest.raises(openai.BadRequestError) as err:
            create(model=model, **kw)
        assert (err.value.status_code, err.value.code, err.value.param) == (
            400,
            "context_length_exceeded",
            param,
        )
        room = ctx - tokens
        assert f"the model's context length is {ctx} tokens" in err.value.message
        assert f"({tokens} + {room + 1} > {ctx}): at most {room} fit" in err.value.message

    def sample(seed, **kw):
        r = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "xyzzy"}],
                                           temperature=2, seed=seed, max_completion_tokens=12, **kw)  # fmt: skip
        return [c.message.content for c in r.choices]

    assert sample(7) == sample(7) != sample(8)
    assert sample(7, n=3)[0] == sample(7)[0] and len(set(sample(7, n=3))) == 3

    lp_body = {
        "model": model,
        "messages": STORY,
        "temperature": 0,
        "max_tokens": 3,
        "logprobs": True,
        "top_logprobs": 2,
    }
    content = client.chat.completions.create(**lp_body).choices[0].logprobs.content
    assert [c.bytes for c in content] == [e["bytes"] for e in expected["logprobs"]]
    assert [c.logprob for c in content] == pytest.approx(
        [e["logprob"] for e in expected["logprobs"]], abs=1e-4
    )

    # the calculator: the returned message object itself goes back into the history
    messages = [{"role": "user", "content": Q1}]
    first = client.chat.completions.create(model=model, messages=messages, temperature=0).choices[0].message
    assert first.content == "Let me compute it. #### 564"
    call = first.tool_calls[0]
    assert call.function.name == "calculator" and json.loads(call.function.arguments) == {
        "expression": "47 * 12"
    }
    assert call.model_extra["raychat"] == {"offset": 19, "output": "564"}
    messages += [first, {"role": "user", "content": Q2}]
    second = client.chat.completions.create(model=model, messages=messages, temperature=0).choices[0].message
    assert (
        second.content == "Let me compute it. #### 11"
        and second.tool_calls[0].model_extra["raychat"]["output"] == "11"
    )

    # function calling: the client declares and runs the calculator
    tools = [{"type": "function", "function": {"name": "calculator", "parameters": {"type": "object"}}}]
    messages = [{"role": "user", "content": Q1}]
    step = client.chat.completions.create(model=model, messages=messages, temperature=0, tools=tools)
    assert step.choices[0].finish_reason == "tool_calls"
    call = step.choices[0].message.tool_calls[0]
    messages += [step.choices[0].message, {"role": "tool", "tool_call_id": call.id, "content": str(47 * 12)}]
    done = client.chat.completions.create(model=model, messages=messages, temperature=0, tools=tools)
    assert done.choices[0].message.content == "#### 564"

    for bad, param in [({"temperature": 3}, "temperature"), ({"presence_penalty": 0.5}, "presence_penalty"),
                       ({"logit_bias": {"5": 1}}, "logit_bias"), ({"n": 9}, "n")]:  # fmt: skip
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(model=model, messages=STORY, **bad)
        assert e.value.param == param and e.value.message.startswith(
            f"Error code: 400 - {{'error': {{'message': '{param}: "
        )
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="gpt-4", messages=STORY)


def test_openai_node_client(served, expected, tmp_path):
    node = shutil.which("node")
    if node is None:  # `make test` installs the client with npm, so under it (and in CI) node is there
        (pytest.fail if os.environ.get("CI") else pytest.skip)("needs Node.js (node) on PATH")
    if not (NODE_DIR / "node_modules" / "openai").is_dir():
        pytest.fail(
            "the openai Node client is not installed: run `make test-deps` (npm ci --prefix tests/node)"
        )
    path = tmp_path / "expected.json"
    path.write_text(json.dumps(expected))
    run = subprocess.run([node, str(NODE_DIR / "contract.mjs"), served.url, str(path)],
                         capture_output=True, text=True, timeout=300)  # fmt: skip
    assert run.returncode == 0, f"{run.stdout}\n{run.stderr}\nserver log:\n{served.log_tail()}"
    assert run.stdout.count("\nok ") + run.stdout.startswith("ok ") == 10, run.stdout


# ---- schemathesis against the served schema ---------------------------------------------------------------
CHECKS = [not_a_server_error, status_code_conformance, content_type_conformance, response_schema_conformance,
          negative_data_rejection]  # fmt: skip
OPERATIONS = [
    ("POST", "/v1/chat/completions"),
    ("POST", "/chat/completions"),
    ("GET", "/v1/models"),
    ("GET", "/v1/models/{model}"),
    ("GET", "/health"),
]
EXAMPLES = 30


@pytest.mark.parametrize("mode", [GenerationMode.POSITIVE, GenerationMode.NEGATIVE], ids=lambda m: m.value)
def test_schemathesis_fuzzing(served, mode):
    """Every generated request answered without a 5xx, in the documented status codes, content types and
    schemas (a 4xx body is the error shape: the schema documents ErrorResponse for every error status; a
    200 JSON body is openai's ChatCompletion), schema-invalid requests rejected; then the server still
    answers. Requests go through httpx: schemathesis' requests transport fails on the urllib3-future that
    grafana-client's niquests installs over urllib3."""
    schema = schemathesis.openapi.from_dict(httpx.get(f"{served.url}/openapi.json", timeout=30).json())
    codes: dict[int, int] = {}
    for method, path in OPERATIONS:
        if mode is GenerationMode.NEGATIVE and method == "GET":
            continue  # no parameters to get wrong (a model id is any string)

        @given(case=schema[path][method].as_strategy(generation_mode=mode))
        @settings(max_examples=EXAMPLES, deadline=None, derandomize=True, database=None,
                  suppress_health_check=list(HealthCheck), phases=[Phase.explicit, Phase.generate])  # fmt: skip
        def fuzz(case):
            kwargs = case.as_transport_kwargs(base_url=served.url)
            response = httpx.request(kwargs["method"], kwargs["url"], headers=kwargs.get("headers"),
                                     params=kwargs.get("params"), json=kwargs.get("json"),
                                     content=kwargs.get("data"), timeout=120)  # fmt: skip
            codes[response.status_code] = codes.get(response.status_code, 0) + 1
            case.validate_response(response, checks=CHECKS, transport_kwargs=kwargs)

        fuzz()
    print(f"{mode.value}: status codes {dict(sorted(codes.items()))}")
    assert not any(code >= 500 for code in codes)
    health = httpx.get(f"{served.url}/health", timeout=30)
    assert health.status_code == 200 and health.json()["engine"]["in_flight"] == 0
    deadline = time.monotonic() + 60
    while (stats := httpx.get(f"{served.url}/health").json()["engine"])[
        "running"
    ] and time.monotonic() < deadline:
        time.sleep(0.2)
    assert stats["free_rows"] == stats["max_slots"]
    reply = httpx.post(f"{served.url}/v1/chat/completions", json={"messages": STORY, "temperature": 0, "max_tokens": 5}, timeout=60)  # fmt: skip
    assert reply.status_code == 200 and reply.json()["usage"]["completion_tokens"] == 5


def test_readme_tool_call_example_runs_as_written(served):
    """README's "A calculator call, as an OpenAI client receives it": its command (the server's address and
    the interpreter substituted) prints the JSON shown below it, up to the call's random id."""
    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    section = readme[readme.index("### A calculator call, as an OpenAI client receives it") :]
    command = section[section.index("```bash\n") + 8 : section.index("\n```\n")]
    shown = section[section.index("```json\n") + 8 :]
    shown = json.loads(shown[: shown.index("\n```")])
    command = command.replace("RAYCHAT_URL=http://127.0.0.1:8000", f"RAYCHAT_URL={served.url}")
    command = command.replace(".venv/bin/python", sys.executable)
    run = subprocess.run(["bash", "-c", command], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    printed = json.loads(run.stdout)
    call_id = printed["tool_calls"][0]["id"]
    assert re.fullmatch(r"call_[0-9a-f]{24}", call_id)
    shown["tool_calls"][0]["id"] = call_id
    assert printed == shown


def _serve_counts(metrics_url: str) -> tuple[float, float]:
    """(TTFT observations, generated tokens) summed over the replicas in the node's Prometheus text."""
    from prometheus_client.parser import text_string_to_metric_families

    body = httpx.get(metrics_url, timeout=10).text
    counts = {"ray_raychat_serve_ttft_seconds_count": 0.0, "ray_raychat_serve_generated_tokens_total": 0.0}
    for family in text_string_to_metric_families(body):
        for sample in family.samples:
            if sample.name in counts:
                counts[sample.name] += sample.value
    return counts["ray_raychat_serve_ttft_seconds_count"], counts["ray_raychat_serve_generated_tokens_total"]


def _settled_counts(metrics_url: str, quiet_s: float = 15.0, within_s: float = 90.0) -> tuple[float, float]:
    """_serve_counts once they have not moved for `quiet_s` seconds (longer than Ray's 10 s metrics export
    interval): the earlier tests' requests on this server are all exported by then (seen: a CI run's counts
    still rising by 3 TTFTs and 44 tokens after this test's request)."""
    counts, since, deadline = _serve_counts(metrics_url), time.monotonic(), time.monotonic() + within_s
    while time.monotonic() - since < quiet_s:
        assert time.monotonic() < deadline, f"serve counts still moving after {within_s:g} s: {counts}"
        time.sleep(1)
        if (now := _serve_counts(metrics_url)) != counts:
            counts, since = now, time.monotonic()
    return counts


def test_the_printed_metrics_url_counts_a_request(served):
    """`raychat serve` prints the Prometheus endpoint of its node (a port Ray picks: a vLLM user's /metrics on
    the API port is not there): one streamed request of 5 tokens adds one TTFT observation and 5 generated
    tokens to what it serves (Ray exports every few seconds, so it is polled)."""
    line, deadline = re.compile(r"^metrics: +(http://\S+/metrics)  \(Prometheus", re.M), time.monotonic() + 30
    while not (found := line.search(served.log_tail(200))) and time.monotonic() < deadline:
        time.sleep(0.5)  # /health answers a moment before `raychat serve` prints its lines
    assert found, served.log_tail(200)
    # Ray Serve's reconnect line of serve.run, although --port applied (raychat.serve.cli.drop_reconnect_line)
    log = served.log_tail(200)
    assert "will not be applied" not in log and f"Application 'raychat' is ready at {served.url}/" in log, log
    ttft, tokens = _settled_counts(found[1])
    client = openai.OpenAI(base_url=f"{served.url}/v1", api_key="unused", max_retries=0)
    model = client.models.list().data[0].id
    chunks = list(client.chat.completions.create(messages=STORY, model=model, temperature=0, max_tokens=5,
                                                 stream=True, stream_options={"include_usage": True}))  # fmt: skip
    assert chunks[-1].usage.completion_tokens == 5
    deadline = time.monotonic() + 60
    while (now := _serve_counts(found[1])) != (ttft + 1, tokens + 5) and time.monotonic() < deadline:
        time.sleep(1)
    assert now == (ttft + 1, tokens + 5)
