"""The `raychat` console command. Each subcommand lives beside the code it runs.

A command module exposes `add_cli(subparsers)`, which adds its subcommand(s) and sets `func` (a callable
taking the parsed args and returning an exit code or None). Only the module of the command being run is
imported: `raychat --help` imports neither torch nor Ray.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys

from raychat.ops.job_python import missing_dependency_message

# command -> (the module whose add_cli builds its parser, its line in `raychat --help`). `raychat --help` reads only
# this table; `raychat <command> ...` imports that one module (tests/test_cli.py keeps the lines equal to the
# modules' own help).
COMMANDS = {
    "speedrun": (
        "raychat.speedrun",
        "the main job: data -> tokenizer -> pretrain -> eval -> SFT -> RL -> report",
    ),
    "data": ("raychat.data.prepare", "prepare pretraining text shards"),
    "tokenizer": ("raychat.tokenizer_cli", "train the BPE tokenizer"),
    "pretrain": ("raychat.train.pretrain", "pretrain the base model on Ray Train (DDP)"),
    "sft": ("raychat.train.sft", "supervised fine-tuning of a pretrained checkpoint into a chat model"),
    "rl": (
        "raychat.rl.cli",
        "reinforcement learning of a chat checkpoint on a task (rollout actors + learner on Ray)",
    ),
    "eval": ("raychat.eval.cli", "validation BPB + held-out task accuracy of a checkpoint (JSON)"),
    "chat": ("raychat.chat.cli", "chat with a checkpoint (interactive, or one-shot with -p)"),
    "serve": ("raychat.serve.cli", "serve a checkpoint: streaming chat page + OpenAI-compatible API"),
    "export": ("raychat.export.hf", "export a checkpoint to the Hugging Face layout (Qwen3)"),
    "inspect-batch": (
        "raychat.data.inspect_batch",
        "rebuild a training step's batch from its replay record (--run, --step), or print canary SFT samples "
        "per token",
    ),
    "submit": ("raychat.ops.submit", "submit a stage as a Ray job and follow its logs"),
    "jobs": ("raychat.ops.submit", "list, stop or show the logs of Ray jobs"),
    "k8s": ("raychat.ops.k8s_cli", "KubeRay: generate k8s/base, submit a stage as a RayJob"),
    "grafana": ("raychat.ops.grafana", "Grafana: write raychat's dashboard, provision a Grafana"),
}


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The `raychat` parser: with a known `command`, that command's full parser (its module imported); else one
    line per command, importing nothing."""
    parser = argparse.ArgumentParser(
        prog="raychat",
        description="raychat: text -> tokens -> rows -> model -> checkpoint -> engine -> endpoint, on Ray.",
        epilog="Run `raychat <command> --help` for the flags of one command.",
    )
    sub = parser.add_subparsers(dest="command", metavar="<command>")
    if command in COMMANDS:
        importlib.import_module(COMMANDS[command][0]).add_cli(sub)
    else:
        for name, (_, help_) in COMMANDS.items():
            sub.add_parser(name, help=help_)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    command = next((a for a in argv if not a.startswith("-")), None)
    try:
        parser = build_parser(command)
    except ModuleNotFoundError as e:  # a third-party dependency is missing from this Python
        if not e.name or e.name.split(".")[0] == "raychat" or os.environ.get("RAYCHAT_DEBUG"):
            raise
        print(f"raychat: error: {missing_dependency_message(e.name)}", file=sys.stderr)
        return 2
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    try:
        rc = args.func(args)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except (ValueError, OSError) as e:  # bad input (or a file in the way): a clear message, no traceback
        if os.environ.get("RAYCHAT_DEBUG"):
            raise
        print(f"raychat {args.command}: error: {e}  (RAYCHAT_DEBUG=1 shows the traceback)", file=sys.stderr)
        return 2
    return int(rc or 0)


if __name__ == "__main__":
    sys.exit(main())
