"""Streaming detokenizer: split UTF-8 characters, monotone offsets, stop strings held back."""

from __future__ import annotations

import random

import pytest
from support.engine_fixtures import byte_tokenizer

from raychat.engine import StreamDecoder

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
    with pytest.raises(ValueError, match="stop strings"):
        StreamDecoder(tok, [""])
