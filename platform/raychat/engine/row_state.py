"""Per-row generation state shared by `ModelRunner.generate_batch` and the `Scheduler`.

One `RowState` follows one completion: it picks forced tool-output tokens over sampled ones, runs the
calculator tool when a <|python_start|> ... <|python_end|> block closes, streams text through a
`StreamDecoder`, and decides when the row is finished:
  "stop"    the model sampled <|assistant_end|> or <|bos|> (kept in tokens, mask 1), or a stop string
            appeared in the visible text, or the model sampled a stop token;
  "length"  max_tokens completion tokens, or the row's cache is full (max_len tokens).
Forced tokens (<|output_start|> result <|output_end|>, rendered by the chat template's
`render_tool_output`) carry mask 0 and never end a row by themselves.

Stop strings match the visible text only: sampled tokens outside special tokens and calculator calls, what a
chat client gets as content (raychat.chat.turn), so a stop string never cuts a call's expression or matches
a result or a marker. A stop string that is a special token's text (e.g. "<|python_end|>", which serving
adds when the client runs the tools) is a stop token instead: the row ends when the model samples it (kept
in tokens, mask 1, its text not emitted).
"""

from __future__ import annotations

from collections import deque

from raychat.calculator import calculate
from raychat.chat_template import render_tool_output
from raychat.engine.detokenize import StreamDecoder
from raychat.engine.sampling import SamplingParams


def end_ids(tokenizer) -> frozenset[int]:
    """The ids of the tokens that end a row when sampled: <|assistant_end|> and <|bos|> (a base model's end of
    document)."""
    return frozenset((tokenizer.special_id("<|assistant_end|>"), tokenizer.bos_id))


class RowState:
    """State of one generating row.

    Args:
        tokenizer: raychat Tokenizer (special_id, encode, decode, iter_tokens).
        prompt: prompt token ids (non-empty).
        params: SamplingParams (max_tokens, stop).
        max_len: total tokens (prompt + completion) the row's cache can hold.
    """

    def __init__(self, tokenizer, prompt: list[int], params: SamplingParams, max_len: int):
        self.tokenizer = tokenizer
        self.tokens = list(prompt)
        self.mask = [0] * len(prompt)
        self.num_prompt_tokens = len(prompt)
        self.max_tokens = params.max_tokens
        self.max_len = max_len
        specials = tokenizer.special_tokens
        self._stop_ids = {specials[s] for s in params.stop if s in specials}
        self.decoder = StreamDecoder(tokenizer, [s for s in params.stop if s not in specials])
        self._specials = set(specials.values())
        self.finished = False
        self.finish_reason: str | None = None
        self._terminal = end_ids(tokenizer)
        self._python_start = tokenizer.special_id("<|python_start|>")
        self._python_end = tokenizer.special_id("<|python_end|>")
        self._forced: deque[int] = deque()
        self._python: list[int] | None = None

    @property
    def num_completion_tokens(self) -> int:
        return len(self.tokens) - self.num_prompt_tokens

    @property
    def needs_sample(self) -> bool:
        """False when the next token is a forced one (no sampling needed)."""
        return not self._forced

    @property
    def forced_token(self) -> int | None:
        """The forced tool-output token the next step takes, or None when the next token is sampled."""
        return self._forced[0] if self._forced else None

    def step(self, sampled: int | None) -> tuple[int, str]:
        """Append the next token (a pending forced token, else `sampled`); return (token, text delta)."""
        if self._forced:
            token, mask = self._forced.popleft(), 0
        else:
            if sampled is None:
                raise ValueError("a sampled token is required when no forced token is pending")
            token, mask = int(sampled), 1
        self.tokens.append(token)
        self.mask.append(mask)
        if mask == 1 and token in self._terminal:
            return token, self._finish("stop")
        if mask == 1:
            self._tool(token)
            if token in self._stop_ids:
                self.finished, self.finish_reason = True, "stop"
                return token, self.decoder.stop_here(self.tokenizer.decode([token]))
        visible = mask == 1 and token not in self._specials and self._python is None
        delta = self.decoder.push(token, visible)
        if self.decoder.stopped:
            self.finished, self.finish_reason = True, "stop"
            return token, delta
        if self.num_completion_tokens >= self.max_tokens or len(self.tokens) >= self.max_len:
            delta += self._finish("length")
        return token, delta

    def _tool(self, token: int) -> None:
        if token == self._python_start:
            self._python = []
        elif token == self._python_end and self._python is not None:
            result = calculate(self.tokenizer.decode(self._python))
            self._python = None
            if result is not None:
                self._forced.extend(render_tool_output(self.tokenizer, result))
        elif self._python is not None:
            self._python.append(token)

    def _finish(self, reason: str) -> str:
        self.finished, self.finish_reason = True, reason
        return self.decoder.finish()

    def cancel(self) -> None:
        self.finished, self.finish_reason = True, "cancelled"
