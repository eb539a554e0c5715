"""`raychat chat`: interactive or one-shot (-p) chat against a checkpoint, streaming the reply.

Prompts are rendered with the ONE chat template (`raychat.chat_template.render_for_completion`); replies
stream through the engine's Scheduler (one row, driven inline) and are shown part by part
(raychat.chat.turn): text as it comes, a calculator call with its result as "[calculator] 12 * 34 = 408" on
its own line; control tokens never appear. In interactive mode the conversation grows
turn by turn, its oldest exchanges dropped (and said so) when it outgrows the model's context (with
--max-tokens N: when it leaves less than N tokens for the reply); a message too long on its own is not sent
and the session goes on; a -p prompt the context cannot hold, or a --max-tokens that even the shortest prompt
leaves no room for (the -p prompt, or an empty message), is an error naming the flag at start (exit 2), in
the words of the server's 400 (context length, prompt tokens, what fits); /clear starts over, /quit or
end of input leaves; Ctrl-C stops the current reply (with -p it then exits 130, as Ctrl-C at the prompt
does). The checkpoint chat resolved to is named first, on stderr. A reply that fills the model's context ends
with "[cut: ...]"; one the engine fails on (non-finite logits) is an error on stderr, is left out of the
conversation, and makes -p exit 1.
"""

from __future__ import annotations

import sys

import torch

from raychat.chat.turn import TurnParser, turn_parts
from raychat.chat_template import render_for_completion
from raychat.checkpoint import load_model
from raychat.checkpoint_manager import described, find_checkpoint, resolve_checkpoint
from raychat.config import ChatConfig, from_args
from raychat.engine import ModelRunner, SamplingParams, Scheduler
from raychat.engine.scheduler import completion_overflow, prompt_overflow
from raychat.gc_heap import freeze_gc_heap

PART_TYPES = {"text": "text", "tool_call": "python", "tool_result": "python_output"}
DEFAULT_REPLY_TOKENS = 256  # a reply's limit without --max-tokens (the context's end may come first)


def assistant_message(tokenizer, completion_tokens: list[int]) -> dict:
    """The assistant message (text / python / python_output parts) that a completion's tokens represent."""
    parts = [
        {"type": PART_TYPES[kind], "text": text} for kind, text in turn_parts(tokenizer, completion_tokens)
    ]
    return {"role": "assistant", "content": parts or [{"type": "text", "text": ""}]}


class PartPrinter:
    """Writes a reply's parts as they stream: text as it is; a calculator call and its result as a block of
    their own, "[calculator] 12 * 34 = 408", on a line of its own (never the control tokens)."""

    def __init__(self, out):
        self.out, self.after_block, self.at_line_start = out, False, True

    def write(self, kind: str, text: str) -> None:
        if kind == "text":
            if self.after_block and text:
                self.out.write("\n")
                self.after_block = False
            chunk = text
        elif kind == "tool_call":
            chunk = ("" if self.at_line_start else "\n") + f"[calculator] {text}"
            self.after_block = True
        else:
            chunk = f" = {text}"
        if chunk:
            self.out.write(chunk)
            self.at_line_start = chunk.endswith("\n")
        self.out.flush()


def _reply(sched, tokenizer, messages, params, out, one_shot: bool = False) -> dict | None:
    """Stream the reply to `messages` into `out`: its assistant message, or None when the engine failed on
    it (non-finite logits, a failed forward: the error goes to stderr; the reply is not part of the
    conversation). A reply that fills the model's context is marked so (it did not end on its own); one
    stopped by Ctrl-C ends with " [stopped]", and then, one_shot, raises KeyboardInterrupt (raychat exits 130)
    once what came is printed."""
    prompt = render_for_completion(tokenizer, messages)
    stream = sched.submit(prompt, params)
    parser, printer, tokens, event, stopped = TurnParser(tokenizer), PartPrinter(out), [], None, False
    try:
        for event in stream:
            parts, _ = parser.push(event.token_ids, event.text)
            for kind, text in parts + (parser.finish() if event.finished else []):
                printer.write(kind, text)
            tokens += event.token_ids
    except KeyboardInterrupt:
        stream.cancel()
        for event in stream:
            tokens += event.token_ids
        out.write(" [stopped]")
        stopped = True
    if event is not None and event.finish_reason == "length" and len(prompt) + len(tokens) >= sched.max_len:
        out.write(f" [cut: the conversation filled the model's {sched.max_len} tokens]")
    out.write("\n")
    out.flush()
    if stopped and one_shot:
        raise KeyboardInterrupt
    if event is not None and event.finish_reason == "error":
        print(f"raychat chat: error: the reply failed: {event.error}", file=sys.stderr)
        return None
    return assistant_message(tokenizer, tokens)


def checkpoint_line(checkpoint: str, stage: str) -> str:
    """ "checkpoint: <checkpoint> (<stage> checkpoint, step <step>)", what chat prints first (on stderr); that
    of a pretraining checkpoint (`stage`, from its meta.json) adds that the model is not fine-tuned for chat."""
    line = f"checkpoint: {described(checkpoint)}"
    if stage == "pretrain":
        line += ": a base model, not fine-tuned for chat (it continues text; raychat sft, then rl, make a chat model)"
    return line


def fit_history(
    tokenizer, messages: list[dict], keep: int, max_len: int, reply_tokens: int = 1
) -> tuple[list[dict], int] | None:
    """The conversation `messages` (its first `keep` messages the system prompt, its last the new user message)
    with its oldest exchanges dropped, a user message and the replies after it at a time, until the prompt
    leaves room for `reply_tokens` completion tokens in a row of `max_len` tokens: (messages, how many were
    dropped); None when the system prompt and the new message alone leave no such room."""
    dropped = 0
    while len(render_for_completion(tokenizer, messages)) + reply_tokens > max_len:
        if len(messages) <= keep + 1:
            return None
        end = keep + 1
        while end < len(messages) - 1 and messages[end]["role"] != "user":
            end += 1
        dropped += end - keep
        messages = messages[:keep] + messages[end:]
    return messages, dropped


def check_fits(
    tokenizer, max_tokens: int | None, max_len: int, system: list[dict], prompt: str | None
) -> None:
    """Refuse, before the first reply, what the shortest prompt the session sends leaves no room for in a row
    of max_len tokens: that prompt (the -p prompt, or interactively an empty message, each with the system
    message, if any) with not even one completion token after it, or a --max-tokens (None: not given).

    Raises:
        ValueError: "--prompt: the prompt has N tokens, but ..." (--system when an empty message with the
            system message is too long), else "--max-tokens: N completion tokens requested, but ..."
            (context length, prompt tokens, what fits).
    """
    shortest = [*system, {"role": "user", "content": prompt or ""}]
    what = "the prompt" if prompt is not None else "an empty message"
    what += " with the system message" if system else ""
    n = len(render_for_completion(tokenizer, shortest))
    too_long = prompt_overflow(n, max_len, what)
    if too_long:
        raise ValueError(f"{'--prompt' if prompt is not None else '--system'}: {too_long}")
    why = None if max_tokens is None else completion_overflow(n, max_tokens, max_len, what)
    if why:
        raise ValueError(f"--max-tokens: {why}")


def run_chat(args, stdin=None, out=None) -> int:
    stdin, out = stdin or sys.stdin, out or sys.stdout
    try:
        cfg = from_args(args, ChatConfig, "chat")
        if not cfg.checkpoint:
            raise ValueError("--checkpoint: required: a checkpoint dir, a run dir or <run dir>/latest")
        device = ("cuda" if torch.cuda.is_available() else "cpu") if cfg.device == "auto" else cfg.device
        if device == "cuda" and not torch.cuda.is_available():
            raise ValueError("--device cuda: no CUDA device on this machine (use --device cpu)")
        source = find_checkpoint(
            cfg.checkpoint, None, "--checkpoint"
        )  # named on stderr: the URI, not the cache
        model, tokenizer, meta = load_model(resolve_checkpoint(source), device=device)
        system = [{"role": "system", "content": cfg.system}] if cfg.system else []
        check_fits(tokenizer, cfg.max_tokens, model.config.max_seq_len, system, cfg.prompt)
        params = SamplingParams(
            max_tokens=cfg.max_tokens or DEFAULT_REPLY_TOKENS,
            temperature=cfg.temperature,
            top_k=cfg.top_k,
            top_p=cfg.top_p,
            seed=cfg.seed,
        )
    except (FileNotFoundError, ValueError) as e:
        print(f"raychat chat: error: {e}", file=sys.stderr)
        return 2
    print(checkpoint_line(source, meta.get("stage", "")), file=sys.stderr)
    sched = Scheduler(ModelRunner(model, tokenizer, dtype="auto", kv_dtype=cfg.kv_dtype), max_slots=1)
    freeze_gc_heap()
    if cfg.prompt is not None:
        messages = [*system, {"role": "user", "content": cfg.prompt}]
        reply = _reply(sched, tokenizer, messages, params, out, one_shot=True)
        return 0 if reply else 1
    messages = list(system)
    while True:
        out.write("you> ")
        out.flush()
        line = stdin.readline()
        if not line or line.strip() == "/quit":
            return 0
        text = line.rstrip("\n")
        if text.strip() == "/clear":
            messages = list(system)
            continue
        if not text.strip():
            continue
        reserve = cfg.max_tokens or 1
        fitted = fit_history(
            tokenizer, [*messages, {"role": "user", "content": text}], len(system), sched.max_len, reserve
        )
        if fitted is None:
            n = len(render_for_completion(tokenizer, [*system, {"role": "user", "content": text}]))
            what = "this message" + (" with the system message" if system else "")
            out.write(f"(not sent: {prompt_overflow(n, sched.max_len, what, reserve)}; shorten it)\n")
            continue
        messages, dropped = fitted
        if dropped:
            out.write(f"(dropped the {dropped} oldest messages: the conversation outgrew the model's "
                      f"{sched.max_len} tokens)\n")  # fmt: skip
        out.write("raychat> ")
        reply = _reply(sched, tokenizer, messages, params, out)
        messages = [*messages, reply] if reply else messages[:-1]
