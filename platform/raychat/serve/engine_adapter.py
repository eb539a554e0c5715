"""What the serving layer needs from raychat.engine, in one place: SamplingParams from an engine request,
and per-token logprobs from StreamEvents in OpenAI's shape.

The engine's logprobs contract as used here:
  SamplingParams(..., logprobs: bool, top_logprobs: int)   top_logprobs 0..20 alternatives per token
  StreamEvent.logprobs: list | None    one entry per token of event.token_ids (None for a token without
                                       one, e.g. a forced tool-output token), each with
                                       .logprob: float (ln p of the token under the model's distribution)
                                       .top_logprobs: list of (token_id, logprob), most likely first
A token's entry reaches the client with the text it starts in (LogprobGate), so a reply's logprobs end where
its text does: a stop string's tokens, held back with its text, are dropped with it.
"""

from __future__ import annotations

import codecs
import math

from raychat.chat.turn import TEXT
from raychat.chat_template import MARKERS
from raychat.engine import SamplingParams, stop_strings
from raychat.engine.scheduler import completion_overflow
from raychat.serve.errors import ContextLengthError

# OpenAI's stand-in for a logprob that is -inf (a token the filters excluded): JSON has no infinity
MIN_LOGPROB = -9999.0


def sampling_params(request: dict, max_len: int) -> SamplingParams:
    """SamplingParams of an engine request (ChatServer's `request` dict; max_tokens None = the row's
    max_len). A request with client_tools stops right after a call's <|python_end|> (docs/openai.md).

    Raises:
        ValueError: SamplingParams' own checks.
    """
    stop = stop_strings(request.get("stop"))
    if request.get("client_tools"):
        stop += (MARKERS["python_end"],)
    kwargs = {
        "max_tokens": request.get("max_tokens") or max_len,
        "temperature": 1.0 if request.get("temperature") is None else request["temperature"],
        "top_k": request.get("top_k") or None,
        "top_p": request.get("top_p"),
        "seed": request.get("seed"),
        "stop": stop,
    }
    if request.get("logprobs"):
        kwargs.update(logprobs=True, top_logprobs=request.get("top_logprobs") or 0)
    return SamplingParams(**kwargs)


def check_max_tokens(prompt_tokens: int, request: dict, max_len: int, prompt: str) -> None:
    """Refuse an engine request whose max_tokens (None: not sent, the default fills what is left) does not fit
    after its prompt of `prompt_tokens` tokens in a row of `max_len` tokens (OpenAI's and vLLM's 400), before
    the engine sees it. `prompt` names the prompt in the message ("the conversation", "prompt[1]").

    Raises:
        ContextLengthError: prompt_tokens + max_tokens > max_len; its param is request["max_tokens_param"] (the
            field the client sent: "max_tokens" or "max_completion_tokens"), default "max_tokens".
    """
    max_tokens = request.get("max_tokens")
    why = None if max_tokens is None else completion_overflow(prompt_tokens, max_tokens, max_len, prompt)
    if why:
        raise ContextLengthError(why, request.get("max_tokens_param") or "max_tokens")


def _finite(logprob: float) -> float:
    return float(logprob) if math.isfinite(logprob) else MIN_LOGPROB


def _token(tokenizer, token_id: int, logprob: float) -> dict:
    data = b"".join(tokenizer.iter_tokens([token_id]))
    return {"token": data.decode("utf-8", errors="replace"), "bytes": list(data), "logprob": _finite(logprob)}


def text_logprobs(tokenizer, event, kinds: list[str]) -> list[dict | None]:
    """OpenAI ChatCompletionTokenLogprob dicts for the tokens of `event` (kinds from TurnParser.push), one per
    token (none when the event has no logprobs), None for a token that is not text or has no logprob:
    {"token", "bytes", "logprob", "top_logprobs": [{"token", "bytes", "logprob"}, ...]}."""
    entries = getattr(event, "logprobs", None) or ()
    out: list[dict | None] = []
    for token_id, kind, entry in zip(event.token_ids, kinds, entries):
        if kind != TEXT or entry is None:
            out.append(None)
            continue
        item = _token(tokenizer, token_id, entry.logprob)
        item["top_logprobs"] = [_token(tokenizer, t, lp) for t, lp in entry.top_logprobs]
        out.append(item)
    return out


class LogprobGate:
    """Per-token logprob entries released with the text they start in: an entry waits while the engine holds
    its token's text back (it may begin a stop string) and is dropped when the request ends without that text
    (a stop string and all after it), so the entries sent cover the text sent and nothing past it. A token
    that a stop string cuts keeps its entry (its first characters are text). Positions are characters of the
    incremental UTF-8 decode of every token, which is what the engine's released text counts
    (raychat.engine.detokenize: U+FFFD for invalid bytes, markers as their text).

    `end_ids`: token ids that end a row (raychat.engine.row_state.end_ids); a request whose last token is one
    gets that token's entry too, though its text is never sent, as OpenAI's and vLLM's completions list the end
    token: lm-evaluation-harness reads a loglikelihood request's answer as the prompt's entries then exactly one
    generated token's, and without it took the last prompt token's for the generated one."""

    def __init__(self, tokenizer, end_ids: frozenset[int] = frozenset()):
        self._tokenizer = tokenizer
        self._end_ids = end_ids
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._decoded = self._released = 0
        self._held: list[tuple[int, dict]] = []  # (character where the token's text starts, its entry)

    def push(self, token_ids, entries, released_text: str, final: bool) -> list[dict]:
        """Add an event's tokens with their entries (one per token; None: none to send) and the text the engine
        released with them; returns the entries released now, in token order. final: the request's last
        event (what is still held is dropped)."""
        for token_id, entry in zip(token_ids, entries):
            start = self._decoded
            data = b"".join(self._tokenizer.iter_tokens([token_id]))
            self._decoded += len(self._utf8.decode(data, final=False))
            if entry is not None:
                self._held.append((start, entry))
        self._released += len(released_text)
        n = next((k for k, (start, _) in enumerate(self._held) if start >= self._released), len(self._held))
        out = [entry for _, entry in self._held[:n]]
        last = entries[-1] if token_ids else None
        if final and last is not None and token_ids[-1] in self._end_ids and all(e is not last for e in out):
            out.append(last)
        self._held = [] if final else self._held[n:]
        return out
