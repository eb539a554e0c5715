"""TurnParser: a completion's tokens -> text / tool_call / tool_result parts, streamed as the engine releases
text (stop strings included), with no control-token text ever in a text part."""

from __future__ import annotations

import pytest
from support.engine_fixtures import byte_tokenizer

from raychat.chat.turn import TurnParser, merge_text, turn_parts
from raychat.chat_template import render_conversation
from raychat.engine.detokenize import StreamDecoder

TOK = byte_tokenizer()
S = TOK.special_id
CALL = [S("<|python_start|>"), *TOK.encode("47 * 12"), S("<|python_end|>")]
RESULT = [S("<|output_start|>"), *TOK.encode("564"), S("<|output_end|>")]
TURN = [*TOK.encode("Let me. "), *CALL, *RESULT, *TOK.encode("#### 564"), S("<|assistant_end|>")]
PARTS = [("text", "Let me. "), ("tool_call", "47 * 12"), ("tool_result", "564"), ("text", "#### 564")]


def stream(ids, stop=(), per_event=1):
    """Feed `ids` the way the engine does: its StreamDecoder decides what text is released (stop strings
    withheld, matched in the visible text only: raychat.engine.row_state), the terminal token ends the turn
    undecoded. Returns (parts, kinds, released text)."""
    decoder, parser = StreamDecoder(TOK, stop), TurnParser(TOK)
    visible = [kind == "text" for kind in TurnParser(TOK).push(ids, None)[1]]
    parts, kinds, released = [], [], ""
    for i in range(0, len(ids), per_event):
        chunk, text = ids[i : i + per_event], ""
        for j, t in enumerate(chunk):
            if t in (S("<|assistant_end|>"), TOK.bos_id) or decoder.stopped:
                break
            text += decoder.push(t, visible[i + j])
        if decoder.stopped or i + per_event >= len(ids):
            text += "" if decoder.stopped else decoder.finish()
        new, k = parser.push(chunk, text)
        parts, kinds, released = parts + new, kinds + k, released + text
        if decoder.stopped:
            break
    return merge_text(parts + parser.finish()), kinds, released


def test_turn_parts_invert_the_template():
    assert turn_parts(TOK, TURN) == PARTS
    conv = [{"role": "user", "content": "q"}, {"role": "assistant", "content": [
        {"type": "text", "text": "Let me. "}, {"type": "python", "text": "47 * 12"},
        {"type": "python_output", "text": "564"}, {"type": "text", "text": "#### 564"}]}]  # fmt: skip
    ids = render_conversation(TOK, conv).ids
    start = ids.index(S("<|assistant_start|>")) + 1
    assert ids[start:] == TURN  # the template renders exactly these ids, and the parser reads them back


@pytest.mark.parametrize("per_event", [1, 3, 100])
def test_streamed_parts_equal_the_whole_and_kinds_label_every_token(per_event):
    parts, kinds, released = stream(TURN, per_event=per_event)
    assert parts == PARTS
    assert released.startswith("Let me. <|python_start|>")  # the engine's text has the markers; parts do not
    assert len(kinds) == len(TURN)
    start, end = TURN.index(S("<|python_start|>")), TURN.index(S("<|python_end|>"))
    out_start, out_end = TURN.index(S("<|output_start|>")), TURN.index(S("<|output_end|>"))
    assert kinds[:start] == ["text"] * start and kinds[start + 1 : end] == ["call"] * 7
    assert kinds[out_start + 1 : out_end] == ["result"] * 3 and kinds[out_end + 1 : -1] == ["text"] * 8
    assert [kinds[i] for i in (start, end, out_start, out_end)] == ["marker"] * 4 and kinds[-1] == "end"
    assert "".join(t for k, t in parts if k == "text") == "Let me. #### 564"


def test_a_call_is_reported_only_once_closed():
    parser = TurnParser(TOK)
    open_call = [*TOK.encode("x "), S("<|python_start|>"), *TOK.encode("1+")]
    parts, _ = parser.push(open_call, None)
    assert parts == [("text", "x ")]
    parts, _ = parser.push([*TOK.encode("1"), S("<|python_end|>")], None)
    assert parts == [("tool_call", "1+1")]


def test_a_stop_string_stops_in_text_and_never_in_a_call_or_result():
    parts, _, released = stream(TURN, stop=("##",))
    assert parts == PARTS[:3] and released == "Let me. <|python_start|>47 * 12<|python_end|><|output_start|>564<|output_end|>"  # fmt: skip
    # in the expression or the result only: not visible text, so the whole turn comes
    for stop in ("* 1", "<|python", "12<|"):
        assert stream(TURN, stop=(stop,))[0] == PARTS
    parts, _, released = stream(TURN, stop=("564",))  # the result's text too, but it stops in the text after
    assert parts == [*PARTS[:3], ("text", "#### ")] and released.endswith("<|output_end|>#### ")


def test_markers_out_of_place_and_other_specials_are_hidden():
    ids = [
        S("<|user_start|>"), *TOK.encode("a"), S("<|python_end|>"), *TOK.encode("b"),
        S("<|output_start|>"), *TOK.encode("c"), S("<|output_end|>"),  # a result that follows no call
        S("<|python_start|>"), *TOK.encode("2"), S("<|python_start|>"), *TOK.encode("*3"), S("<|python_end|>"),
        *TOK.encode("d"), S("<|output_start|>"), *TOK.encode("e"), S("<|output_end|>"),  # text came between
    ]  # fmt: skip
    parts = turn_parts(TOK, ids)
    assert parts == [("text", "abc"), ("tool_call", "2*3"), ("text", "de")]
    assert all("<|" not in text for _, text in parts)


def test_split_utf8_character_before_a_marker_and_at_the_end():
    euro = "€".encode()  # 3 bytes: ids 0xe2 0x82 0xac in the byte tokenizer
    ids = [euro[0], euro[1], S("<|python_start|>"), *TOK.encode("1"), S("<|python_end|>"), euro[0]]
    parts, _, released = stream(ids)
    assert parts == [("text", "\ufffd"), ("tool_call", "1"), ("text", "\ufffd")]
    assert released == TOK.decode(ids)  # what the engine streams is the full decode
    assert turn_parts(TOK, [*euro, *TOK.encode("!")]) == [("text", "€!")]


def test_length_cut_inside_a_result():
    assert turn_parts(TOK, [*CALL, S("<|output_start|>"), *TOK.encode("56")]) == [("tool_call", "47 * 12"), ("tool_result", "56")]  # fmt: skip
