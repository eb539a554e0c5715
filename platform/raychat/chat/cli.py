"""`raychat chat`: interactive or one-shot (-p) chat against a checkpoint, streaming the reply.

Prompts are rendered with the ONE chat template (`raychat.chat_template.render_for_completion`); replies
stream through the engine's Scheduler (one row, driven inline). In interactive mode the conversation grows
turn by turn; /clear starts over, /quit or end of input leaves; Ctrl-C stops the current reply.
"""

from __future__ import annotations

import sys

import torch

from raychat.chat_template import render_for_completion
from raychat.checkpoint import load_model
from raychat.engine import ModelRunner, SamplingParams, Scheduler


def assistant_message(tokenizer, completion_tokens: list[int]) -> dict:
    """The assistant message (text / python / python_output parts) that a completion's tokens represent."""
    sid = tokenizer.special_id
    kinds = {sid("<|python_start|>"): "python", sid("<|output_start|>"): "python_output"}
    ends = {sid("<|python_end|>"), sid("<|output_end|>")}
    skip = {sid("<|assistant_end|>"), tokenizer.bos_id}
    parts, kind, buf = [], "text", []

    def flush():
        if buf:
            parts.append({"type": kind, "text": tokenizer.decode(buf)})
        buf.clear()

    for t in completion_tokens:
        if t in kinds:
            flush()
            kind = kinds[t]
        elif t in ends:
            flush()
            kind = "text"
        elif t not in skip:
            buf.append(t)
    flush()
    return {"role": "assistant", "content": parts or [{"type": "text", "text": ""}]}


def _reply(sched, tokenizer, messages, params, out) -> dict:
    stream = sched.submit(render_for_completion(tokenizer, messages), params)
    tokens = []
    try:
        for event in stream:
            out.write(event.text)
            out.flush()
            tokens += event.token_ids
    except KeyboardInterrupt:
        stream.cancel()
        for event in stream:
            tokens += event.token_ids
        out.write(" [stopped]")
    out.write("\n")
    out.flush()
    return assistant_message(tokenizer, tokens)


def run_chat(args, stdin=None, out=None) -> int:
    stdin, out = stdin or sys.stdin, out or sys.stdout
    try:
        if args.device.startswith("cuda") and not torch.cuda.is_available():
            raise ValueError(f"--device {args.device}: no CUDA device on this machine (use --device cpu)")
        model, tokenizer, _ = load_model(args.checkpoint, device=args.device)
        params = SamplingParams(
            max_tokens=args.max_tokens,
            temperature=args.temperature,
            top_k=args.top_k,
            top_p=args.top_p,
            seed=args.seed,
        )
    except (FileNotFoundError, ValueError) as e:
        print(f"raychat chat: {e}", file=sys.stderr)
        return 2
    sched = Scheduler(ModelRunner(model, tokenizer), max_slots=1)
    system = [{"role": "system", "content": args.system}] if args.system else []
    if args.prompt is not None:
        _reply(sched, tokenizer, [*system, {"role": "user", "content": args.prompt}], params, out)
        return 0
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
        messages.append({"role": "user", "content": text})
        out.write("raychat> ")
        messages.append(_reply(sched, tokenizer, messages, params, out))


def add_cli(subparsers) -> None:
    p = subparsers.add_parser("chat", help="chat with a checkpoint (interactive, or one-shot with -p)")
    p.add_argument("--checkpoint", required=True, help="checkpoint directory (model.safetensors, meta.json)")
    p.add_argument("-p", "--prompt", default=None, help="one-shot: answer this prompt and exit")
    p.add_argument("--system", default=None, help="system message placed before the first user turn")
    p.add_argument("--temperature", type=float, default=0.6, help="0 = greedy (default 0.6)")
    p.add_argument("--top-k", type=int, default=50, help="0 = off (default 50)")
    p.add_argument("--top-p", type=float, default=None, help="nucleus mass in (0, 1]; default off")
    p.add_argument("--max-tokens", type=int, default=256, help="completion tokens per reply (default 256)")
    p.add_argument("--seed", type=int, default=None, help="sampling seed (default random)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", help="torch device")
    p.set_defaults(func=run_chat)
