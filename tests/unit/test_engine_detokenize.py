"""Streaming detokenizer: split UTF-8 characters, monotone offsets, stop strings held back."""

from __future__ import annotations

import random

import pytest
from support.engine_fixtures import byte_tokenizer

from raychat.engine import SamplingParams, StreamDecoder
from raychat.engine.detokenize import stop_strings

DEF, HI = 256, 257  # merged tokens of the test tokenizer


@pytest.fixture(scope="module")
def tok():
    return byte_tokenizer()


def stream(tok, ids, stop=()):
    dec = StreamDecoder(tok, stop)
    deltas = [dec.push(i) for i in ids]
    return deltas, dec.finish(), dec


def test_two_byte_char_split(tok):
    ids = list("ď".encode())  # C4 8F: byte tokens have id == byte value
    assert ids == [0xC4, 0x8F]
    deltas, tail, _ = stream(tok, ids)
    assert deltas == ["", "ď"] and tail == ""


def test_four_byte_emoji_split(tok):
    ids = list("👋".encode())
    assert len(ids) == 4
    deltas, tail, _ = stream(tok, ids)
    assert deltas == ["", "", "", "👋"] and tail == ""


def test_joined_deltas_equal_full_decode_and_offsets_monotone(tok):
    rng = random.Random(0)
    text = "héllo wörld ďakujem 👋🏽 日本語 " * 3
    ids = list(text.encode())
    dec = StreamDecoder(tok)
    offsets, out = [], []
    for i in ids:
        d = dec.push(i)
        assert "\ufffd" not in d
        out.append(d)
        offsets.append(dec.offset)
    out.append(dec.finish())
    assert "".join(out) == tok.decode(ids) == text
    assert offsets == sorted(offsets)
    # random invalid bytes: same replacement characters as the full decode
    junk = [rng.randrange(256) for _ in range(200)]
    deltas, tail, _ = stream(tok, junk)
    assert "".join(deltas) + tail == tok.decode(junk)


def test_truncated_char_at_end_flushes_like_full_decode(tok):
    ids = [ord("a"), 0xF0, 0x9F]
    deltas, tail, _ = stream(tok, ids)
    assert deltas == ["a", "", ""]
    assert "".join(deltas) + tail == tok.decode(ids) == "a\ufffd"


def test_stop_string_over_four_tokens_emits_none(tok):
    ids = [ord("a"), ord("b"), ord("c"), DEF, ord("G"), HI, ord("J"), ord("x")]
    assert tok.decode(ids) == "abcDEFGHIJx"
    deltas, tail, dec = stream(tok, ids, stop=["DEFGHIJ"])
    assert deltas == ["a", "b", "c", "", "", "", "", ""] and tail == ""
    assert dec.stopped and dec.stop_string == "DEFGHIJ" and dec.text == "abc"


def test_partial_stop_released_when_it_diverges(tok):
    ids = [DEF, ord("G"), ord("X")]
    deltas, tail, dec = stream(tok, ids, stop=["DEFGHIJ"])
    assert deltas == ["", "", "DEFGX"] and not dec.stopped
    deltas, tail, dec = stream(tok, [DEF, ord("G")], stop=["DEFGHIJ"])
    assert deltas == ["", ""] and tail == "DEFG" and not dec.stopped


def test_earliest_of_several_stop_strings(tok):
    ids = list(b"xx END yy STOP")
    deltas, tail, dec = stream(tok, ids, stop=["STOP", " END"])
    assert "".join(deltas) + tail == "xx" and dec.stop_string == " END"


def test_overlapping_stop_prefix(tok):
    ids = list(b"aab")
    deltas, tail, dec = stream(tok, ids, stop=["ab"])
    assert deltas == ["", "a", ""] and dec.text == "a" and dec.stopped


def test_empty_stop_string_rejected(tok):
    message = "stop must be a non-empty str or a sequence of non-empty strs, got "
    with pytest.raises(ValueError) as err:
        StreamDecoder(tok, [""])
    assert str(err.value) == message + "['']"
    with pytest.raises(ValueError) as err:
        StreamDecoder(tok, 5)
    assert str(err.value) == message + "5"


def test_str_stop_is_one_stop_string(tok):
    # was: "wö" read as the stop strings "w" and "ö", so the stream stopped at the first "w" ("x")
    deltas, tail, dec = stream(tok, list("xwyzwö!".encode()), stop="wö")
    assert "".join(deltas) + tail == dec.text == "xwyz"
    assert dec.stopped and dec.stop_string == "wö" and dec.stop == ("wö",)


def test_one_reading_of_stop_everywhere(tok):
    for stop, expected in [("abc", ("abc",)), (["ab", "c"], ("ab", "c")), (None, ()), ((), ())]:
        assert (
            stop_strings(stop) == StreamDecoder(tok, stop).stop == SamplingParams(stop=stop).stop == expected
        )


def test_invisible_tokens_release_held_text_and_are_never_matched(tok):
    dec = StreamDecoder(tok, ["ab", "xyz"])
    assert dec.push(ord("a")) == ""  # held: may begin "ab"
    assert dec.push(ord("b"), visible=False) == "ab"  # ends the visible text: "a" out, "b" not matched
    assert [dec.push(i) for i in b"xy"] == ["", ""]
    assert dec.push(ord("z"), visible=False) == "xyz" and not dec.stopped
    assert [dec.push(i) for i in b"-ab"] == ["-", "", ""] and dec.stopped and dec.stop_string == "ab"
    assert dec.text == "abxyz-"


def test_stop_here_flushes_like_finish_and_emits_nothing_after(tok):
    dec = StreamDecoder(tok, ["q!"])
    euro = "€".encode()
    assert [dec.push(i) for i in b"q"] == [""]  # held: may begin "q!"
    assert [dec.push(i) for i in euro[:2]] == ["", ""]  # an incomplete character
    assert dec.stop_here("<|python_end|>") == "q\ufffd"  # as the full decode of those bytes
    assert (dec.stopped, dec.stop_string) == (True, "<|python_end|>")
    assert dec.push(ord("x")) == "" and dec.finish() == "" and dec.stop_here("again") == ""
    assert dec.text == tok.decode([ord("q"), *euro[:2]])
