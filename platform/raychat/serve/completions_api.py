"""Request model of POST /v1/completions (OpenAI's legacy Completions: raw text in, raw text out, no chat
template), with limits and errors that name the field (400 in the shape of raychat.serve.errors).

Parameters:
  honoured    prompt (required): a string, a token array (list of ids), or a batch of 1..MAX_PROMPTS of
              either (one choice per prompt, choice i = prompt i). A string is encoded as plain text with no
              <|bos|> added (as the HF export's tokenizer does: add_bos_token false); send ids to start with
              <|bos|>. At most MAX_PROMPT_CHARS characters per string; ids must be in 0..vocab_size-1 and a
              prompt must leave room in a row of max_seq_len tokens (else 400 naming "prompt" / "prompt[i]").
              model, max_tokens 0..4096 (default 16, or what the row leaves after the prompt when that is
              less; 0 = no completion: with echo, the prompt alone; prompt + max_tokens over max_seq_len: 400
              context_length_exceeded naming max_tokens),
              temperature 0..2 (default 1; 0 = greedy), top_p (0, 1], seed, stop (a string or 0..4 strings of
              1..64 characters, never part of the text), stream, stream_options {include_usage} (only with
              stream), echo (the choice's text starts with the prompt; with logprobs, the prompt's tokens get
              logprobs too: the first token's is null), logprobs 0..MAX_LOGPROBS (token_logprobs of every
              token, top_logprobs: that many most likely alternatives per token plus the token itself, so up
              to logprobs + 1 entries), n and best_of (only 1); and raychat's top_k -1..200 (0 or -1 = off)
  no effect   user
  refused     suffix, frequency_penalty, presence_penalty, logit_bias: 400 unless null or the value that
              changes nothing
  vLLM's      min_p, repetition_penalty, min_tokens, ignore_eos, stop_token_ids, include_stop_str_in_output:
              accepted at vLLM's default (raychat's behaviour), else refused the same way
              (raychat.serve.api.VLLM_NOOP)
Logprobs are the model's log-softmax (fp32): for the prompt its raw distribution (engine/scoring.py), for
completion tokens the temperature-scaled one (engine/sampling.py). An -inf logprob is sent as -9999.0.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field, StrictBool, StrictInt, StrictStr, ValidationInfo, field_validator

from raychat.serve.api import (
    MAX_TEMPERATURE,
    MAX_TOKENS,
    MAX_TOTAL_CHARS,
    VLLM_NOOP,
    Id,
    Number,
    Stop,
    StreamOptions,
    TopK,
    _Strict,
    lone_surrogate,
    noop_validator,
)

MAX_PROMPTS = 32
MAX_PROMPT_CHARS = MAX_TOTAL_CHARS
MAX_LOGPROBS = 5  # OpenAI's limit for the legacy endpoint
DEFAULT_MAX_TOKENS = 16  # OpenAI's default for the legacy endpoint
REFUSED = {
    "suffix": (None,),
    "frequency_penalty": (None, 0, 0.0),
    "presence_penalty": (None, 0, 0.0),
    "logit_bias": (None, {}),
}
PromptIds = list[StrictInt]
Prompt = StrictStr | PromptIds | list[StrictStr] | list[PromptIds]


def _prompt_error(prompt) -> str | None:
    """Why `prompt` is not a string, a token array or a batch of 1..MAX_PROMPTS of either; None if it is."""
    if isinstance(prompt, str):
        return _string_error(prompt)
    if not isinstance(prompt, list) or not prompt:
        return "must be a string, a list of token ids or a non-empty list of either"
    if all(type(t) is int for t in prompt):
        return None
    if all(isinstance(p, str) for p in prompt) or all(isinstance(p, list) for p in prompt):
        if len(prompt) > MAX_PROMPTS:
            return f"a batch of {len(prompt)} prompts; at most {MAX_PROMPTS} allowed"
        for i, p in enumerate(prompt):
            why = _string_error(p) if isinstance(p, str) else _ids_error(p)
            if why:
                return f"prompt[{i}] {why}"
        return None
    return "must be a string, a list of token ids (ints), a list of strings or a list of token-id lists"


def _string_error(text: str) -> str | None:
    if len(text) > MAX_PROMPT_CHARS:
        return f"has {len(text)} characters; at most {MAX_PROMPT_CHARS} allowed"
    return lone_surrogate(text)  # echo sends the prompt back as UTF-8


def _ids_error(ids: list) -> str | None:
    if not ids:
        return "is an empty token list"
    if not all(type(t) is int for t in ids):
        return "must hold token ids (ints) only"
    return None


class CompletionRequest(_Strict):
    """Body of POST /v1/completions (see the module doc)."""

    prompt: Prompt
    model: StrictStr | None = None
    max_tokens: Annotated[StrictInt, Field(ge=0, le=MAX_TOKENS)] | None = None
    temperature: Annotated[Number, Field(ge=0.0, le=MAX_TEMPERATURE)] | None = None
    top_p: Annotated[Number, Field(gt=0.0, le=1.0)] | None = None
    top_k: TopK | None = None
    n: Literal[1] | None = None
    best_of: Literal[1] | None = None
    seed: Annotated[StrictInt, Field(ge=0, le=2**63 - 1)] | None = None
    stop: Stop = None
    stream: StrictBool | None = None
    stream_options: StreamOptions | None = None
    echo: StrictBool | None = None
    logprobs: Annotated[StrictInt, Field(ge=0, le=MAX_LOGPROBS)] | None = None
    user: Id | None = None
    suffix: None = None
    frequency_penalty: Literal[0] | None = None
    presence_penalty: Literal[0] | None = None
    logit_bias: Annotated[dict[StrictStr, Number], Field(max_length=0)] | None = None
    # vLLM's extensions: only the values that change nothing (raychat.serve.api.VLLM_NOOP)
    min_p: Literal[0] | None = None
    repetition_penalty: Literal[1] | None = None
    min_tokens: Literal[0] | None = None
    ignore_eos: Literal[False] | None = None
    stop_token_ids: Annotated[list[StrictInt], Field(max_length=0)] | None = None
    include_stop_str_in_output: Literal[False] | None = None

    @field_validator("prompt", mode="before")
    @classmethod
    def _prompt(cls, prompt):
        why = _prompt_error(prompt)
        if why:
            raise ValueError(why)
        return prompt

    @field_validator("stream_options")
    @classmethod
    def _needs_stream(cls, value, info: ValidationInfo):
        if value is not None and not info.data.get("stream"):
            raise ValueError("only allowed when stream is true")
        return value

    _refused = noop_validator({**REFUSED, **VLLM_NOOP})

    @property
    def batched(self) -> bool:
        """True when `prompt` is a list of prompts (strings or token arrays), not one prompt."""
        return not (isinstance(self.prompt, str) or all(type(t) is int for t in self.prompt))

    @property
    def prompts(self) -> list[str | list[int]]:
        """The prompts of the batch (a single prompt is a batch of one)."""
        return list(self.prompt) if self.batched else [self.prompt]


def engine_requests(body: CompletionRequest) -> list[dict]:
    """The engine requests (raychat.serve.server: the "prompt" form) of a validated request, one per prompt:
    {"prompt": str | [int], "param": "prompt" | "prompt[i]" (the field an error names), "echo", "max_tokens"
    (>= 0, or None when not sent: the server's default), "logprobs" (None or 0..MAX_LOGPROBS), "temperature",
    "top_k", "top_p", "seed", "stop"}."""
    return [
        {
            "prompt": p,
            "param": f"prompt[{i}]" if body.batched else "prompt",
            "echo": bool(body.echo),
            "max_tokens": body.max_tokens,
            "logprobs": body.logprobs,
            "temperature": None if body.temperature is None else float(body.temperature),
            "top_k": body.top_k,
            "top_p": None if body.top_p is None else float(body.top_p),
            "seed": body.seed,
            "stop": list(body.stop or []),
        }
        for i, p in enumerate(body.prompts)
    ]
