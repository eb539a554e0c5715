"""The `raychat` console command.

`raychat --help` reads one table (COMMANDS). `raychat <command> ...` builds that command's parser with
raychat.commands (config and argparse only: `raychat <command> --help` imports neither torch nor Ray); the
parser's `func` names the function that runs the command, "module:function", imported only when it runs.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import os
import signal
import sys

from raychat.cli_parser import OneLineParser
from raychat.log import RunGaveUp
from raychat.ops.job_python import missing_dependency_message
from raychat.sigterm import Terminated, terminating

# command -> its line in `raychat --help` (tests/unit/test_cli.py keeps each equal to its parser's own help)
COMMANDS = {
    "speedrun": "the main job: data -> tokenizer -> pretrain -> eval -> SFT -> RL -> report",
    "data": "prepare pretraining text shards",
    "tokenizer": "train the BPE tokenizer",
    "pretrain": "pretrain the base model on Ray Train (DDP)",
    "sft": "supervised fine-tuning of a pretrained checkpoint into a chat model",
    "rl": "reinforcement learning of a chat checkpoint on a task (rollout actors + learner on Ray)",
    "eval": "a checkpoint's BPB, task accuracy and report card (chat evals, ChatCORE, CORE with --core-bundle)",
    "report": "draw the loss and validation curves of run directories from their metrics.jsonl",
    "chat": "chat with a checkpoint (interactive, or one-shot with -p)",
    "serve": "serve a checkpoint: streaming chat page + OpenAI-compatible API",
    "export": "export a checkpoint to the Hugging Face layout (Qwen3)",
    "inspect-batch": (
        "rebuild a training step's batch from its replay record (--run, --step), or print canary SFT samples "
        "per token"
    ),
    "submit": "submit a stage as a Ray job and follow its logs",
    "jobs": "list, stop or show the logs of Ray jobs",
    "k8s": "KubeRay: generate k8s/base, submit a stage as a RayJob",
    "grafana": "Grafana: write raychat's dashboard, provision a Grafana",
}

# the commands whose SIGTERM ends them in their line from their first moment on (main): the training runs
TERMINATING = ("speedrun", "pretrain", "sft", "rl")


def load(target: str):
    """The object `target` names ("module:name"), its module imported now: the package's one import by name
    (tests/unit/test_architecture.py allows it here only), so that a command's parser and the code that runs it are
    imported when the command is dispatched, never for `raychat --help`."""
    module, _, name = target.partition(":")
    return getattr(importlib.import_module(module), name)


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The `raychat` parser: with a known `command`, that command's full parser (raychat.commands); else one
    line per command, importing nothing."""
    parser = OneLineParser(
        prog="raychat",
        description="raychat: text -> tokens -> rows -> model -> checkpoint -> engine -> endpoint, on Ray.",
        epilog="Run `raychat <command> --help` for the flags of one command.",
    )
    sub = parser.add_subparsers(dest="command", metavar="<command>")
    if command in COMMANDS:
        load("raychat.commands:PARSERS")[command](sub)
    else:
        for name, help_ in COMMANDS.items():
            sub.add_parser(name, help=help_)
    return parser


def main(argv: list[str] | None = None) -> int:
    """`raychat ARGV`; returns the exit status. A TERMINATING command's SIGTERM raises Terminated from the start
    (raychat.sigterm.terminating: its imports, its checks, its Ray's start, its run, its way out): the command
    ends with its line (a training run's says where the same command resumes) and exit status 143."""
    argv = sys.argv[1:] if argv is None else list(argv)
    command = next((a for a in argv if not a.startswith("-")), None)
    try:
        with terminating() if command in TERMINATING else contextlib.nullcontext():
            return _main(argv, command)
    except Terminated as e:  # SIGTERM (`ray job stop`, kill, docker stop, Kubernetes)
        print(f"raychat {command}: terminated (SIGTERM): {e}".removesuffix(": "), file=sys.stderr)
        return 128 + signal.SIGTERM


def _main(argv: list[str], command: str | None) -> int:
    try:
        parser = build_parser(command)
        args = parser.parse_args(argv)
        func = getattr(args, "func", None)
        func = load(func) if isinstance(func, str) else func  # the command's code, imported now
    except ModuleNotFoundError as e:  # a third-party dependency is missing from this Python
        if not e.name or e.name.split(".")[0] == "raychat" or os.environ.get("RAYCHAT_DEBUG"):
            raise
        print(f"raychat: error: {missing_dependency_message(e.name)}", file=sys.stderr)
        return 2
    if not func:
        parser.print_help()
        return 2
    name = command_name(args)
    try:
        rc = func(args)
    except KeyboardInterrupt as e:  # a stage's own line (a training run's: where it resumes) when it has one
        print(f"{name}: interrupted: {e}" if str(e) else f"{name}: interrupted", file=sys.stderr)
        return 130
    except (
        RunGaveUp
    ) as e:  # the run ended on a failure it does not retry: its line (a Ray error logged above)
        if os.environ.get("RAYCHAT_DEBUG"):
            raise
        print(f"{name}: error: {e}", file=sys.stderr)
        return 1
    except (ValueError, OSError) as e:  # bad input (or a file in the way): a clear message, no traceback
        if os.environ.get("RAYCHAT_DEBUG"):
            raise
        print(f"{name}: error: {e}  (RAYCHAT_DEBUG=1 shows the traceback)", file=sys.stderr)
        return 2
    return int(rc or 0)


def command_name(args: argparse.Namespace) -> str:
    """The command as its parser's errors name it (its prog): "raychat rl", "raychat data prepare" (a
    command's subcommand is its `<command>_command` argument: raychat.commands), the prefix of the lines the
    command ends with ("raychat data prepare: interrupted: ...", "raychat tokenizer train: error: ...")."""
    sub = getattr(args, f"{args.command}_command", None)
    return f"raychat {args.command} {sub}" if sub else f"raychat {args.command}"


if __name__ == "__main__":
    sys.exit(main())
