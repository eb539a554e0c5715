"""An assistant turn's parts, read from its completion tokens as they stream: the inverse of the chat
template's assistant rendering (raychat.chat_template), so that no control-token text ever reaches a client.

The template renders an assistant turn as text, <|python_start|> expression <|python_end|> (a calculator
call, sampled by the model) and <|output_start|> result <|output_end|> (the calculator's result, forced by
the engine right after the call). `TurnParser` turns the completion back into parts:

  ("text", str)           visible text; concatenated, it is the completion's text with every special token
                          (and the call and result blocks) removed
  ("tool_call", str)      the expression of a <|python_start|> ... <|python_end|> block, once it is closed
  ("tool_result", str)    the result of an <|output_start|> ... <|output_end|> block that directly follows
                          a call, once it is closed

Grammar: text (call result?)* ... ; a marker out of place (<|python_end|> outside a call, a result block
that does not follow a call, <|python_start|> inside a call) and every other special token (<|user_start|>
from an untrained model, ...) is hidden and changes nothing. <|assistant_end|> and <|bos|> end the turn and
are never text. At `finish()` an unclosed call or result is still reported with what it holds.

What the engine released decides what is reported: the engine's text deltas (`StreamEvent.text`) are a
prefix of the decoded completion (a stop string and everything after it are withheld), so the parser decodes
the tokens itself, with the same incremental UTF-8 decoder as raychat.engine.detokenize, and reports only
the characters the engine has released. A call or result is reported once its closing marker is released.
"""

from __future__ import annotations

import codecs
from collections.abc import Iterable

from raychat.chat_template import MARKERS, stop_ids

TEXT, CALL, RESULT, MARKER, END = "text", "call", "result", "marker", "end"


class TurnParser:
    """Streaming parser of one completion (see the module doc).

    Args:
        tokenizer: the raychat Tokenizer the completion was generated with.
    Usage:
        parts, kinds = parser.push(token_ids, released_text)   # per engine event
        parts += parser.finish()                               # after the last event
    `kinds` gives each pushed token's role: "text", "call" (expression), "result", "marker" (a special
    token, hidden) or "end" (<|assistant_end|> / <|bos|>), e.g. to keep the logprobs of text tokens only.
    """

    def __init__(self, tokenizer):
        sid = tokenizer.special_id
        self._tokenizer = tokenizer
        self._python_start, self._python_end = sid(MARKERS["python_start"]), sid(MARKERS["python_end"])
        self._output_start, self._output_end = sid(MARKERS["output_start"]), sid(MARKERS["output_end"])
        self._specials = set(tokenizer.special_tokens.values())
        self._end = set(stop_ids(tokenizer))
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._mode = TEXT  # of the token stream: TEXT, CALL or RESULT
        self._after_call = False  # the last closed block was a call (a result may follow)
        # decoded characters not yet reported: [kind, text, action]; action on release: "open_call",
        # "call", "open_result", "result" (markers) or None
        self._queue: list[list] = []
        self._buffer: list[str] = []  # released text of the open call or result
        self._released_mode = TEXT
        self._decoded = 0  # characters decoded so far
        self._reported = 0  # characters turned into parts (or hidden) so far
        self._released = 0  # characters the engine released so far
        self._release_all = False

    def push(
        self, token_ids: Iterable[int], released_text: str | None = ""
    ) -> tuple[list[tuple[str, str]], list[str]]:
        """Add an event's tokens and the text the engine released with them; returns (parts, kinds).

        released_text None: everything decoded is released, now and at finish() (a finished completion
        read from its tokens alone, without a stop string).
        """
        kinds = [self._add(t) for t in token_ids]
        if released_text is None:
            self._release_all = True
        else:
            self._released += len(released_text)
        return self._release(), kinds

    def finish(self) -> list[tuple[str, str]]:
        """End of the completion: flush the decoder, report what is left (an open call or result too)."""
        tail = self._utf8.decode(b"", final=True)
        if tail:
            self._append(self._mode, tail, None)
        parts = self._release()
        if self._released_mode != TEXT:  # cut inside a call or result (max_tokens, stop string)
            parts.append(
                ("tool_call" if self._released_mode == CALL else "tool_result", "".join(self._buffer))
            )
            self._buffer, self._released_mode = [], TEXT
        return parts

    # ---- tokens -> decoded characters with their kind ---------------------------------------------------
    def _add(self, token: int) -> str:
        if token in self._end:
            return END
        text = self._utf8.decode(b"".join(self._tokenizer.iter_tokens([token])), final=False)
        if token not in self._specials:
            self._append(self._mode, text, None)
            return self._mode
        marker = self._tokenizer.decode([token])
        if len(text) > len(marker):  # an incomplete character before the marker became U+FFFD
            self._append(self._mode, text[: -len(marker)], None)
        self._append(MARKER, marker, self._transition(token))
        return MARKER

    def _transition(self, token: int) -> str | None:
        """The stream-mode change a special token makes (see the grammar), as its release action."""
        if token == self._python_start and self._mode == TEXT:
            self._mode, self._after_call = CALL, False
            return "open_call"
        if token == self._python_end and self._mode == CALL:
            self._mode, self._after_call = TEXT, True
            return "call"
        if token == self._output_start and self._mode == TEXT and self._after_call:
            self._mode, self._after_call = RESULT, False
            return "open_result"
        if token == self._output_end and self._mode == RESULT:
            self._mode = TEXT
            return "result"
        return None

    def _append(self, kind: str, text: str, action: str | None) -> None:
        if not text:
            return
        if kind == TEXT:
            self._after_call = False
        self._decoded += len(text)
        self._queue.append([kind, text, action])

    # ---- released characters -> parts ------------------------------------------------------------------
    def _release(self) -> list[tuple[str, str]]:
        released = self._decoded if self._release_all else min(self._released, self._decoded)
        budget = released - self._reported
        self._reported = released
        parts: list[tuple[str, str]] = []
        while self._queue and budget > 0:
            kind, text, action = self._queue[0]
            take, rest = text[:budget], text[budget:]
            budget -= len(take)
            if kind == TEXT:
                if parts and parts[-1][0] == "text":
                    parts[-1] = ("text", parts[-1][1] + take)
                else:
                    parts.append(("text", take))
            elif kind in (CALL, RESULT):
                self._buffer.append(take)
            if rest:
                self._queue[0][1] = rest
                break
            self._queue.pop(0)
            if action in ("open_call", "open_result"):
                self._released_mode, self._buffer = (CALL if action == "open_call" else RESULT), []
            elif action in ("call", "result"):
                parts.append(("tool_call" if action == "call" else "tool_result", "".join(self._buffer)))
                self._buffer, self._released_mode = [], TEXT
        return parts


def turn_parts(tokenizer, completion_tokens: Iterable[int]) -> list[tuple[str, str]]:
    """Every part of a finished completion (all of it released), e.g. for `raychat chat`'s history."""
    parser = TurnParser(tokenizer)
    parts, _ = parser.push(completion_tokens, None)
    return merge_text(parts + parser.finish())


def merge_text(parts: list[tuple[str, str]]) -> list[tuple[str, str]]:
    """`parts` with runs of text parts joined into one and empty text parts dropped."""
    out: list[tuple[str, str]] = []
    for kind, text in parts:
        if kind == "text" and out and out[-1][0] == "text":
            out[-1] = ("text", out[-1][1] + text)
        elif kind != "text" or text:
            out.append((kind, text))
    return out
