"""Incremental, UTF-8-safe streaming detokenizer with stop strings.

Tokens are byte strings (`Tokenizer.iter_tokens`); a character may be split across tokens. Bytes go through
Python's incremental UTF-8 decoder (errors="replace", as `Tokenizer.decode`), which holds back an incomplete
trailing sequence until its last byte arrives, so no U+FFFD is emitted for a split character and the
concatenated deltas equal `tokenizer.decode(all ids)` (checked in the tests). Invalid bytes become U+FFFD
exactly where the full decode puts them.

Stop strings: decoded text that could still be the start of a stop string is held back; when a stop string
appears, everything before it is emitted, the stop string and all later text are dropped, and `stopped` is
set. Without a match, `finish()` releases the held-back text. Emitted text only grows (`offset` never moves
backwards). Stop strings are matched within visible text only: a token pushed with visible=False (a special
token, a calculator call, its result: raychat.engine.row_state decides) is emitted as it comes, with the
visible text held before it, and a stop string is never found in it or across it. `stop_here()` ends the
stream before a token (a stop token) without emitting the token.
"""

from __future__ import annotations

import codecs
from collections.abc import Iterable


def stop_strings(stop: str | Iterable[str] | None) -> tuple[str, ...]:
    """The one reading of a `stop` argument (SamplingParams, ModelRunner.generate_batch, StreamDecoder): a
    str is ONE stop string, None none, any other iterable its items.

    Raises:
        ValueError: `stop` is not a str, None or an iterable of non-empty strs (the message names stop).
    """
    if stop is None:
        return ()
    try:
        out = (stop,) if isinstance(stop, str) else tuple(stop)
    except TypeError:
        out = None
    if out is None or any(not isinstance(s, str) or not s for s in out):
        raise ValueError(f"stop must be a non-empty str or a sequence of non-empty strs, got {stop!r}")
    return out


class StreamDecoder:
    """Turn a stream of token ids into text deltas.

    Args:
        tokenizer: object with `iter_tokens(ids) -> Iterator[bytes]` (raychat Tokenizer).
        stop: one stop string (a str) or a sequence of them (`stop_strings`; non-empty str each).
    Attributes:
        text: str emitted so far (sum of deltas). offset: len(text), in characters.
        stopped: True once a stop string was seen. stop_string: which one (None otherwise).
    Raises:
        ValueError: `stop` is not a str or a sequence of strs, or a stop string is empty.
    """

    def __init__(self, tokenizer, stop: str | Iterable[str] = ()):
        self.tokenizer = tokenizer
        self.stop = stop_strings(stop)
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._held = ""  # decoded, not yet emitted (may begin a stop string)
        self.text = ""
        self.stopped = False
        self.stop_string: str | None = None

    @property
    def offset(self) -> int:
        return len(self.text)

    def push(self, token_id: int, visible: bool = True) -> str:
        """Add one token; return the text that is now safe to emit (possibly ""). visible=False: the token's
        text is not matched against the stop strings and ends the visible text held before it."""
        return self.push_bytes(b"".join(self.tokenizer.iter_tokens([token_id])), visible)

    def push_bytes(self, data: bytes, visible: bool = True) -> str:
        """Add raw bytes (one token's worth); return the newly emitted text."""
        if self.stopped:
            return ""
        self._held += self._utf8.decode(data, final=False)
        if not visible:  # the held text can no longer begin a stop string: emit it with this token's
            held, self._held = self._held, ""
            return self._emit(held)
        return self._release(final=False)

    def stop_here(self, reason: str) -> str:
        """End the stream now (a stop token came; its text is not emitted): release the held text, flushing an
        incomplete character as U+FFFD like finish(), and set stopped, with stop_string = `reason`."""
        if self.stopped:
            return ""
        out = self.finish()
        self.stopped, self.stop_string = True, reason
        return out

    def finish(self) -> str:
        """End of stream: flush incomplete bytes (as U+FFFD, like the full decode) and held-back text."""
        if self.stopped:
            return ""
        self._held += self._utf8.decode(b"", final=True)
        return self._release(final=True)

    def _release(self, final: bool) -> str:
        held = self._held
        if self.stop:
            hits = [(held.find(s), s) for s in self.stop]
            hits = [(i, s) for i, s in hits if i >= 0]
            if hits:
                i, s = min(hits)
                self.stopped, self.stop_string = True, s
                self._held = ""
                return self._emit(held[:i])
        keep = 0 if final else self._partial_stop_suffix(held)
        out, self._held = held[: len(held) - keep], held[len(held) - keep :]
        return self._emit(out)

    def _partial_stop_suffix(self, held: str) -> int:
        """Length of the longest suffix of `held` that is a proper prefix of some stop string."""
        best = 0
        for s in self.stop:
            for n in range(min(len(s) - 1, len(held)), best, -1):
                if held.endswith(s[:n]):
                    best = n
                    break
        return best

    def _emit(self, text: str) -> str:
        self.text += text
        return text
