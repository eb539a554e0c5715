"""ModelRunner: KV-cache greedy == no-cache loop, mixed-length batches, independent samples, tool use, budget."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from support.engine_fixtures import (
    byte_tokenizer,
    reference_greedy,
    scripted_model,
    tiny_gpt,
    uniform_two_token_model,
)

from raychat.engine import KVBudgetError, KVCache, ModelRunner


@pytest.fixture(scope="module")
def tok():
    return byte_tokenizer()


@pytest.fixture(scope="module")
def model(tok):
    return tiny_gpt(tok)


def stop_ids(tok):
    return {tok.special_id("<|assistant_end|>"), tok.bos_id}


def test_greedy_equals_no_cache_reference(tok, model):
    prompt = [tok.bos_id, *tok.encode("hello there")]
    ref = reference_greedy(model, prompt, 24, stop_ids(tok))
    assert len(ref) == 24  # special tokens have logit 0 and never win: the run is 24 tokens long
    (res,) = ModelRunner(model, tok).generate_batch([prompt], max_tokens=24, temperature=0.0)
    assert res.completion_tokens == ref
    assert res.tokens[: len(prompt)] == prompt
    assert res.mask == [0] * len(prompt) + [1] * 24
    assert res.finish_reason == "length"
    assert res.text == tok.decode(ref)


def test_mixed_length_batch_equals_alone(tok, model):
    prompts = [[tok.bos_id, *tok.encode(s)] for s in ("a", "the quick brown fox", "1+1=", "xyzzy plugh")]
    engine = ModelRunner(model, tok)
    batch = engine.generate_batch(prompts, num_samples=2, max_tokens=12, temperature=0.0)
    assert [(r.prompt_index, r.sample_index) for r in batch] == [(i, j) for i in range(4) for j in range(2)]
    for i, p in enumerate(prompts):
        (alone,) = engine.generate_batch([p], max_tokens=12, temperature=0.0)
        assert alone.completion_tokens == reference_greedy(model, p, 12, stop_ids(tok))
        for j in range(2):
            assert batch[2 * i + j].tokens == alone.tokens


def test_stub_row_stops_cost_no_compute(tok):
    # row 0 stops at once (assistant_end), row 1 runs 3 tokens: the decode forwards carry only row 1.
    end = tok.special_id("<|assistant_end|>")
    a = ord("a")
    model = scripted_model(tok.vocab_size, {2: end, 4: a, 5: a, 6: a}, default=a)
    prompts = [[tok.bos_id, a], [tok.bos_id, a, a, a]]
    res = ModelRunner(model, tok).generate_batch(prompts, max_tokens=3, temperature=0.0)
    assert res[0].completion_tokens == [end] and res[0].finish_reason == "stop"
    assert res[0].text == ""
    assert res[1].completion_tokens == [a, a, a] and res[1].finish_reason == "length"
    # prefill (2 rows x 4 padded), then decodes of the unfinished row only (the 3rd token needs no forward)
    assert model.calls == [(2, 4), (1, 1), (1, 1)]


def test_samples_independent_from_first_token(tok):
    a, b = ord("a"), ord("b")
    engine = ModelRunner(uniform_two_token_model(tok.vocab_size, a, b), tok)
    hot = engine.generate_batch([[tok.bos_id]], num_samples=64, max_tokens=1, temperature=1.0, seed=0)
    firsts = [r.completion_tokens[0] for r in hot]
    assert set(firsts) == {a, b}  # P(all 64 equal) = 2 * 2**-64
    assert 16 <= firsts.count(a) <= 48  # binomial(64, 1/2): outside this has probability < 1e-4
    again = engine.generate_batch([[tok.bos_id]], num_samples=64, max_tokens=1, temperature=1.0, seed=0)
    assert [r.completion_tokens[0] for r in again] == firsts  # the seed reproduces
    cold = engine.generate_batch([[tok.bos_id]], num_samples=64, max_tokens=1, temperature=0.0)
    assert {r.completion_tokens[0] for r in cold} == {a}  # argmax tie goes to the lower id


def _tool_run(tok, expression: str):
    ps, pe = tok.special_id("<|python_start|>"), tok.special_id("<|python_end|>")
    end = tok.special_id("<|assistant_end|>")
    prompt = [tok.bos_id, tok.special_id("<|assistant_start|>")]
    body = [ps, *tok.encode(expression), pe]
    script = {len(prompt) + i: t for i, t in enumerate(body)}
    model = scripted_model(tok.vocab_size, script, default=end, max_seq_len=len(prompt) + len(body) + 16)
    (res,) = ModelRunner(model, tok).generate_batch([prompt], max_tokens=len(body) + 10, temperature=0.0)
    return prompt, body, res


def test_calculator_injects_result_with_mask_zero(tok):
    prompt, body, res = _tool_run(tok, "12*(3+4)")
    forced = [tok.special_id("<|output_start|>"), ord("8"), ord("4"), tok.special_id("<|output_end|>")]
    # after the forced block the script's default (assistant_end) is sampled
    assert res.completion_tokens == [*body, *forced, tok.special_id("<|assistant_end|>")]
    assert res.completion_mask == [1] * len(body) + [0] * 4 + [1]
    assert res.text == "<|python_start|>12*(3+4)<|python_end|><|output_start|>84<|output_end|>"
    assert res.finish_reason == "stop"


def test_calculator_thousands_separator(tok):
    _, body, res = _tool_run(tok, "1,000+1")
    assert (
        tok.decode(res.completion_tokens[len(body) :])
        == "<|output_start|>1001<|output_end|><|assistant_end|>"
    )


@pytest.mark.parametrize(
    "expression", ["2**99999", "__import__('os')", "signal.raise_signal(9)", "1+" * 4999 + "11"]
)
def test_calculator_rejects_inject_nothing(tok, expression):
    assert len(expression) < 40 or len(expression) == 10_000
    _, body, res = _tool_run(tok, expression)
    assert res.completion_tokens == [*body, tok.special_id("<|assistant_end|>")]
    assert res.completion_mask == [1] * (len(body) + 1)


def test_kv_budget_error_names_numbers(tok, model):
    # bytes/token = 2 (k, v) * 2 layers * 2 kv heads * 16 head_dim * 4 bytes (fp32) = 512
    assert KVCache.bytes_per_token(model.config, torch.float32) == 512
    prompts = [[tok.bos_id] * 5, [tok.bos_id] * 3]
    # 2 prompts x 2 samples = 4 rows of (5 + 10) tokens = 60 tokens * 512 = 30720 bytes
    with pytest.raises(
        KVBudgetError, match=r"4 rows x 15 tokens needs 30720 bytes.*kv_budget_bytes is 30719"
    ):
        ModelRunner(model, tok, kv_budget_bytes=30719).generate_batch(prompts, num_samples=2, max_tokens=10)
    ok = ModelRunner(model, tok, kv_budget_bytes=30720).generate_batch(prompts, num_samples=2, max_tokens=10)
    assert len(ok) == 4


def test_generation_stops_at_max_seq_len(tok):
    a = ord("a")
    model = scripted_model(tok.vocab_size, {}, default=a, max_seq_len=8)
    (res,) = ModelRunner(model, tok).generate_batch([[tok.bos_id] * 5], max_tokens=100, temperature=0.0)
    assert res.completion_tokens == [a, a, a] and res.finish_reason == "length"


def test_engine_stop_string(tok):
    text = "abcDEFGHIJxyz"
    ids = [ord(c) for c in "abc"] + [256, ord("G"), 257, ord("J")] + [ord(c) for c in "xyz"]
    assert tok.decode(ids) == text
    model = scripted_model(tok.vocab_size, {1 + i: t for i, t in enumerate(ids)}, default=ord("q"))
    (res,) = ModelRunner(model, tok).generate_batch(
        [[tok.bos_id]], max_tokens=20, temperature=0.0, stop=["DEFGHIJ"]
    )
    assert res.text == "abc"
    assert res.completion_tokens == ids[:7]
    assert res.finish_reason == "stop"


def test_engine_str_stop_is_one_stop_string(tok):
    ids = list(b"abcabdxy")
    model = scripted_model(tok.vocab_size, {1 + i: t for i, t in enumerate(ids)}, default=ord("q"))
    # was: "abd" read as the stop strings "a", "b", "d": the row stopped at its first token, text ""
    (res,) = ModelRunner(model, tok).generate_batch(
        [[tok.bos_id]], max_tokens=20, temperature=0.0, stop="abd"
    )
    assert res.text == "abc"
    assert res.completion_tokens == ids[:6]
    assert res.finish_reason == "stop"


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"num_samples": 0}, "num_samples"),
        ({"temperature": -1.0}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_k": -2}, "top_k"),
        ({"max_tokens": 0}, "max_tokens"),
    ],
)
def test_bad_arguments_name_the_field(tok, model, kwargs, field):
    with pytest.raises(ValueError, match=field):
        ModelRunner(model, tok).generate_batch([[tok.bos_id]], **kwargs)


def test_bad_prompts(tok, model):
    engine = ModelRunner(model, tok)
    with pytest.raises(ValueError, match=r"prompts\[1\] is empty"):
        engine.generate_batch([[1], []])
    with pytest.raises(ValueError, match="outside 0..266"):
        engine.generate_batch([[267]])
    with pytest.raises(ValueError, match="max_seq_len 128"):
        engine.generate_batch([[1] * 128])


ENCODE_FIRST = (
    "not token ids; the engine takes token ids: encode text with the tokenizer first (tokenizer.encode(text), "
    "or a chat rendered with raychat.chat_template.render_for_completion(tokenizer, messages))"
)


@pytest.mark.parametrize(
    "prompts, kwargs, message",
    [
        # was: silently run on [1, 2]
        ([[1.5, 2.0]], {}, "prompts[0] must be a sequence of token ids (ints); item 0 is float 1.5"),
        ([[1, 2.0]], {}, "prompts[0] must be a sequence of token ids (ints); item 1 is float 2.0"),
        ([[1, True]], {}, "prompts[0] must be a sequence of token ids (ints); item 1 is bool True"),
        # was: "invalid literal for int() with base 10: 'h'"
        (["hello"], {}, f"prompts[0] is a str ('hello'), {ENCODE_FIRST}"),
        ([[1], b"hi"], {}, f"prompts[1] is a bytes (b'hi'), {ENCODE_FIRST}"),
        ("hello", {}, f"prompts is a str, {ENCODE_FIRST.replace('not token ids', 'not lists of token ids')}"),
        ([1, 2], {}, "prompts[0] must be a sequence of token ids (ints), got int 1"),
        # was: the same unnamed int() error
        (
            [[1]],
            {"seed": "abc"},
            "seed must be None (a fresh random seed) or an int in 0..9223372036854775807 (2**63 - 1), got 'abc'",
        ),
    ],
)
def test_prompts_must_be_token_ids(tok, model, prompts, kwargs, message):
    with pytest.raises(ValueError) as err:
        ModelRunner(model, tok).generate_batch(prompts, max_tokens=2, **kwargs)
    assert str(err.value) == message


def test_integer_arrays_are_token_ids(tok, model):
    engine = ModelRunner(model, tok)
    prompt = [tok.bos_id, 40, 41]
    (ref,) = engine.generate_batch([prompt], max_tokens=3, temperature=0.0)
    for p in (np.array(prompt), torch.tensor(prompt), tuple(prompt)):
        (res,) = engine.generate_batch([p], max_tokens=3, temperature=0.0)
        assert res.tokens == ref.tokens and all(type(t) is int for t in res.tokens)


@pytest.mark.parametrize("budget", [-1, 0, 1.5, True, "1000"])
def test_kv_budget_bytes_must_be_positive(tok, model, budget):
    # was (-1): "... at most -1 rows of ... tokens fit" at the first generate_batch
    with pytest.raises(ValueError) as err:
        ModelRunner(model, tok, kv_budget_bytes=budget)
    assert str(err.value) == f"kv_budget_bytes must be None (no cap) or an int >= 1 (bytes), got {budget!r}"
