"""OpenAI chat messages -> the chat template's messages (raychat.chat_template), one for one, so that a
history holding tool calls renders to exactly the tokens the model generated. docs/openai.md has the shapes.

  system | developer   -> system (content as one string)
  user                 -> user
  assistant            -> assistant with parts: its text, and for each tool call a python part (the
                          call's "expression"); a call the server ran (it carries "raychat": {"offset",
                          "output"}) sits at `offset` characters into the content, followed by a
                          python_output part with its output (none when the calculator refused it)
  tool                 -> tool (rendered like python_output), answering the client-run call of the
                          assistant message right before it

A client-run call (no "raychat" field: the client declared the calculator in `tools` and ran it) must be
the only call of its message and be answered by the next message, a tool message with its id: raychat's
model calls one tool at a time, and its template puts the result right after the call.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

from raychat.chat_template import validate_messages
from raychat.engine.runner import derive_seed
from raychat.serve.api import ChatRequest, Message, expression_of
from raychat.serve.errors import ParamError


def template_messages(messages: Sequence[Message]) -> list[dict]:
    """The template's messages for a validated OpenAI history that ends with a user or a tool message.

    Raises:
        ParamError: naming the message ("messages[3].tool_call_id", ...) when the tool calls do not fit
            the template, or the role order is one the template refuses (e.g. a system message after a
            user message, two user messages in a row, a history that ends with an assistant message).
    """
    out: list[dict] = []
    pending: tuple[int, str] | None = None  # (message index, id) of a client-run call awaiting its answer
    for i, m in enumerate(messages):
        if pending is not None and m.role != "tool":
            j, call_id = pending
            raise ParamError(
                f"messages[{i}]",
                f"messages[{j}].tool_calls[0] ({call_id!r}) needs a tool message answering it right after it",
            )
        if m.role in ("system", "developer"):
            out.append({"role": "system", "content": m.text})
        elif m.role == "user":
            out.append({"role": "user", "content": m.text})
        elif m.role == "assistant":
            parts, pending_id = _assistant_parts(m, i)
            out.append({"role": "assistant", "content": parts})
            pending = None if pending_id is None else (i, pending_id)
        else:
            if pending is None or m.tool_call_id != pending[1]:
                expected = (
                    "no client-run tool call is open" if pending is None else f"expected {pending[1]!r}"
                )
                raise ParamError(
                    f"messages[{i}].tool_call_id",
                    f"{m.tool_call_id!r} answers no call of the message before it ({expected})",
                )
            out.append({"role": "tool", "content": m.text})
            pending = None
    try:
        validate_messages(out, open_turn=True)
    except ValueError as e:
        raise ParamError("messages", re.sub(r"^message (\d+)", r"messages[\1]", str(e))) from None
    if out[-1]["role"] not in ("user", "tool"):
        raise ParamError(
            "messages", f"the last message must be a user (or tool) message, got {out[-1]['role']!r}"
        )
    return out


def _assistant_parts(m: Message, i: int) -> tuple[list[dict], str | None]:
    """(template parts, id of the client-run call the next message must answer or None)."""
    calls = m.tool_calls or []
    text = m.text
    server = [c for c in calls if c.raychat is not None]
    if not calls:
        return [{"type": "text", "text": text}], None
    if len(server) not in (0, len(calls)):
        raise ParamError(
            f"messages[{i}].tool_calls",
            "mixes calls the server ran (with a 'raychat' field) and calls for the client to run",
        )
    if not server:
        if len(calls) > 1:
            raise ParamError(
                f"messages[{i}].tool_calls",
                f"{len(calls)} calls; raychat's model calls one tool at a time: send one call per assistant "
                "message, each followed by its tool message",
            )
        parts = [{"type": "text", "text": text}] if text else []
        return [*parts, {"type": "python", "text": expression_of(calls[0].function)}], calls[0].id
    parts, start = [], 0
    for k, call in enumerate(calls):
        offset = call.raychat.offset
        if not start <= offset <= len(text):
            raise ParamError(
                f"messages[{i}].tool_calls[{k}].raychat.offset",
                f"{offset} is outside {start}..{len(text)} (characters of content, after the call before)",
            )
        if offset > start:
            parts.append({"type": "text", "text": text[start:offset]})
        parts.append({"type": "python", "text": expression_of(call.function)})
        if call.raychat.output is not None:
            parts.append({"type": "python_output", "text": call.raychat.output})
        start = offset
    if start < len(text):
        parts.append({"type": "text", "text": text[start:]})
    return parts, None


def engine_requests(body: ChatRequest) -> list[dict]:
    """The engine requests (raychat.serve.server) of a validated request's n choices. Choice 0 uses the
    request's seed, choice i >= 1 derive_seed(seed, i) (raychat.engine.runner), so the choices differ and
    each is reproducible; n=1 with a seed is choice 0 of any n with that seed.

    Raises:
        ParamError: from template_messages.
    """
    base = {
        "messages": template_messages(body.messages),
        "temperature": None if body.temperature is None else float(body.temperature),
        "top_k": body.top_k,
        "top_p": None if body.top_p is None else float(body.top_p),
        "max_tokens": body.max_completion,
        "max_tokens_param": "max_completion_tokens"
        if body.max_completion_tokens is not None
        else "max_tokens",
        "stop": list(body.stop or []),
        "logprobs": bool(body.logprobs),
        "top_logprobs": body.top_logprobs or 0,
        "client_tools": body.client_tools,
    }
    seeds = [
        body.seed if i == 0 or body.seed is None else derive_seed(body.seed, i) for i in range(body.n or 1)
    ]
    return [{**base, "seed": seed} for seed in seeds]
