"""The `raychat` console command. Each subcommand lives beside the code it runs.

A command module exposes `add_cli(subparsers)`, which adds its subcommand(s) and sets `func` (a callable
taking the parsed args and returning an exit code or None).
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys

from raychat.ops.job_python import missing_dependency_message

COMMAND_MODULES = [
    "raychat.speedrun",
    "raychat.data.prepare",
    "raychat.tokenizer_cli",
    "raychat.train.pretrain",
    "raychat.train.sft",
    "raychat.rl.cli",
    "raychat.eval.cli",
    "raychat.chat.cli",
    "raychat.serve.cli",
    "raychat.export.hf",
    "raychat.data.inspect_batch",
    "raychat.ops.submit",
    "raychat.ops.k8s_cli",
    "raychat.ops.grafana",
]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="raychat",
        description="raychat: text -> tokens -> rows -> model -> checkpoint -> engine -> endpoint, on Ray.",
        epilog="Run `raychat <command> --help` for the flags of one command.",
    )
    sub = parser.add_subparsers(dest="command", metavar="<command>")
    for name in COMMAND_MODULES:
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError as e:
            if e.name == name:  # not built yet
                continue
            raise
        module.add_cli(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    try:
        parser = build_parser()
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
