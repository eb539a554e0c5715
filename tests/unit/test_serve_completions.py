"""POST /v1/completions (OpenAI legacy Completions) on the real engine in-process (no Ray): prompt logprobs
equal to a direct forward's log_softmax (hand-worked on a stub model, and on a tiny GPT), echo, max_tokens 0,
token-array and batched prompts as lm_eval sends them, greedy text equal to generate_batch, stop strings,
streaming, the openai client, bad requests answered 400 naming the field, auth, and a poisoned request
failing alone."""

from __future__ import annotations

import json
import math

import pytest
import torch
from fastapi.testclient import TestClient
from lm_eval.models.openai_completions import LocalCompletionsAPI
from openai import OpenAI
from openai.types import Completion
from support.engine_fixtures import PoisonModel, byte_tokenizer, uniform_two_token_model
from support.serve_helpers import tiny_model_and_tokenizer

from raychat.engine import ModelRunner
from raychat.engine.scoring import prompt_logprobs
from raychat.serve.errors import INTERNAL_ERROR
from raychat.serve.ingress import LocalClient, create_app
from raychat.serve.server import ChatServer
from raychat.serve.sse import parse_sse

URL = "/v1/completions"
LN_HALF = math.log(0.5)


@pytest.fixture(scope="module")
def tiny():
    return tiny_model_and_tokenizer()


@pytest.fixture(scope="module")
def client(tiny):
    engine = ChatServer(*tiny, max_slots=4, model_id="tiny")
    yield TestClient(create_app(LocalClient(engine)))
    engine.shutdown()


def direct_logprobs(model, ids: list[int]) -> list[float]:
    """ln p(ids[i] | ids[:i]) for i >= 1 from one plain forward of the model."""
    with torch.no_grad():
        logp = torch.log_softmax(model(torch.tensor([ids]))[0].float(), dim=-1)
    return [float(logp[i - 1, ids[i]]) for i in range(1, len(ids))]


def test_prompt_logprobs_hand_worked_on_two_token_model():
    # every position: logits 0 for tokens 7 and 9, -inf elsewhere -> p = 1/2 each, 0 for the rest
    model = uniform_two_token_model(16, 7, 9)
    out = prompt_logprobs(model, [7, 9, 7, 3], top_logprobs=2)
    assert out[0] is None
    assert [e.token_id for e in out[1:]] == [9, 7, 3]
    assert [e.logprob for e in out[1:3]] == pytest.approx([LN_HALF, LN_HALF])
    assert out[3].logprob == float("-inf")  # token 3 has probability 0
    assert sorted(t for t, _ in out[1].top_logprobs) == [7, 9]
    assert [lp for _, lp in out[1].top_logprobs] == pytest.approx([LN_HALF, LN_HALF])
    with pytest.raises(ValueError, match="ids is empty"):
        prompt_logprobs(model, [])


def test_prompt_logprobs_equal_direct_forward(tiny):
    model, tokenizer = tiny
    ids = tokenizer.encode("def dumps(obj, *, skipkeys=False):")
    out = ModelRunner(model, tokenizer).prompt_logprobs(ids, top_logprobs=3)
    assert [e.logprob for e in out[1:]] == pytest.approx(direct_logprobs(model, ids), abs=1e-5)
    with torch.no_grad():
        logp = torch.log_softmax(model(torch.tensor([ids]))[0].float(), dim=-1)
    top = torch.topk(logp[0], 3)
    assert [t for t, _ in out[1].top_logprobs] == top.indices.tolist()


def test_echo_logprobs_max_tokens_0(tiny, client):
    model, tokenizer = tiny
    text = "class JSONEncoder(object):"
    ids = tokenizer.encode(text)
    body = client.post(URL, json={"prompt": text, "max_tokens": 0, "echo": True, "logprobs": 2}).json()
    choice = body["choices"][0]
    assert choice["text"] == text and choice["finish_reason"] == "length"
    lp = choice["logprobs"]
    assert "".join(lp["tokens"]) == text and len(lp["tokens"]) == len(ids)
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    assert lp["token_logprobs"][1:] == pytest.approx(direct_logprobs(model, ids), abs=1e-5)
    # the token itself plus the 2 most likely: 2 or 3 entries, the largest one the argmax
    assert all(2 <= len(top) <= 3 for top in lp["top_logprobs"][1:])
    assert lp["text_offset"] == [sum(len(t) for t in lp["tokens"][:i]) for i in range(len(ids))]
    assert body["usage"] == {"prompt_tokens": len(ids), "completion_tokens": 0, "total_tokens": len(ids),
                             "prompt_tokens_details": {"cached_tokens": 0}}  # fmt: skip


def test_lm_eval_shaped_request(tiny, client):
    """What lm_eval's local-completions sends for loglikelihood: a batch of token arrays, echo, logprobs 1,
    max_tokens 1, temperature 0; it reads token_logprobs[ctxlen:-1] and checks greediness in top_logprobs."""
    model, tokenizer = tiny
    a, b = tokenizer.encode("import json"), tokenizer.encode("return self")
    body = {"prompt": [a, b], "max_tokens": 1, "echo": True, "logprobs": 1, "temperature": 0, "seed": 1234,
            "model": "tiny"}  # fmt: skip
    out = client.post(URL, json=body).json()
    assert [c["index"] for c in out["choices"]] == [0, 1]
    for ids, choice in zip([a, b], out["choices"]):
        lp = choice["logprobs"]
        assert len(lp["token_logprobs"]) == len(ids) + 1  # the prompt's tokens, then the generated one
        assert lp["token_logprobs"][1 : len(ids)] == pytest.approx(direct_logprobs(model, ids), abs=1e-5)
        greedy = lp["top_logprobs"][-1]
        assert lp["token_logprobs"][-1] == pytest.approx(max(greedy.values()))  # temperature 0: the argmax


def test_lm_eval_reads_the_continuation_when_the_model_ends_on_bos():
    """A base model often predicts <|bos|> (a new document) after the continuation: the row ends on it and
    its text is never sent, but its entry is, as vLLM and OpenAI list the end token. lm_eval's own parser
    sums token_logprobs[ctxlen:-1]; without the end token's entry it dropped the continuation's last token
    (-11.9 for -46.8 here)."""
    model, tokenizer = tiny_model_and_tokenizer(seed=3)
    context, continuation = tokenizer.encode("import json"), tokenizer.encode(" return self")
    ids = context + continuation
    hidden = {}
    hook = model.model.norm.register_forward_hook(lambda m, i, o: hidden.setdefault("h", o[0, -1].clone()))
    with torch.no_grad():
        model(torch.tensor([ids]))
        hook.remove()
        h = hidden["h"]
        model.lm_head.weight[tokenizer.bos_id] = 60.0 * h / h.dot(h)  # logit 60 for <|bos|> after `ids`
    want = sum(direct_logprobs(model, ids)[len(context) - 1 :])
    engine = ChatServer(model, tokenizer, max_slots=2, model_id="tiny")
    try:
        body = {
            "prompt": [ids],
            "max_tokens": 1,
            "echo": True,
            "logprobs": 1,
            "temperature": 0,
            "model": "tiny",
        }
        out = TestClient(create_app(LocalClient(engine))).post(URL, json=body).json()
    finally:
        engine.shutdown()
    choice = out["choices"][0]
    assert (choice["text"], choice["finish_reason"], out["usage"]["completion_tokens"]) == (
        tokenizer.decode(ids), "stop", 1)  # fmt: skip
    assert choice["logprobs"]["tokens"][-1] == "<|bos|>" and len(choice["logprobs"]["token_logprobs"]) == 7
    [(loglikelihood, _)] = LocalCompletionsAPI.parse_logprobs(out, ctxlens=[len(context)])
    assert loglikelihood == pytest.approx(want, abs=1e-4)


def test_greedy_text_equals_generate_batch_and_stop(tiny, client):
    model, tokenizer = tiny
    ids = tokenizer.encode("def loads(s")
    expected = ModelRunner(model, tokenizer).generate_batch([ids], max_tokens=12, temperature=0)[0]
    body = client.post(URL, json={"prompt": ids, "max_tokens": 12, "temperature": 0}).json()
    choice = body["choices"][0]
    Completion.model_validate(body)
    assert choice["text"] == expected.text and choice["logprobs"] is None
    assert body["usage"]["completion_tokens"] == len(expected.completion_tokens)
    stop = expected.text[3:6]
    stopped = client.post(URL, json={"prompt": ids, "max_tokens": 12, "temperature": 0, "stop": stop}).json()
    assert stopped["choices"][0]["text"] == expected.text[: expected.text.index(stop)]
    assert stopped["choices"][0]["finish_reason"] == "stop"


def test_logprobs_end_where_a_stop_string_ends_the_text(client):
    """A completion's logprobs cover the text a stop string leaves and nothing past it, streamed or not: the
    token the stop string cuts keeps its entry; the tokens after it were sent too, text_offset past the text."""
    body = {"prompt": "Tell me about json.", "temperature": 0, "max_tokens": 16, "logprobs": 1}
    full = client.post(URL, json=body).json()["choices"][0]
    assert full["text"].startswith("ss\ufffd'Fdth\u03a1\ufffd\ufffd [object used")
    assert full["logprobs"]["tokens"][9:12] == [" [", "object", " used"]
    stopped = client.post(URL, json={**body, "stop": "bject u"}).json()["choices"][0]
    assert stopped["text"] == "ss\ufffd'Fdth\u03a1\ufffd\ufffd [o" and stopped["finish_reason"] == "stop"
    expected = {k: v[:11] for k, v in full["logprobs"].items()}  # up to "object", which the stop cuts
    assert stopped["logprobs"] == expected
    resp = client.post(URL, json={**body, "stop": "bject u", "stream": True})
    chunks = [json.loads(c)["choices"][0] for c in parse_sse(resp.text) if c != "[DONE]"]
    assert [t for c in chunks if c["logprobs"] for t in c["logprobs"]["tokens"]] == expected["tokens"]


def test_stream_equals_non_stream(client):
    req = {"prompt": "import re", "max_tokens": 8, "temperature": 0, "echo": True, "logprobs": 0}
    whole = client.post(URL, json=req).json()["choices"][0]
    resp = client.post(URL, json={**req, "stream": True, "stream_options": {"include_usage": True}})
    events = parse_sse(resp.text)
    assert resp.headers["content-type"].startswith("text/event-stream") and events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    # openai's type wants a finish_reason (null until a choice's last chunk, as OpenAI streams it) and no
    # null logprob (the echoed prompt's first token has none): validate the chunks that have neither
    Completion.model_validate(chunks[-2])
    Completion.model_validate(chunks[-1])
    # with include_usage every chunk has "usage": null but the last (OpenAI's stream_options documentation)
    assert all(set(c) == set(chunks[-1]) and c["usage"] is None for c in chunks[:-1])
    texts = [c["choices"][0]["text"] for c in chunks if c["choices"]]
    assert "".join(texts) == whole["text"]
    logprobs = [x for c in chunks if c["choices"] and c["choices"][0]["logprobs"] for x in
                c["choices"][0]["logprobs"]["token_logprobs"]]  # fmt: skip
    assert logprobs == whole["logprobs"]["token_logprobs"]
    assert chunks[-2]["choices"][0]["finish_reason"] == whole["finish_reason"]
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] >= 1


def test_openai_client(tiny, client):
    model, tokenizer = tiny
    ids = tokenizer.encode("textwrap.fill")
    openai = OpenAI(base_url="http://testserver/v1", api_key="unused", http_client=client)
    out = openai.completions.create(model="tiny", prompt=ids, max_tokens=0, echo=True, logprobs=1)
    assert out.choices[0].text == tokenizer.decode(ids)
    assert out.choices[0].logprobs.token_logprobs[1:] == pytest.approx(direct_logprobs(model, ids), abs=1e-5)
    # a vLLM user's extra_body at vLLM's defaults changes nothing
    vllm = {"min_p": 0.0, "repetition_penalty": 1.0, "min_tokens": 0, "ignore_eos": False, "stop_token_ids": [],
            "include_stop_str_in_output": False, "top_k": -1}  # fmt: skip
    greedy = {"model": "tiny", "prompt": ids, "max_tokens": 6, "temperature": 0, "logprobs": 1}
    plain, same = (openai.completions.create(**greedy, extra_body=extra) for extra in (None, vllm))
    assert same.choices[0].text == plain.choices[0].text and same.usage.completion_tokens == 6
    assert same.choices[0].logprobs.token_logprobs == plain.choices[0].logprobs.token_logprobs


@pytest.mark.parametrize(
    ("body", "param", "fragment"),
    [
        ({"max_tokens": 1}, "prompt", "field required"),
        ({"prompt": "x", "max_tokens": -1}, "max_tokens", "greater than or equal to 0"),
        ({"prompt": "x", "logprobs": 6}, "logprobs", "less than or equal to 5"),
        ({"prompt": "x", "n": 2}, "n", "Input should be 1"),
        ({"prompt": ""}, "prompt", "is empty"),
        ({"prompt": []}, "prompt", "non-empty"),
        ({"prompt": [[5], "a"]}, "prompt", "list of strings or a list of token-id lists"),
        ({"prompt": [[5], [599, 600]]}, "prompt[1]", "outside 0..599"),
        ({"prompt": [5] * 300}, "prompt", "300 tokens"),
        # max_tokens 0 never reaches the engine: the prompt is checked all the same (echo decodes it)
        ({"prompt": [99999], "max_tokens": 0}, "prompt", "outside 0..599: [99999]"),
        ({"prompt": [-5], "max_tokens": 0, "echo": True}, "prompt", "outside 0..599: [-5]"),
        ({"prompt": [2**70], "max_tokens": 0, "echo": True}, "prompt", "outside 0..599"),
        ({"prompt": [5] * 300, "max_tokens": 0, "echo": True}, "prompt", "300 tokens"),
        ({"prompt": "a\ud800b", "echo": True}, "prompt", "lone surrogate (U+D800) at character 1"),
        ({"prompt": ["a", "\udfff"]}, "prompt", "prompt[1] has a lone surrogate (U+DFFF) at character 0"),
        ({"prompt": "x", "stream_options": {"include_usage": True}}, "stream_options", "only allowed when"),
        ({"prompt": "x", "suffix": "y"}, "suffix", "not supported"),
        ({"prompt": "x", "temperature": "0"}, "temperature", "valid number"),
        ({"prompt": "x", "best_of": 3}, "best_of", "Input should be 1"),
        (
            {"prompt": "x", "ignore_eos": True},
            "ignore_eos",
            "not supported by raychat; only null or false is accepted",
        ),
        ({"prompt": "x", "repetition_penalty": 1.2}, "repetition_penalty", "only null or 1 is accepted"),
        # an echoed prompt of ids keeps its control tokens as text: vLLM's default (skip them) is not this route's
        ({"prompt": "x", "skip_special_tokens": True}, "skip_special_tokens", "unknown field"),
    ],
)
def test_bad_requests_name_the_field(client, body, param, fragment):
    # json.dumps escapes a lone surrogate as \udXXX, as a JSON client sends it (httpx's json= cannot encode it)
    resp = client.post(URL, content=json.dumps(body), headers={"content-type": "application/json"})
    assert resp.status_code == 400, resp.text
    err = resp.json()["error"]
    assert err["param"] == param and fragment in err["message"], err
    assert err["message"].startswith(f"{param}: ")


def test_a_prompt_over_the_context_is_context_length_exceeded(client):
    """OpenAI's code, as chat's over-long conversation has it (a client or harness drops or truncates on it)."""
    for body, param in [
        ({"prompt": [5] * 300}, "prompt"),
        ({"prompt": [[5], [5] * 300]}, "prompt[1]"),
        ({"prompt": [5] * 300, "max_tokens": 0, "echo": True, "logprobs": 0}, "prompt"),
    ]:
        err = client.post(URL, json=body).json()["error"]
        assert (err["code"], err["param"]) == ("context_length_exceeded", param), err
        assert err["message"] == (
            f"{param}: the prompt has 300 tokens, but the model's context length is 256 tokens and at least 1 "
            "completion token must follow (300 + 1 > 256): at most 255 fit"
        )
    assert client.post(URL, json={"prompt": [5, 600]}).json()["error"]["code"] is None  # not about length


def test_auth_and_unknown_model(tiny):
    engine = ChatServer(*tiny, max_slots=1, model_id="tiny")
    try:
        client = TestClient(create_app(LocalClient(engine), api_key="k"))
        assert client.post(URL, json={"prompt": "x", "max_tokens": 1}).status_code == 401
        ok = client.post(URL, json={"prompt": "x", "max_tokens": 1}, headers={"Authorization": "Bearer k"})
        assert ok.status_code == 200
        other = client.post(URL, json={"prompt": "x", "model": "gpt"}, headers={"Authorization": "Bearer k"})
        assert other.status_code == 404 and other.json()["error"]["param"] == "model"
    finally:
        engine.shutdown()


def test_poisoned_scoring_fails_alone():
    """A prompt whose logits are NaN (token 66 poisons its row) is a 500 naming only a request id; the
    engine goes on: a clean prompt scored after it gets its hand-worked logprobs (token 65 certain: logit
    5 against -5 for the 258 others -> ln(e^5 / (e^5 + 258 e^-5)); greedy: sampled at temperature 1, another
    token comes 1.2% of the time)."""
    tokenizer = byte_tokenizer()
    engine = ChatServer(PoisonModel(tokenizer.vocab_size, 65, 66, "nan"), tokenizer, max_slots=2)
    try:
        client = TestClient(create_app(LocalClient(engine)))
        bad = client.post(URL, json={"prompt": [65, 66, 65], "max_tokens": 0, "echo": True, "logprobs": 0})
        assert bad.status_code == 500 and bad.json()["error"]["message"].startswith(INTERNAL_ERROR)
        good = client.post(
            URL, json={"prompt": [65, 65], "max_tokens": 1, "echo": True, "logprobs": 0, "temperature": 0}
        )
        assert good.status_code == 200
        expected = 5 - math.log(math.exp(5) + (tokenizer.vocab_size - 1) * math.exp(-5))
        assert good.json()["choices"][0]["logprobs"]["token_logprobs"] == pytest.approx(
            [None, expected, expected], abs=1e-6
        )
    finally:
        engine.shutdown()


def test_max_tokens_beyond_the_context_is_context_length_exceeded(client):
    """A 250-token prompt leaves 6 of the 256: max_tokens 7 was accepted and cut short at 6 ("length"); now a
    400 naming max_tokens and the numbers (the prompt of a batch by its index), streaming or not. Not given,
    max_tokens is 16 (OpenAI's default), or the 6 the row leaves."""
    for body, prompt in [
        ({"prompt": [5] * 250, "max_tokens": 7}, "the prompt"),
        ({"prompt": [[5], [5] * 250], "max_tokens": 7, "stream": True}, "prompt[1]"),
        ({"prompt": [5] * 250, "max_tokens": 7, "echo": True, "logprobs": 1}, "the prompt"),
    ]:
        resp = client.post(URL, json=body)
        assert resp.status_code == 400, resp.text
        assert resp.json()["error"] == {
            "message": f"max_tokens: 7 completion tokens requested, but the model's context length is 256 tokens "
            f"and {prompt} has 250 (250 + 7 > 256): at most 6 fit",
            "type": "invalid_request_error", "param": "max_tokens", "code": "context_length_exceeded",
        }  # fmt: skip
    for body, completion_tokens in [
        ({"prompt": [5] * 250, "max_tokens": 6}, 6),
        ({"prompt": [5] * 250}, 6),
        ({"prompt": [5] * 10}, 16),
        ({"prompt": [5] * 255, "max_tokens": 0, "echo": True}, 0),
    ]:
        resp = client.post(URL, json={**body, "temperature": 0})
        assert resp.status_code == 200, resp.text
        usage = resp.json()["usage"]
        assert (usage["prompt_tokens"], usage["completion_tokens"]) == (
            len(body["prompt"]),
            completion_tokens,
        )
        assert resp.json()["choices"][0]["finish_reason"] == "length"


def test_a_batch_is_checked_whole_before_any_prompt_reaches_the_engine(tiny):
    """A batch whose prompt[1] is refused was a 400, but prompt[0] had been submitted (and scored, with echo
    and logprobs) before its sibling's refusal came back and the ingress cancelled it. Now every prompt is
    checked first (ChatServer.check, one rejection per request), so a refused batch costs the engine nothing:
    the spies on Scheduler.submit and .score see nothing until a batch that passes."""
    model, tok = tiny
    engine = ChatServer(model, tok, max_slots=2, model_id="tiny")
    work = []
    submit, score = engine.scheduler.submit, engine.scheduler.score
    engine.scheduler.submit = lambda ids, *a, **kw: (
        work.append(("submit", list(ids))) or submit(ids, *a, **kw)
    )
    engine.scheduler.score = lambda ids, *a, **kw: work.append(("score", list(ids))) or score(ids, *a, **kw)
    over = (
        "prompt[1]: the prompt has 300 tokens, but the model's context length is 256 tokens and at least 1 "
        "completion token must follow (300 + 1 > 256): at most 255 fit"
    )
    budget = (
        "max_tokens: 7 completion tokens requested, but the model's context length is 256 tokens and prompt[1] "
        "has 250 (250 + 7 > 256): at most 6 fit"
    )
    try:
        client = TestClient(create_app(LocalClient(engine)))
        for body, message, param, code in [
            ({"prompt": [[5] * 3, [5] * 300]}, over, "prompt[1]", "context_length_exceeded"),
            ({"prompt": [[5] * 3, [5] * 300], "echo": True, "logprobs": 1}, over, "prompt[1]",
             "context_length_exceeded"),
            ({"prompt": [[5] * 3, [5] * 250], "max_tokens": 7, "stream": True}, budget, "max_tokens",
             "context_length_exceeded"),
            ({"prompt": [[5] * 3, [5, 600]]}, f"prompt[1]: has token ids outside 0..{tok.vocab_size - 1}: [600]",
             "prompt[1]", None),
        ]:  # fmt: skip
            resp = client.post(URL, json={**body, "temperature": 0})
            assert resp.status_code == 400, resp.text
            assert resp.json()["error"] == {
                "message": message, "type": "invalid_request_error", "param": param, "code": code
            }  # fmt: skip
        assert work == [] and engine.stats()["rejected"] == 4
        ok = client.post(URL, json={"prompt": [[5] * 3, [5] * 4], "max_tokens": 2, "temperature": 0})
        assert ok.status_code == 200, ok.text
        assert sorted(work) == [("submit", [5] * 3), ("submit", [5] * 4)]
        assert engine.stats()["rejected"] == 4
    finally:
        engine.shutdown()
