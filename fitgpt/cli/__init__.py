"""The `fitgpt` command: a thin layer over the components' typed configs.

Each subcommand lives in its own module under fitgpt/cli/ and exposes `register(subparsers)`,
which adds its parser and sets `func(args) -> int | None`. The modules import their heavy
dependencies inside `func`, so `fitgpt --help` stays fast.
"""

from __future__ import annotations

import argparse
import importlib
import sys

from fitgpt.errors import UserError

# (module under fitgpt.cli, its subcommands). Order is the order of `fitgpt --help`.
COMMANDS: list[str] = [
    "train",
    "generate",
    "presets",
    "data",
    "tokenizer",
    "export",
    "import_hf",
    "matmul",
    "plan",
    "probe",
    "capacity",
    "bench",
    "report",
]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="fitgpt",
        description="Train the largest GPT model a machine can hold, fast.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in COMMANDS:
        importlib.import_module(f"fitgpt.cli.{name}").register(sub)
    return parser


def main(argv: list[str] | None = None) -> None:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        sys.exit(2)
    try:
        code = args.func(args)
    except UserError as e:
        print(f"fitgpt {args.command}: error: {e}", file=sys.stderr)
        sys.exit(2)
    except RuntimeError as e:
        from fitgpt.engine.comm import CollectiveError

        if not isinstance(e, CollectiveError):
            raise
        print(f"fitgpt {args.command}: {e}", file=sys.stderr)
        sys.exit(1)
    except KeyboardInterrupt as e:  # train's Interrupted says what was saved and how to resume
        print(f"fitgpt {args.command}: {e or 'interrupted'}", file=sys.stderr)
        sys.exit(130)
    sys.exit(code or 0)
