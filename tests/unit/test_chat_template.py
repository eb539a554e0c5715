import pytest

from raychat.chat_template import (
    TEMPLATE_VERSION,
    check_supervision,
    fewest_tokens,
    render_conversation,
    render_for_completion,
    render_tool_output,
    validate_messages,
)
from raychat.data.loader.sample_packing import SampleStats, render_samples


def sid(tok, name):
    return tok.special_id(f"<|{name}|>")


def u(text):
    return {"role": "user", "content": text}


def a(content):
    return {"role": "assistant", "content": content}


def test_assistant_followed_by_user_supervises_only_assistant_and_end(small_tokenizer):
    tok = small_tokenizer
    r = render_conversation(tok, [u("Hi"), a("Hello"), u("Bye"), a("Ciao")])
    enc = tok.encode
    bos, us, ue, ast, ae = (
        sid(tok, n) for n in ("bos", "user_start", "user_end", "assistant_start", "assistant_end")
    )
    expected_ids = [
        bos,
        us,
        *enc("Hi"),
        ue,
        ast,
        *enc("Hello"),
        ae,
        us,
        *enc("Bye"),
        ue,
        ast,
        *enc("Ciao"),
        ae,
    ]
    expected_sup = (
        [0] * (3 + len(enc("Hi")))  # bos, user_start, Hi, user_end
        + [0]  # assistant_start is input only
        + [1] * (len(enc("Hello")) + 1)  # reply + assistant_end
        + [0] * (2 + len(enc("Bye")) + 1)  # next user turn + assistant_start
        + [1] * (len(enc("Ciao")) + 1)
    )
    assert r.ids == expected_ids
    assert r.supervised == expected_sup
    assert r.num_targets == len(enc("Hello")) + len(enc("Ciao")) + 2
    assert r.roles[: 4 + len(enc("Hi"))] == ["bos"] + ["user"] * (len(enc("Hi")) + 2) + ["assistant"]


def test_all_zero_supervision_with_an_assistant_turn_raises(small_tokenizer):
    r = render_conversation(small_tokenizer, [u("Hi"), a("Hello")])
    check_supervision(r.ids, r.supervised, r.roles)  # the real mask passes
    with pytest.raises(ValueError, match="all zero"):
        check_supervision(r.ids, [0] * len(r.ids), r.roles)
    with pytest.raises(ValueError, match="no assistant message"):
        render_conversation(small_tokenizer, [u("Hi")])


def test_exactly_one_bos_even_with_bos_text_in_content(small_tokenizer):
    tok = small_tokenizer
    conv = [{"role": "system", "content": "<|bos|> sys"}, u("<|bos|>"), a("<|bos|>"), u("x"), a("y")]
    r = render_conversation(tok, conv)
    assert r.ids.count(tok.bos_id) == 1 and r.ids[0] == tok.bos_id
    prompt = render_for_completion(tok, conv[:-1])
    assert prompt.count(tok.bos_id) == 1


def test_system_message_is_carried_at_the_start_of_the_first_user_turn(small_tokenizer):
    tok = small_tokenizer
    r = render_conversation(tok, [{"role": "system", "content": "Be brief."}, u("Hi"), a("Yo")])
    expected = [
        tok.bos_id,
        sid(tok, "user_start"),
        *tok.encode("Be brief.\n\n"),  # one span: ".\n\n" is one pre-token, as in HF/vLLM
        *tok.encode("Hi"),
        sid(tok, "user_end"),
        sid(tok, "assistant_start"),
        *tok.encode("Yo"),
        sid(tok, "assistant_end"),
    ]
    assert r.ids == expected
    n_sys = len(tok.encode("Be brief.\n\n"))
    assert r.roles[2 : 2 + n_sys] == ["system"] * n_sys


def test_assistant_end_marker_in_user_text_is_plain_text(small_tokenizer):
    tok = small_tokenizer
    text = "stop here <|assistant_end|> and <|user_end|> go on"
    r = render_conversation(tok, [u(text), a("ok")])
    span = next(s for s in r.spans if s.kind == "user")
    assert tok.decode(r.ids[span.start : span.end]) == text
    assert sid(tok, "assistant_end") not in r.ids[span.start : span.end]
    assert sid(tok, "user_end") not in r.ids[span.start : span.end]
    assert r.ids[span.end] == sid(tok, "user_end")  # the turn continues to its own end marker
    assert r.ids.count(sid(tok, "assistant_end")) == 1
    assert sum(r.supervised[span.start : span.end]) == 0


@pytest.mark.parametrize("user_text", ["hi", "hi ", "hi\n", "hi  \n\t", "  "])
@pytest.mark.parametrize("reply", ["Hello", " Hello", "\nHello  world ", "  ", ""])
def test_supervised_tokens_decode_exactly_to_reply_plus_end(small_tokenizer, user_text, reply):
    tok = small_tokenizer
    r = render_conversation(tok, [u(user_text), a(reply)])
    supervised_ids = [i for i, s in zip(r.ids, r.supervised) if s]
    assert tok.decode(supervised_ids) == reply + "<|assistant_end|>"
    assert supervised_ids == [*tok.encode(reply), sid(tok, "assistant_end")]


def test_adjacent_text_parts_are_encoded_as_one_text(small_tokenizer):
    """An assistant message of text parts "The qu" + "ick brown fox" renders as "The quick brown fox" does: one
    text, encoded whole, as the exported Jinja template's one string is (tests/unit/test_export_hf.py). Encoded
    part by part, BPE could not merge across the join ("qu" + "ick" against "quick"), so a model trained on
    it saw a split the tokenizer never makes."""
    tok = small_tokenizer
    assert tok.encode("The qu") + tok.encode("ick brown fox") != tok.encode(
        "The quick brown fox"
    )  # the split
    parts = [{"type": "text", "text": "The qu"}, {"type": "text", "text": "ick brown fox"}]
    for tail in ([], [{"type": "python", "text": "1+1"}]):
        split, whole = (
            render_conversation(tok, [u("Hi"), a(parts + tail)]),
            render_conversation(tok, [u("Hi"), a([{"type": "text", "text": "The quick brown fox"}, *tail])]),
        )
        assert (split.ids, split.supervised) == (whole.ids, whole.supervised)


def test_tool_calls_are_targets_and_tool_outputs_are_not(small_tokenizer):
    tok = small_tokenizer
    conv = [
        u("What is 12 * 34?"),
        a([{"type": "text", "text": "Computing. "}, {"type": "python", "text": "12 * 34"}]),
        {"role": "tool", "content": "408"},
        a("#### 408"),
    ]
    r = render_conversation(tok, conv)
    supervised = tok.decode([i for i, s in zip(r.ids, r.supervised) if s])
    assert supervised == "Computing. <|python_start|>12 * 34<|python_end|>#### 408<|assistant_end|>"
    out = [i for i, role in zip(r.ids, r.roles) if role == "tool"]
    assert out == render_tool_output(tok, "408")
    assert r.ids.count(sid(tok, "assistant_start")) == 1 and r.ids.count(sid(tok, "assistant_end")) == 1
    # the same turn written with parts renders identically
    parts = [
        u("What is 12 * 34?"),
        a(
            [
                {"type": "text", "text": "Computing. "},
                {"type": "python", "text": "12 * 34"},
                {"type": "python_output", "text": "408"},
                {"type": "text", "text": "#### 408"},
            ]
        ),
    ]
    assert render_conversation(tok, parts).ids == r.ids


@pytest.mark.parametrize(
    "messages, match",
    [
        ([u("a"), u("b")], r"message 1: role 'user' not allowed after 'user'; allowed: \['assistant'\]"),
        ([a("a")], r"message 0: role 'assistant' not allowed at the start; allowed: \['system', 'user'\]"),
        (
            [u("a"), a("b"), {"role": "system", "content": "s"}],
            r"message 2: role 'system' not allowed after 'assistant'",
        ),
        (
            [u("a"), {"role": "bot", "content": "b"}],
            r"message 1: role must be one of \['system', 'user', 'assistant', 'tool'\]",
        ),
        (
            [u("a"), a("b"), {"role": "tool", "content": "1"}],
            r"message 2: a 'tool' message must follow .* python call",
        ),
        ([u("a"), a([{"type": "code", "text": "x"}])], r"message 1 part 0: type must be one of"),
        ([u(3)], r"message 0 \(user\): content must be a string"),
    ],
)
def test_role_order_errors_name_the_message_and_allowed_roles(messages, match):
    with pytest.raises(ValueError, match=match):
        validate_messages(messages)


def test_render_for_completion_ends_with_assistant_start_and_is_the_training_prefix(small_tokenizer):
    tok = small_tokenizer
    conv = [{"role": "system", "content": "S"}, u("Q1"), a("A1"), u("Q2"), a("A2")]
    prompt = render_for_completion(tok, conv[:-1])
    full = render_conversation(tok, conv).ids
    assert prompt[-1] == sid(tok, "assistant_start")
    assert full[: len(prompt)] == prompt
    assert full[len(prompt) :] == [*tok.encode("A2"), sid(tok, "assistant_end")]
    with pytest.raises(
        ValueError, match=r"ending with a 'user' \(or 'tool'\) message, got last role 'assistant'"
    ):
        render_for_completion(tok, conv)


def test_render_for_completion_after_a_tool_message_continues_the_open_turn(small_tokenizer):
    """A prompt ending with a tool message is the training rendering up to that output's <|output_end|>: the
    model continues exactly where the engine's forced calculator output would have left it."""
    tok = small_tokenizer
    call = {
        "role": "assistant",
        "content": [{"type": "text", "text": "Let me. "}, {"type": "python", "text": "2*3"}],
    }
    rest = {"role": "assistant", "content": "#### 6"}
    conv = [u("What is 2*3?"), call, {"role": "tool", "content": "6"}, rest]
    prompt = render_for_completion(tok, conv[:-1])
    full = render_conversation(tok, conv).ids
    assert prompt[-1] == sid(tok, "output_end") and full[: len(prompt)] == prompt
    assert full[len(prompt) :] == [*tok.encode("#### 6"), sid(tok, "assistant_end")]
    with pytest.raises(ValueError, match="cannot end with a 'tool' message"):
        validate_messages(conv[:-1])


def test_template_version_is_recorded(small_tokenizer):
    r = render_conversation(small_tokenizer, [u("a"), a("b")])
    assert r.template_version == TEMPLATE_VERSION and len(TEMPLATE_VERSION) == 16
    int(TEMPLATE_VERSION, 16)


# ---- truncation ---------------------------------------------------------------------------------------
def _sizes(tok, exchanges):
    """Hand count of one exchange's tokens: user_start + user + user_end + assistant_start + reply + end."""
    return [4 + len(tok.encode(q)) + len(tok.encode(r)) for q, r in exchanges]


def test_truncation_keeps_system_and_most_recent_turns_and_counts_targets(small_tokenizer):
    tok = small_tokenizer
    system = "You are terse."
    ex = [
        ("first question here", "first answer"),
        ("second one", "second reply ok"),
        ("third", "third reply"),
    ]
    conv = [{"role": "system", "content": system}] + [m for q, r in ex for m in (u(q), a(r))]
    sizes = _sizes(tok, ex)
    sys_block = len(tok.encode(system + "\n\n"))
    full = 1 + sys_block + sum(sizes)
    targets = [len(tok.encode(r)) + 1 for _, r in ex]

    r = render_conversation(tok, conv, max_tokens=full)
    assert not r.truncation.truncated and len(r) == full and r.num_targets == sum(targets)

    budget = 1 + sys_block + sizes[1] + sizes[2]
    for max_tokens in (budget, full - 1):
        r = render_conversation(tok, conv, max_tokens=max_tokens)
        t = r.truncation
        assert (t.dropped_exchanges, t.kept_messages) == (1, (0, 3, 4, 5, 6))
        assert len(r) == budget == t.tokens_after and t.tokens_before == full
        assert (t.targets_before, t.targets_after) == (sum(targets), targets[1] + targets[2])
        assert r.num_targets == targets[1] + targets[2]
        assert tok.decode(r.ids).startswith(f"<|bos|><|user_start|>{system}\n\nsecond one<|user_end|>")

    r = render_conversation(tok, conv, max_tokens=budget - 1)
    assert r.truncation.kept_messages == (0, 5, 6) and r.num_targets == targets[2]


def test_zero_target_samples_are_dropped_and_counted(small_tokenizer):
    tok = small_tokenizer
    long_reply = [u("tell me"), a("word " * 100)]
    tail_user = [u("q"), a("word " * 100), u("thanks")]  # only the newest exchange fits; it has no reply
    short = [u("q"), a("r")]
    for conv, reason in (
        (long_reply, "most recent exchange does not fit"),
        (tail_user, "no supervised token"),
    ):
        r = render_conversation(tok, conv, max_tokens=40)
        assert r.dropped and r.ids == [] and r.num_targets == 0 and reason in r.truncation.reason
    stats = SampleStats()
    items = list(render_samples(tok, [("a", long_reply), ("b", short), ("c", tail_user)], 40, stats))
    assert [i.sample_id for i in items] == ["b"]
    assert (stats.samples, stats.dropped, stats.truncated) == (3, 2, 0)
    assert stats.targets_after == len(tok.encode("r")) + 1
    assert stats.targets_before == 2 * (len(tok.encode("word " * 100)) + 1) + (len(tok.encode("r")) + 1)


def test_fewest_tokens_is_the_row_that_keeps_a_conversation(small_tokenizer):
    """The row length at which truncation keeps a conversation: its system message and most recent exchange
    rendered alone; when that exchange has no target (the conversation ends with a user message), the one before
    it too. One token less and the conversation is dropped."""
    tok = small_tokenizer
    system = {"role": "system", "content": "Be brief."}
    ends_answered = [system, u("first " * 9), a("one " * 9), u("second"), a("two")]
    ends_asking = [u("first"), a("one " * 5), u("second " * 9)]
    for conversation, kept in ((ends_answered, [system, u("second"), a("two")]), (ends_asking, ends_asking)):
        fewest = fewest_tokens(tok, conversation)
        assert fewest == len(render_conversation(tok, kept).ids)
        assert not render_conversation(tok, conversation, max_tokens=fewest).dropped
        assert render_conversation(tok, conversation, max_tokens=fewest - 1).dropped
    assert fewest_tokens(tok, ends_answered) < len(render_conversation(tok, ends_answered).ids)
