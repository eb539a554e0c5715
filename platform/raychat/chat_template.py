"""The ONE chat template: conversation -> token ids + per-token supervision (SFT, RL prompts, eval, serving).

Layout (every piece is its own span, encoded on its own, so tokenization never crosses a span boundary):

    <|bos|>
    <|user_start|> [system content] [SYSTEM_SEPARATOR] user content <|user_end|>
    <|assistant_start|> text | <|python_start|> expr <|python_end|> | <|output_start|> result <|output_end|>
        ... <|assistant_end|>
    <|user_start|> ... (next exchange)

Rules (TEMPLATE_SPEC, hashed into TEMPLATE_VERSION):
- BOS exactly once, at the start. Content is encoded with `Tokenizer.encode` (encode_ordinary), so text such
  as "<|assistant_end|>" inside any message is plain text and never a control token.
- System message: allowed only as message 0; its content is carried at the start of the FIRST user turn,
  followed by SYSTEM_SEPARATOR ("\\n\\n") and the user content (there is no system marker). Truncation keeps it
  and re-attaches it to the first surviving user turn.
- Role order: [system] user assistant (user assistant)* ... An assistant message may be followed by a "tool"
  message only if it ends with a python call; a tool message must be followed by an assistant message. The
  assistant turn (all assistant and tool messages between two user messages) is ONE turn: one
  <|assistant_start|> and one <|assistant_end|>. A conversation may end with a user message (not supervised).
- An assistant message's content is a string or a list of parts {"type": "text"|"python"|"python_output",
  "text": str}; a python_output part is rendered exactly like a "tool" message.
- Supervision (a token is a target when it is PREDICTED; see raychat.masks): assistant text, python call
  tokens (<|python_start|> expr <|python_end|>) and <|assistant_end|> are targets; BOS, user/system tokens,
  <|assistant_start|> and tool output (<|output_start|> result <|output_end|>) are input only.
- render_for_completion: the prompt of a conversation that ends with a user message, plus <|assistant_start|>;
  or of one that ends with a tool message: the assistant turn stays open (no <|assistant_end|>), so the model
  continues right after <|output_end|>, exactly where the engine's forced calculator output would have left it.
- The exported Hugging Face tokenizer matches special-token text anywhere: its Jinja template escapes marker
  text inside content and its normalizer undoes that, so its ids are these (raychat.export.hf).

Truncation (`max_tokens`): exchanges (a user message and the assistant/tool messages after it) are dropped
oldest first until the rest fits; the system message is kept. Cuts fall only on message boundaries. If even
the most recent exchange does not fit, or no target survives, the sample is DROPPED (ids empty) and the
decision says why; callers count it and never train on it.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field

from raychat.tokenizer import BOS, Tokenizer

ROLES = ("system", "user", "assistant", "tool")
PART_TYPES = ("text", "python", "python_output")
SYSTEM_SEPARATOR = "\n\n"
PARTS_FORM = (
    '[{"type": "text"|"python"|"python_output", "text": STR}, ...]'  # an assistant content's, in errors
)

# role that may follow each role (None = start of conversation)
NEXT_ROLES: dict[str | None, tuple[str, ...]] = {
    None: ("system", "user"),
    "system": ("user",),
    "user": ("assistant",),
    "assistant": ("user", "tool"),
    "tool": ("assistant",),
}

# span kind -> supervised (1 = target when predicted)
SUPERVISION: dict[str, int] = {
    "bos": 0,
    "user_start": 0,
    "system": 0,
    "system_separator": 0,
    "user": 0,
    "user_end": 0,
    "assistant_start": 0,
    "text": 1,
    "python_start": 1,
    "python": 1,
    "python_end": 1,
    "output_start": 0,
    "output": 0,
    "output_end": 0,
    "assistant_end": 1,
}
MARKERS = {
    "bos": BOS,
    "user_start": "<|user_start|>",
    "user_end": "<|user_end|>",
    "assistant_start": "<|assistant_start|>",
    "assistant_end": "<|assistant_end|>",
    "python_start": "<|python_start|>",
    "python_end": "<|python_end|>",
    "output_start": "<|output_start|>",
    "output_end": "<|output_end|>",
}
TEMPLATE_SPEC = {
    "name": "raychat-chat",
    "revision": 1,
    "markers": MARKERS,
    "supervision": SUPERVISION,
    "next_roles": {str(k): list(v) for k, v in NEXT_ROLES.items()},
    "system": "prefix of the first user turn, then SYSTEM_SEPARATOR",
    "system_separator": SYSTEM_SEPARATOR,
    "truncation": "drop oldest exchanges; keep system; drop sample if the last exchange does not fit",
}
TEMPLATE_VERSION = hashlib.sha256(json.dumps(TEMPLATE_SPEC, sort_keys=True).encode()).hexdigest()[:16]


@dataclass(frozen=True)
class Span:
    """Tokens [start, end) of one template piece. role: bos|system|user|assistant|tool; message_index: the
    message it renders (-1 for BOS)."""

    start: int
    end: int
    kind: str
    role: str
    message_index: int
    supervised: int


@dataclass(frozen=True)
class TruncationDecision:
    """What truncation did to one conversation (stored in the replay record).

    kept_messages: indices of the messages rendered, in order. targets_*: supervised token counts.
    dropped: True when the sample yields no trainable tokens; reason says why ("" when kept).
    """

    tokens_before: int
    tokens_after: int
    targets_before: int
    targets_after: int
    dropped_exchanges: int
    kept_messages: tuple[int, ...]
    dropped: bool = False
    reason: str = ""

    @property
    def truncated(self) -> bool:
        return self.dropped_exchanges > 0

    def to_dict(self) -> dict:
        d = asdict(self)
        d["kept_messages"] = list(self.kept_messages)
        return d


@dataclass
class RenderedConversation:
    """ids: token ids (int); supervised: 0/1 per token; spans cover ids exactly, in order.

    roles/message_index give each token's role and source message (for inspection and replay).
    """

    ids: list[int]
    supervised: list[int]
    spans: list[Span]
    truncation: TruncationDecision
    template_version: str = TEMPLATE_VERSION
    roles: list[str] = field(default_factory=list)
    message_index: list[int] = field(default_factory=list)

    def __post_init__(self):
        if not self.roles:
            self.roles = [s.role for s in self.spans for _ in range(s.end - s.start)]
            self.message_index = [s.message_index for s in self.spans for _ in range(s.end - s.start)]

    @property
    def num_targets(self) -> int:
        return sum(self.supervised)

    @property
    def dropped(self) -> bool:
        return self.truncation.dropped

    def __len__(self) -> int:
        return len(self.ids)


# ---- validation -------------------------------------------------------------------------------------
def messages_of(conversation: Mapping | Sequence) -> list[dict]:
    """The message list of a conversation given as {"messages": [...]} or as the list itself."""
    if isinstance(conversation, Mapping):
        if "messages" not in conversation:
            raise ValueError(f"conversation needs a 'messages' field, got keys {sorted(conversation)}")
        conversation = conversation["messages"]
    if isinstance(conversation, str | bytes) or not isinstance(conversation, Sequence):
        raise ValueError(
            f"messages must be a list of {{'role', 'content'}} dicts, got {type(conversation).__name__}"
        )
    return list(conversation)


def _parts(message: Mapping, i: int) -> list[tuple[str, str]]:
    content = message.get("content")
    if isinstance(content, str):
        return [("text", content)]
    if message["role"] != "assistant" or not isinstance(content, Sequence):
        raise ValueError(
            f"message {i} ({message['role']}): content must be a string"
            + (f" or a list of parts {PARTS_FORM}" if message["role"] == "assistant" else "")
            + f", got {type(content).__name__}"
        )
    parts = []
    for j, part in enumerate(content):
        if not isinstance(part, Mapping) or part.get("type") not in PART_TYPES:
            got = part.get("type") if isinstance(part, Mapping) else type(part).__name__
            raise ValueError(f"message {i} part {j}: type must be one of {list(PART_TYPES)}, got {got!r}")
        if not isinstance(part.get("text"), str):
            raise ValueError(
                f"message {i} part {j}: 'text' must be a string, got {type(part.get('text')).__name__}"
            )
        if part["type"] == "text" and parts and parts[-1][0] == "text":
            # adjacent text parts are one text, encoded whole: as a one-string tokenizer (HF, vLLM) does
            parts[-1] = ("text", parts[-1][1] + part["text"])
        else:
            parts.append((part["type"], part["text"]))
    return parts


def validate_messages(messages: Sequence[Mapping], open_turn: bool = False) -> None:
    """Check roles, role order and content types; `open_turn` allows a conversation to end with a tool
    message (a prompt that continues the assistant turn).

    Raises:
        ValueError: naming the message index, its role and the roles allowed there.
    """
    prev: str | None = None
    prev_parts: list[tuple[str, str]] = []
    for i, m in enumerate(messages):
        if not isinstance(m, Mapping):
            raise ValueError(f"message {i}: must be a dict with 'role' and 'content', got {type(m).__name__}")
        role = m.get("role")
        if role not in ROLES:
            raise ValueError(f"message {i}: role must be one of {list(ROLES)}, got {role!r}")
        if role not in NEXT_ROLES[prev]:
            where = "at the start" if prev is None else f"after {prev!r}"
            raise ValueError(
                f"message {i}: role {role!r} not allowed {where}; allowed: {list(NEXT_ROLES[prev])}"
            )
        parts = _parts(m, i)
        if role == "tool" and (not prev_parts or prev_parts[-1][0] != "python"):
            raise ValueError(
                f"message {i}: a 'tool' message must follow an assistant message ending in a python call"
            )
        prev, prev_parts = role, parts
    if prev == "system" or (prev == "tool" and not open_turn):
        raise ValueError(f"message {len(messages) - 1}: a conversation cannot end with a {prev!r} message")


# ---- rendering --------------------------------------------------------------------------------------
class _Builder:
    def __init__(self, tokenizer: Tokenizer):
        self.tok = tokenizer
        self.ids: list[int] = []
        self.spans: list[Span] = []

    def marker(self, kind: str, role: str, mi: int) -> None:
        self._add([self.tok.special_id(MARKERS[kind])], kind, role, mi)

    def text(self, text: str, kind: str, role: str, mi: int) -> None:
        self._add(self.tok.encode(text), kind, role, mi)

    def _add(self, ids: list[int], kind: str, role: str, mi: int) -> None:
        start = len(self.ids)
        self.ids.extend(ids)
        self.spans.append(Span(start, len(self.ids), kind, role, mi, SUPERVISION[kind]))

    def __len__(self) -> int:
        return len(self.ids)


def _exchanges(messages: list[dict]) -> list[list[int]]:
    """Message indices grouped per exchange: a user message and the assistant/tool messages after it."""
    groups: list[list[int]] = []
    for i, m in enumerate(messages):
        if m["role"] == "user":
            groups.append([i])
        elif m["role"] != "system":
            groups[-1].append(i)
    return groups


def _render_exchange(
    b: _Builder, messages: list[dict], group: list[int], system: int | None, close: bool = True
) -> None:
    u = group[0]
    b.marker("user_start", "user", u)
    if system is not None:
        # one span, so a one-string tokenizer (HF, vLLM) that merges e.g. ".\n\n" agrees with us
        b.text(messages[system]["content"] + SYSTEM_SEPARATOR, "system", "system", system)
    b.text(messages[u]["content"], "user", "user", u)
    b.marker("user_end", "user", u)
    if len(group) == 1:
        return
    b.marker("assistant_start", "assistant", group[1])
    for i in group[1:]:
        if messages[i]["role"] == "tool":
            _render_output(b, messages[i]["content"], i)
            continue
        for kind, text in _parts(messages[i], i):
            if kind == "text":
                b.text(text, "text", "assistant", i)
            elif kind == "python":
                b.marker("python_start", "assistant", i)
                b.text(text, "python", "assistant", i)
                b.marker("python_end", "assistant", i)
            else:
                _render_output(b, text, i)
    if close:
        b.marker("assistant_end", "assistant", group[-1])


def _render_output(b: _Builder, text: str, i: int) -> None:
    b.marker("output_start", "tool", i)
    b.text(text, "output", "tool", i)
    b.marker("output_end", "tool", i)


def _build(
    tokenizer: Tokenizer,
    messages: list[dict],
    groups: list[list[int]],
    system: int | None,
    open_turn: bool = False,
) -> _Builder:
    b = _Builder(tokenizer)
    b.marker("bos", "bos", -1)
    for k, g in enumerate(groups):
        last = k == len(groups) - 1
        _render_exchange(b, messages, g, system if k == 0 else None, close=not (open_turn and last))
    return b


def render_conversation(
    tokenizer: Tokenizer, conversation: Mapping | Sequence, max_tokens: int | None = None
) -> RenderedConversation:
    """Render a conversation for training.

    Args:
        tokenizer: a raychat Tokenizer (its special tokens are the template markers).
        conversation: {"messages": [...]} or the message list; see the module docstring for the rules.
        max_tokens: if set, truncate as described in the module docstring (use the row length T+1).
    Returns:
        RenderedConversation; when `.dropped`, ids/supervised are empty and `.truncation.reason` says why.
    Raises:
        ValueError: invalid roles/order/content (naming the message index), no assistant message, or
            max_tokens < 1.
    """
    messages = messages_of(conversation)
    validate_messages(messages)
    if not any(m["role"] == "assistant" for m in messages):
        raise ValueError(
            "conversation has no assistant message: nothing to supervise (prompts: render_for_completion)"
        )
    if max_tokens is not None and max_tokens < 1:
        raise ValueError(f"max_tokens must be >= 1 or None, got {max_tokens}")
    system = 0 if messages and messages[0]["role"] == "system" else None
    groups = _exchanges(messages)
    full = _build(tokenizer, messages, groups, system)
    tokens_before, targets_before = len(full), sum(s.supervised * (s.end - s.start) for s in full.spans)

    b, first = full, 0
    if max_tokens is not None and len(full) > max_tokens:
        # lengths are additive: every span is encoded on its own, and the system block moves with the first turn
        sizes = [len(_build(tokenizer, messages, [g], None)) - 1 for g in groups]
        sys_len = len(_build(tokenizer, messages, groups[:1], system)) - 1 - sizes[0]
        total, first = 1 + sys_len, len(groups)
        while first > 0 and total + sizes[first - 1] <= max_tokens:
            total += sizes[first - 1]
            first -= 1
        b = _build(tokenizer, messages, groups[first:], system) if first < len(groups) else None

    targets_after = sum(s.supervised * (s.end - s.start) for s in b.spans) if b else 0
    kept = (
        tuple(([system] if system is not None else []) + [i for g in groups[first:] for i in g]) if b else ()
    )
    reason = ""
    if b is None:
        reason = f"the most recent exchange does not fit in max_tokens={max_tokens}"
    elif targets_after == 0:
        reason = "no supervised token survives truncation"
    decision = TruncationDecision(
        tokens_before=tokens_before,
        tokens_after=len(b) if b and not reason else 0,
        targets_before=targets_before,
        targets_after=targets_after if not reason else 0,
        dropped_exchanges=first,
        kept_messages=kept if not reason else (),
        dropped=bool(reason),
        reason=reason,
    )
    if reason:
        return RenderedConversation([], [], [], decision)
    rendered = RenderedConversation(
        b.ids, [s.supervised for s in b.spans for _ in range(s.end - s.start)], b.spans, decision
    )
    check_supervision(rendered.ids, rendered.supervised, rendered.roles)
    return rendered


def fewest_tokens(tokenizer: Tokenizer, conversation: Mapping | Sequence) -> int:
    """The smallest max_tokens (a row's T+1) at which render_conversation keeps `conversation`, not dropped: its
    most recent exchanges, as few as hold a supervised token, with BOS and the system message.

    Raises:
        ValueError: as render_conversation (an invalid conversation)."""
    messages = messages_of(conversation)
    validate_messages(messages)
    system = 0 if messages and messages[0]["role"] == "system" else None
    groups = _exchanges(messages)
    for first in range(len(groups) - 1, 0, -1):
        b = _build(tokenizer, messages, groups[first:], system)
        if any(s.supervised and s.end > s.start for s in b.spans):
            return len(b)
    return len(_build(tokenizer, messages, groups, system))


def check_supervision(ids: Sequence[int], supervised: Sequence[int], roles: Sequence[str]) -> None:
    """Guard: a sample holding assistant tokens must have at least one supervised token.

    Raises:
        ValueError: lengths differ, or an assistant turn is present and the supervision mask is all zero
            (the sample would silently train nothing).
    """
    if not (len(ids) == len(supervised) == len(roles)):
        raise ValueError(
            f"ids ({len(ids)}), supervised ({len(supervised)}) and roles ({len(roles)}) differ in length"
        )
    if "assistant" in roles and not any(supervised):
        raise ValueError(
            "supervision mask is all zero for a sample with an assistant turn: it would train nothing"
        )


def render_for_completion(tokenizer: Tokenizer, messages: Mapping | Sequence) -> list[int]:
    """Prompt ids for RL rollouts and serving: the conversation rendered, then <|assistant_start|>.

    `messages` must end with a user message (for a training conversation, pass messages[:-1]), or with a
    tool message: then the last assistant turn is left open (no <|assistant_end|>, no new
    <|assistant_start|>) and the prompt ends with that tool output's <|output_end|>.

    Raises:
        ValueError: invalid roles/order, or the last message is neither a user nor a tool message.
    """
    messages = messages_of(messages)
    validate_messages(messages, open_turn=True)
    last = messages[-1]["role"] if messages else None
    if last not in ("user", "tool"):
        raise ValueError(
            f"render_for_completion needs messages ending with a 'user' (or 'tool') message, got last role {last!r}"
        )
    system = 0 if messages[0]["role"] == "system" else None
    b = _build(tokenizer, messages, _exchanges(messages), system, open_turn=last == "tool")
    if last == "tool":
        return b.ids
    return [*b.ids, tokenizer.special_id(MARKERS["assistant_start"])]


def render_tool_output(tokenizer: Tokenizer, result: str) -> list[int]:
    """Ids the engine forces after the model emits <|python_end|>: <|output_start|> result <|output_end|>."""
    return [
        tokenizer.special_id(MARKERS["output_start"]),
        *tokenizer.encode(result),
        tokenizer.special_id(MARKERS["output_end"]),
    ]


def stop_ids(tokenizer: Tokenizer) -> tuple[int, ...]:
    """Ids that end an assistant turn during generation (<|assistant_end|>, and <|bos|> as a guard)."""
    return tokenizer.special_id(MARKERS["assistant_end"]), tokenizer.bos_id
