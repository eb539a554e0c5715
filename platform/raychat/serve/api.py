"""Request model of the chat endpoints (OpenAI Chat Completions), with limits and errors that name the field.

A request outside any limit is answered 400 in the error shape of raychat.serve.errors, `param` naming the
field (e.g. "messages[3].content", "top_logprobs"). Every OpenAI Chat Completions parameter is one of:
  honoured    model, messages, temperature 0..2 (default 1; 0 = greedy), top_p (0, 1] (default 1),
              max_completion_tokens and max_tokens 1..4096 (equal if both are given; default: until the
              model ends its turn or the row's context is full; the rendered conversation plus the value
              over max_seq_len is a 400 context_length_exceeded naming the field sent), n 1..8,
              seed 0..2**63-1, stop (a string or a list of 0..4 strings of 1..64 characters), stream,
              stream_options {include_usage, include_obfuscation; vLLM's continuous_usage_stats only
              false} (only with stream), logprobs,
              top_logprobs 0..20 (needs logprobs), tools (only the built-in "calculator" function),
              tool_choice ("auto"; needs tools), parallel_tool_calls, response_format ({"type": "text"}); and
              raychat's top_k -1..200 (0 = off; -1, vLLM's other "off", is read as 0)
  no effect   user, safety_identifier, prompt_cache_key, prompt_cache_retention, prompt_cache_options,
              metadata, store (false), service_tier ("auto" | "default"): accepted; nothing in the reply
              depends on them (raychat keeps no prompt cache and stores nothing)
  refused     frequency_penalty, presence_penalty, logit_bias, functions, function_call, audio, modalities,
              prediction, reasoning_effort, verbosity, web_search_options, moderation: 400 naming the
              parameter unless it is null or the value that changes nothing (REFUSED below)
  vLLM's      min_p, repetition_penalty, min_tokens, ignore_eos, stop_token_ids, include_stop_str_in_output,
              skip_special_tokens, add_generation_prompt, continue_final_message (what a vLLM client sends
              in extra_body): accepted at vLLM's default, which is raychat's behaviour, else refused like
              the group above (VLLM_CHAT_NOOP below)
A field that is none of these is an unknown field (400; raychat.serve.errors.unknown_field: the field it
misspells, else where the accepted fields are listed). `null` means "the default" for every optional field.
Numbers are strict: "0.5" (a string) or true is a wrong type, not a number; integers are accepted for floats;
NaN and Infinity (tokens Python's JSON parser reads) are refused as not finite.

Messages (1..500): roles system | developer (the same thing here) | user | assistant | tool. `content` is a
string or a list of {"type": "text", "text"} parts (joined with "\\n"), at most 8000 characters, valid Unicode
(no lone surrogate, which a JSON "\\ud800" escape can carry); null only for
an assistant message with tool_calls. All text together (contents, tool call arguments) is at most 32000
characters. Tool calls and their raychat form: docs/openai.md (raychat.serve.openai_messages renders them).

Body size: MAX_BODY_BYTES = 512 KiB, refused with 413 before JSON parsing. Bound on a valid body: 32000
characters written as JSON \\u escapes of UTF-16 surrogate pairs take 6 bytes per UTF-16 unit, at most
12 bytes per character = 384000 bytes, plus field names and punctuation of 500 messages (< 40 kB).
"""

from __future__ import annotations

import json
from typing import Annotated, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    StrictBool,
    StrictFloat,
    StrictInt,
    StrictStr,
    ValidationInfo,
    field_validator,
)

ROLES = ("system", "developer", "user", "assistant", "tool")
CALCULATOR = "calculator"
MAX_MESSAGES = 500
MAX_CONTENT_CHARS = 8000
MAX_TOTAL_CHARS = 32000
MAX_TOKENS = 4096
MAX_TOP_K = 200
MAX_TEMPERATURE = 2.0
MAX_N = 8
MAX_STOP = 4
MAX_STOP_CHARS = 64
MAX_TOOL_CALLS = 16
MAX_TOP_LOGPROBS = 20
MAX_BODY_BYTES = 512 * 1024
MAX_ARGUMENTS_NESTING = 32  # a calculator call's arguments are one flat object; deeper is refused unparsed

Number = Annotated[StrictFloat, Field(allow_inf_nan=False)] | StrictInt  # NaN (JSON's NaN token) read ">= 0"
Id = Annotated[StrictStr, Field(min_length=1, max_length=256)]
# top_k 0 = off; vLLM's other "off", -1, is read as 0
TopK = Annotated[StrictInt, Field(ge=-1, le=MAX_TOP_K), AfterValidator(lambda k: max(k, 0))]

# refused parameter -> the values that change nothing (accepted)
REFUSED: dict[str, tuple] = {
    "frequency_penalty": (None, 0, 0.0),
    "presence_penalty": (None, 0, 0.0),
    "logit_bias": (None, {}),
    "functions": (None, []),
    "function_call": (None, "none"),
    "audio": (None,),
    "modalities": (None, ["text"]),
    "prediction": (None,),
    "reasoning_effort": (None,),
    "verbosity": (None,),
    "web_search_options": (None,),
    "moderation": (None,),
}
# vLLM's sampling extensions (its SamplingParams, which the openai clients send in extra_body) -> the values
# that change nothing here: vLLM's defaults, which are raychat's behaviour (generation ends at the model's end
# of turn; a stop string is never part of the text)
VLLM_NOOP: dict[str, tuple] = {
    "min_p": (None, 0, 0.0),
    "repetition_penalty": (None, 1, 1.0),
    "min_tokens": (None, 0),
    "ignore_eos": (None, False),
    "stop_token_ids": (None, []),
    "include_stop_str_in_output": (None, False),
}
# and on the chat routes, where no control token reaches the client and the template always opens the reply
VLLM_CHAT_NOOP = {
    **VLLM_NOOP,
    "skip_special_tokens": (None, True),
    "add_generation_prompt": (None, True),
    "continue_final_message": (None, False),
}
# parameter -> (the parameter it needs true, the message when it is not)
NEEDS = {
    "stream_options": ("stream", "only allowed when stream is true"),
    "top_logprobs": ("logprobs", "needs logprobs: true"),
}
NO_EFFECT = (
    "user",
    "safety_identifier",
    "prompt_cache_key",
    "prompt_cache_retention",
    "prompt_cache_options",
    "metadata",
    "store",
    "service_tier",
)
HONOURED = (
    "model", "messages", "temperature", "top_p", "max_completion_tokens", "max_tokens", "n", "seed", "stop",
    "stream", "stream_options", "logprobs", "top_logprobs", "tools", "tool_choice", "parallel_tool_calls",
    "response_format",
)  # fmt: skip
EXTENSIONS = ("top_k",)


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class TextPart(_Strict):
    type: Literal["text"]
    text: StrictStr
    prompt_cache_breakpoint: dict | None = None  # a prompt-cache hint: no effect here


class FunctionCall(_Strict):
    name: StrictStr
    arguments: Annotated[StrictStr, AfterValidator(unicode_text)]
    parsed_arguments: dict | None = None  # added by openai's stream helpers; derived from arguments


class ToolRun(_Strict):
    """raychat's record of a call the server ran (docs/openai.md): where it sits in the message's content
    (characters of content before it) and the calculator's output (absent: the calculator refused it)."""

    offset: Annotated[StrictInt, Field(ge=0)]
    output: Annotated[StrictStr | None, AfterValidator(unicode_text)] = None


class ToolCall(_Strict):
    id: Id
    type: Literal["function"] = "function"
    function: FunctionCall
    raychat: ToolRun | None = None
    index: StrictInt | None = None  # kept by clients that accumulate streamed deltas; not used

    @field_validator("function")
    @classmethod
    def _calculator(cls, function: FunctionCall) -> FunctionCall:
        expression_of(function)
        return function


def only_noop(value, allowed: tuple):
    """`value` when it equals (with its type) one of `allowed`, the values of an OpenAI or vLLM field that
    change nothing here; raises ValueError naming them otherwise (the field raychat does not support)."""
    if not any(value == a and type(value) is type(a) for a in allowed):
        shown = [a for a in allowed if not (isinstance(a, float) and int(a) in allowed)]  # 0, not 0 or 0.0
        noop = " or ".join("null" if a is None else json.dumps(a) for a in shown)
        raise ValueError(f"not supported by raychat; only {noop} is accepted")
    return value


def noop_validator(noop: dict[str, tuple]):
    """A request model's "before" validator of the fields in `noop` (field -> the values that change nothing):
    each accepts only its no-op values (only_noop), else ValueError naming them. Assign it in the class body."""

    def refused(cls, value, info: ValidationInfo):
        return only_noop(value, noop[info.field_name])

    return field_validator(*noop, mode="before")(refused)


def lone_surrogate(text: str) -> str | None:
    """Why `text` is not valid Unicode text (a lone UTF-16 surrogate, which JSON's "\\ud800" escape can carry
    and which has no UTF-8 encoding), or None."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        return f"has a lone surrogate (U+{ord(text[e.start]):04X}) at character {e.start}: not valid Unicode text"
    return None


def stop_strings(stop: str | list[str] | None) -> list[str]:
    """`stop` of a request as a list (0 to MAX_STOP strings of 1 to MAX_STOP_CHARS characters each).
    Raises ValueError naming the limit that is broken."""
    items = [stop] if isinstance(stop, str) else stop or []
    if len(items) > MAX_STOP:
        raise ValueError(f"must hold 0 to {MAX_STOP} strings, got {len(items)}")
    for s in items:
        if not 1 <= len(s) <= MAX_STOP_CHARS:
            raise ValueError(f"each stop string must have 1 to {MAX_STOP_CHARS} characters, got {len(s)}")
        unicode_text(s)  # a lone surrogate could never match the text
    return items


def unicode_text(text: str | None) -> str | None:
    """`text` itself, once it is valid Unicode text; raises ValueError with lone_surrogate's reason (what the
    template renders: a lone surrogate would reach the model as U+FFFD)."""
    why = lone_surrogate(text) if text is not None else None
    if why:
        raise ValueError(why)
    return text


Stop = Annotated[StrictStr | list[StrictStr] | None, AfterValidator(stop_strings)]


def _nesting(text: str) -> int:
    """How deep JSON `text` nests arrays and objects (brackets inside strings do not count)."""
    depth = deepest = 0
    in_string = escaped = False
    for ch in text:
        if in_string:
            escaped, in_string = (False, True) if escaped else (ch == "\\", ch != '"')
        elif ch == '"':
            in_string = True
        elif ch in "[{":
            depth += 1
            deepest = max(deepest, depth)
        elif ch in "]}":
            depth -= 1
    return deepest


def expression_of(function: FunctionCall) -> str:
    """The calculator expression of a call: arguments must be the JSON object {"expression": str}, the
    expression valid Unicode text (lone_surrogate)."""
    if function.name != CALCULATOR:
        raise ValueError(f"only the built-in {CALCULATOR!r} function exists here, got {function.name!r}")
    if _nesting(function.arguments) > MAX_ARGUMENTS_NESTING:  # json.loads would recurse that deep
        raise ValueError(
            f"arguments must be a JSON object, got JSON nested over {MAX_ARGUMENTS_NESTING} deep"
        )
    try:
        args = json.loads(function.arguments)
    except json.JSONDecodeError as e:
        raise ValueError(f"arguments must be a JSON object, got invalid JSON ({e.msg})") from None
    if not isinstance(args, dict) or set(args) != {"expression"} or not isinstance(args["expression"], str):
        raise ValueError('arguments must be the JSON object {"expression": "<arithmetic>"}')
    if why := lone_surrogate(args["expression"]):
        raise ValueError(f"arguments: the expression {why}")
    return args["expression"]


Content = StrictStr | list[TextPart] | None


def content_text(content: Content) -> str | None:
    """A message's content as one string (text parts joined with "\\n"), None for null."""
    if content is None or isinstance(content, str):
        return content
    return "\n".join(p.text for p in content)


class Message(_Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    tool_calls: list[ToolCall] | None = Field(default=None, max_length=MAX_TOOL_CALLS)
    tool_call_id: Id | None = Field(default=None, validate_default=True)
    content: Content = Field(default=None, validate_default=True)
    name: StrictStr | None = None
    refusal: None = None  # response-only fields, accepted as null so a returned message can be sent back
    audio: None = None
    function_call: None = None
    annotations: list | None = None
    parsed: None = None  # added by openai's parse helpers

    @field_validator("tool_calls")
    @classmethod
    def _assistant_only(cls, calls, info: ValidationInfo):
        if calls is not None and info.data.get("role") != "assistant":
            raise ValueError("only an assistant message has tool_calls")
        return calls

    @field_validator("tool_call_id")
    @classmethod
    def _tool_call_id(cls, value, info: ValidationInfo):
        role = info.data.get("role")
        if role == "tool" and value is None:
            raise ValueError("field required (the id of the tool call this message answers)")
        if role not in (None, "tool") and value is not None:
            raise ValueError("only a tool message has a tool_call_id")
        return value

    @field_validator("content", mode="before")
    @classmethod
    def _text_parts_only(cls, content):
        for j, part in enumerate(content if isinstance(content, list) else ()):
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            if kind != "text":
                raise ValueError(f"part {j}: only text parts are supported here, got {kind!r}")
        return content

    @field_validator("content")
    @classmethod
    def _content(cls, content, info: ValidationInfo):
        if content is None and not (info.data.get("role") == "assistant" and info.data.get("tool_calls")):
            raise ValueError("field required (null only for an assistant message with tool_calls)")
        text = content_text(content) or ""
        if len(text) > MAX_CONTENT_CHARS:
            raise ValueError(f"{len(text)} characters; at most {MAX_CONTENT_CHARS} allowed")
        why = lone_surrogate(text)  # the template would encode it as U+FFFD: the model reads other text
        if why:
            raise ValueError(why)
        return content

    @field_validator("name")
    @classmethod
    def _no_name(cls, name):
        if name is not None:
            raise ValueError("participant names are not supported (the chat template has no place for them)")
        return name

    @property
    def text(self) -> str:
        return content_text(self.content) or ""


class StreamOptions(_Strict):
    include_usage: StrictBool | None = None
    include_obfuscation: StrictBool | None = None  # no effect: chunks carry no obfuscation padding
    continuous_usage_stats: Literal[False] | None = None  # vLLM's usage in every chunk: not supported

    _vllm = noop_validator({"continuous_usage_stats": (None, False)})


class ToolFunction(_Strict):
    name: StrictStr
    description: StrictStr | None = None
    parameters: dict | None = None
    strict: StrictBool | None = None


class Tool(_Strict):
    type: Literal["function"]
    function: ToolFunction

    @field_validator("function")
    @classmethod
    def _calculator(cls, function: ToolFunction) -> ToolFunction:
        if function.name != CALCULATOR:
            raise ValueError(f"only the built-in {CALCULATOR!r} tool exists here, got {function.name!r}")
        return function


class ResponseFormat(_Strict):
    type: StrictStr

    @field_validator("type")
    @classmethod
    def _text(cls, kind: str) -> str:
        if kind != "text":
            raise ValueError(f"only 'text' is supported (no constrained decoding here), got {kind!r}")
        return kind


def _total_chars(messages: list[Message]) -> int:
    calls = (c.function.arguments for m in messages for c in m.tool_calls or ())
    return sum(len(m.text) for m in messages) + sum(len(a) for a in calls)


class ChatRequest(_Strict):
    """Body of POST /chat/completions and POST /v1/chat/completions (see the module doc)."""

    messages: Annotated[list[Message], Field(min_length=1, max_length=MAX_MESSAGES)]
    model: StrictStr | None = None
    temperature: Annotated[Number, Field(ge=0.0, le=MAX_TEMPERATURE)] | None = None
    top_p: Annotated[Number, Field(gt=0.0, le=1.0)] | None = None
    top_k: TopK | None = None
    max_tokens: Annotated[StrictInt, Field(ge=1, le=MAX_TOKENS)] | None = None
    max_completion_tokens: Annotated[StrictInt, Field(ge=1, le=MAX_TOKENS)] | None = None
    n: Annotated[StrictInt, Field(ge=1, le=MAX_N)] | None = None
    seed: Annotated[StrictInt, Field(ge=0, le=2**63 - 1)] | None = None
    stop: Stop = None
    stream: StrictBool | None = None
    stream_options: StreamOptions | None = None
    logprobs: StrictBool | None = None
    top_logprobs: Annotated[StrictInt, Field(ge=0, le=MAX_TOP_LOGPROBS)] | None = None
    tools: Annotated[list[Tool], Field(max_length=1)] | None = None
    tool_choice: Literal["auto"] | None = None
    parallel_tool_calls: StrictBool | None = None
    response_format: ResponseFormat | None = None
    user: Id | None = None
    safety_identifier: Id | None = None
    prompt_cache_key: Id | None = None
    prompt_cache_retention: Literal["in_memory", "24h"] | None = None
    prompt_cache_options: dict | None = None
    metadata: Annotated[dict[StrictStr, StrictStr], Field(max_length=16)] | None = None
    store: Literal[False] | None = None
    service_tier: Literal["auto", "default"] | None = None
    # refused: the schema admits only the values that change nothing (REFUSED)
    frequency_penalty: Literal[0] | None = None
    presence_penalty: Literal[0] | None = None
    logit_bias: Annotated[dict[StrictStr, Number], Field(max_length=0)] | None = None
    functions: Annotated[list[dict], Field(max_length=0)] | None = None
    function_call: Literal["none"] | None = None
    audio: None = None
    modalities: Annotated[list[Literal["text"]], Field(min_length=1, max_length=1)] | None = None
    prediction: None = None
    reasoning_effort: None = None
    verbosity: None = None
    web_search_options: None = None
    moderation: None = None
    # vLLM's extensions: the schema admits only the values that change nothing (VLLM_CHAT_NOOP)
    min_p: Literal[0] | None = None
    repetition_penalty: Literal[1] | None = None
    min_tokens: Literal[0] | None = None
    ignore_eos: Literal[False] | None = None
    stop_token_ids: Annotated[list[StrictInt], Field(max_length=0)] | None = None
    include_stop_str_in_output: Literal[False] | None = None
    skip_special_tokens: Literal[True] | None = None
    add_generation_prompt: Literal[True] | None = None
    continue_final_message: Literal[False] | None = None

    @field_validator("messages")
    @classmethod
    def _total(cls, messages: list[Message]) -> list[Message]:
        total = _total_chars(messages)
        if total > MAX_TOTAL_CHARS:
            raise ValueError(f"total content is {total} characters; at most {MAX_TOTAL_CHARS} allowed")
        return messages

    @field_validator("max_completion_tokens")
    @classmethod
    def _one_limit(cls, value, info: ValidationInfo):
        other = info.data.get("max_tokens")
        if value is not None and other is not None and value != other:
            raise ValueError(f"conflicts with max_tokens ({other}); send one of them (or equal values)")
        return value

    @field_validator(*NEEDS)
    @classmethod
    def _needs(cls, value, info: ValidationInfo):
        other, message = NEEDS[info.field_name]
        if value is not None and not info.data.get(other):
            raise ValueError(message)
        return value

    @field_validator("tool_choice", mode="before")
    @classmethod
    def _tool_choice(cls, choice, info: ValidationInfo):
        if choice is None:
            return None
        if not info.data.get("tools"):
            raise ValueError("only allowed when tools are given")
        if choice != "auto":
            raise ValueError(f"only 'auto' is supported (the model decides when to call), got {choice!r}")
        return choice

    _refused = noop_validator({**REFUSED, **VLLM_CHAT_NOOP})

    @property
    def max_completion(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens

    @property
    def client_tools(self) -> bool:
        """True when the client declared the calculator: it runs the calls itself (docs/openai.md)."""
        return bool(self.tools)
