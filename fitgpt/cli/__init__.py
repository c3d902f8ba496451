"""The `fitgpt` command: a thin layer over the components' typed configs.

Each subcommand lives in its own module under fitgpt/cli/ and exposes `register(subparsers)`,
which adds its parser and sets `func(args) -> int | None`. The modules import their heavy
dependencies inside `func`, so `fitgpt --help` stays fast.

Every way a command can fail on the user's input ends here in one line on stderr, no traceback:
a bad flag (argparse, exit 2), a UserError (exit 2), an OSError about a path (permissions, a
missing folder, a full disk: exit 2), a dead rank (CollectiveError, exit 1), Ctrl-C (exit 130),
SIGTERM where a command takes it as Ctrl-C (fitgpt/procs.py stop_on_sigterm; exit 143).
A closed stdout (`fitgpt plan | head -3`) ends the command quietly. Anything else is a bug and
keeps its traceback.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys

from fitgpt.errors import UserError, print_line

# Modules under fitgpt.cli, one per subcommand. Order is the order of `fitgpt --help`.
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

# Attributes of a parsed command line that name an output, in the order they are named when an
# OSError carries no path of its own (a full disk during write()).
OUTPUT_ATTRS = ("out", "output", "output_prefix", "out_dir", "json")


class Parser(argparse.ArgumentParser):
    """argparse with two changes, inherited by every subcommand's parser:
    - no abbreviations: `matmul --device cpu` must not be taken as `--device-mem`;
    - a bad flag is one line on stderr (usage is one `--help` away), like every other error."""

    def __init__(self, *args, **kwargs) -> None:
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)
        self.set_defaults(_prog=self.prog)  # the deepest (sub)command parsed wins

    def error(self, message: str):  # type: ignore[override]
        self.exit(2, f"{self.prog}: error: {message} (see `{self.prog} --help`)\n")

    def parse_args(self, args=None, namespace=None):  # type: ignore[override]
        """As argparse's, but an unknown flag is blamed on the subcommand it was given to."""
        ns, extras = self.parse_known_args(args, namespace)
        if extras:
            prog = getattr(ns, "_prog", self.prog)
            self.exit(
                2,
                f"{prog}: error: unrecognized arguments: {' '.join(extras)} "
                f"(see `{prog} --help`)\n",
            )
        return ns


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(
        prog="fitgpt",
        description="Train the largest GPT model a machine can hold, fast.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in COMMANDS:
        importlib.import_module(f"fitgpt.cli.{name}").register(sub)
    return parser


def _outputs(args: argparse.Namespace) -> list[tuple[str, str]]:
    """The output flags the user gave, as (flag, value)."""
    out = []
    for a in OUTPUT_ATTRS:
        v = getattr(args, a, None)
        if isinstance(v, str) and v:
            out.append(("--" + a.replace("_", "-"), v))
    return out


def _drop_stdout() -> None:
    """Point stdout at devnull, as the Python docs advise for a closed pipe: what is still
    buffered is dropped, so the interpreter's last flush at exit raises (and prints) nothing."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError):  # stdout without a file descriptor (captured in tests)
        pass


def _quiet_broken_pipe() -> None:
    """The reader of stdout went away (`| head`): exit without a word."""
    _drop_stdout()
    sys.exit(1)


def _stdout_broken() -> bool:
    """Whether stdout itself fails to flush (a full disk behind `> file`)."""
    try:
        sys.stdout.flush()
    except OSError:
        return True
    return False


def main(argv: list[str] | None = None) -> None:
    from fitgpt.procs import stop_on_sigterm

    with stop_on_sigterm():  # importing every command's module takes 0.5 s: a stop, one line
        parser = build_parser()
        args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        sys.exit(2)
    name = f"fitgpt {args.command}"
    try:
        code = args.func(args)
        sys.stdout.flush()  # a closed pipe shows here, inside the handlers, not at exit
    except UserError as e:
        print_line(f"{name}: error: {e}")
        sys.exit(2)
    except BrokenPipeError:
        _quiet_broken_pipe()
    except OSError as e:
        # an error without a path of its own names the command's output, or stdout if none
        line = _os_error_line(e, _outputs(args) or [("stdout", "")])
        if line is None:
            raise
        if _stdout_broken():
            _drop_stdout()
        print_line(f"{name}: error: {line}")
        sys.exit(2)
    except RuntimeError as e:
        from fitgpt.engine.comm import CollectiveError

        if not isinstance(e, CollectiveError):
            raise
        print_line(f"{name}: {e}")
        sys.exit(1)
    except KeyboardInterrupt as e:  # train's Interrupted says what was saved and how to resume
        sys.exit(_stopped(name, e))
    sys.exit(code or 0)


def _stopped(name: str, e: KeyboardInterrupt) -> int:
    """One line for a stop; the exit code, 143 (128 + SIGTERM's 15) or 130 (SIGINT's 2).
    Ctrl-C's own KeyboardInterrupt carries no text (and, an exception object, is truthy even
    so): it printed `fitgpt data: ` with nothing after it."""
    from fitgpt.procs import Stopped, launcher_speaks

    if not launcher_speaks():  # a rank of a `--gpus` job in start-up: its launcher says it once
        print_line(f"{name}: {str(e) or 'stopped by SIGINT (Ctrl-C)'}")
    return 143 if isinstance(e, Stopped) else 130


def _os_error_line(e: OSError, outputs: list[tuple[str, str]]) -> str | None:
    from fitgpt.paths import describe_os_error

    return describe_os_error(e, outputs)


def entry() -> None:
    """The `fitgpt` command and `python -m fitgpt`: main(), then an exit that survives gloo's
    threads (fitgpt.dist.context.exit_process). In-process callers use main() and get its
    SystemExit as before."""
    from fitgpt.procs import stop_on_sigterm

    try:  # importing torch takes seconds: a Ctrl-C or SIGTERM then is a stop too, in one line
        with stop_on_sigterm():
            from fitgpt.dist.context import exit_process
    except KeyboardInterrupt as e:
        sys.exit(_stopped("fitgpt", e))
    try:
        main()
        code = 0
    except SystemExit as e:
        code = e.code
    except KeyboardInterrupt as e:  # before main's own handler: while the parser is built
        code = _stopped("fitgpt", e)
    exit_process(code)
