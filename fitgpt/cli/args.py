"""Typed config dataclasses as argparse flags.

Each field becomes `--field-name` (or `--<metadata flag>`), its `metadata["help"]` the help text,
its type and Literal choices checked by argparse. Flags default to None so the caller can tell
what the user set explicitly (explicit flags override a preset or the planner's choice).
"""

from __future__ import annotations

import argparse
import dataclasses
import typing
from typing import Any, Literal, TypeVar, get_args, get_origin

T = TypeVar("T")


def _flag(f: dataclasses.Field) -> str:
    return "--" + f.metadata.get("flag", f.name).replace("_", "-")


def _dest(f: dataclasses.Field, prefix: str) -> str:
    return prefix + f.name


def _shown(value: Any) -> str:
    """A default as help text: on/off for switches, "not set" for an empty string."""
    if isinstance(value, bool):
        return "on" if value else "off"
    if value == "" or value is None:
        return "not set"
    return str(value)


def add_config_args(
    parser: argparse.ArgumentParser | argparse._ArgumentGroup,
    cls: type,
    prefix: str = "",
    skip: tuple[str, ...] = (),
    defaults: Any = None,
    default_text: str = "{}",
    planned_text: str | None = None,
) -> None:
    """One flag per field of `cls`, its help ending in the default the command really uses.

    defaults: an instance of `cls` whose values are the command's defaults when they are not
    the dataclass's own (train's model flags come from the tiny preset, its data is stdlib).
    default_text: how the default reads, "{}" standing for the value: "from --preset; tiny: {}"
    gives "(default: from --preset; tiny: 4)"; without "{}" the text alone. A field's metadata
    "default_text" overrides it (train's --lr: worked out from the model).
    planned_text: the same for the fields the planner chooses (metadata "planned"), e.g.
    "the planner's choice; with --plan off: {}"."""
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        if f.name in skip or f.metadata.get("cli") is False:
            continue
        tp = hints[f.name]
        if get_origin(tp) is typing.Union or type(tp).__name__ == "UnionType":
            tp = next(a for a in get_args(tp) if a is not type(None))
        if defaults is not None:
            default = getattr(defaults, f.name)
        elif f.default is not dataclasses.MISSING:
            default = f.default
        else:
            default = f.default_factory()  # type: ignore[misc]
        text = planned_text if planned_text and f.metadata.get("planned") else default_text
        text = f.metadata.get("default_text", text)  # a default the command works out
        help_ = f"{f.metadata.get('help', '')} (default: {text.format(_shown(default))})"
        kw: dict[str, Any] = {"dest": _dest(f, prefix), "default": None, "help": help_}
        if tp is bool:
            parser.add_argument(_flag(f), action=argparse.BooleanOptionalAction, **kw)
        elif get_origin(tp) is Literal:
            choices = list(get_args(tp))
            parser.add_argument(_flag(f), choices=choices, type=type(choices[0]), **kw)
        else:
            metavar = _flag(f)[2:].upper().replace("-", "_")
            # metadata "parse": a field whose flag takes more than its type (e.g. "auto")
            parser.add_argument(_flag(f), type=f.metadata.get("parse", tp), metavar=metavar, **kw)


def explicit(args: argparse.Namespace, cls: type, prefix: str = "") -> dict[str, Any]:
    """The fields of `cls` the user set on the command line. A field without a flag (metadata
    "cli" False) is never one, even where a flag of its name means something else: train's
    --cpu-mem is a size as typed, EngineConfig.cpu_mem its bytes."""
    out = {}
    for f in dataclasses.fields(cls):
        if f.metadata.get("cli") is False:
            continue
        v = getattr(args, _dest(f, prefix), None)
        if v is not None:
            out[f.name] = v
    return out


def config_from_args(
    args: argparse.Namespace, cls: type[T], base: T | None = None, prefix: str = ""
) -> T:
    """`base` (or the defaults) with the explicitly set flags applied; __post_init__ validates."""
    changes = explicit(args, cls, prefix)
    return dataclasses.replace(base, **changes) if base is not None else cls(**changes)


# ---- removed flags: one line that says so, not "unrecognized arguments" ---------------------
# flag -> why it is gone and what to do, in a few words (train's and plan's engine flags)
_DELAY_GONE = "the one-step-delayed update was removed (docs/offload.md says why); drop the flag"
REMOVED_FLAGS = {
    f: _DELAY_GONE for f in ("--delayed-update", "--no-delayed-update", "--delayed-update-after")
}


class _Removed(argparse.Action):
    """A flag fitgpt no longer has: given, the command stops in one line saying why."""

    def __init__(self, option_strings: list[str], dest: str, why: str, **kwargs) -> None:
        super().__init__(option_strings, dest, **kwargs)
        self.why = why

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        raise argparse.ArgumentError(None, f"{option_string}: {self.why}")


def add_removed_flags(parser: argparse.ArgumentParser) -> None:
    """REMOVED_FLAGS, hidden from --help; each takes an optional value (so `--flag 40` is
    blamed on the flag, not on the 40)."""
    for flag, why in REMOVED_FLAGS.items():
        parser.add_argument(
            flag,
            action=_Removed,
            why=why,
            nargs="?",
            dest=argparse.SUPPRESS,
            default=argparse.SUPPRESS,
            help=argparse.SUPPRESS,
        )


# ---- offload shares: the command line's only fractions -------------------------------------
def add_fraction_flags(p) -> None:
    """--offload-fraction / --nvme-fraction: a share of the blocks, turned into the engine's
    integer --offload-blocks / --nvme-blocks once the model's layer count is known."""
    p.add_argument(
        "--offload-fraction",
        type=float,
        default=None,
        metavar="F",
        help="--offload-blocks as a share of the transformer blocks (rounded to whole blocks)",
    )
    p.add_argument(
        "--nvme-fraction",
        type=float,
        default=None,
        metavar="F",
        help="--nvme-blocks as a share of the offloaded blocks (rounded to whole blocks)",
    )


def typed_flags(args: argparse.Namespace) -> dict[str, Any]:
    """The engine and precision flags typed on a command line, and the block shares
    --offload-fraction / --nvme-fraction as typed (the counts they become are not typed): what
    plan/validate.py no_effect judges."""
    from fitgpt.engine.config import EngineConfig, PrecisionConfig

    names = [f.name for f in dataclasses.fields(EngineConfig)]
    names += [*PrecisionConfig.__dataclass_fields__, "offload_fraction", "nvme_fraction"]
    return {n: getattr(args, n) for n in names if getattr(args, n, None) is not None}


# the flags the --gpus launcher turns into torchrun's (dist/nodes.py), not handed to its ranks
LAUNCH_FLAGS = ("--gpus", "--nnodes", "--node-rank", "--master-addr", "--master-port")


def add_node_args(p: argparse.ArgumentParser, what: str) -> None:
    """The several-machines flags of `train` and `probe` (dist/nodes.py judges them), and the
    link between the machines (plan/links.py)."""
    nodes = p.add_argument_group(
        f"several machines (with --gpus; {what} the same command on each, docs/training.md)"
    )
    nodes.add_argument(
        "--nnodes",
        type=int,
        default=None,
        help="machines in the job, each running --gpus processes (default: 1)",
    )
    nodes.add_argument(
        "--node-rank",
        type=int,
        default=None,
        help="this machine's index, 0..nnodes-1; node 0 hosts the rendezvous (default: 0)",
    )
    nodes.add_argument(
        "--master-addr",
        default=None,
        help="node 0's host name or IP address, the same on "
        "every node (default: 127.0.0.1, for nodes on one machine)",
    )
    nodes.add_argument(
        "--master-port",
        type=int,
        default=None,
        help="a free TCP port of node 0, the same on "
        "every node (required with --nnodes > 1; one node picks its own)",
    )
    if what == "run":  # the probe measures it
        nodes.add_argument(
            "--inter-node-gbps",
            type=float,
            default=None,
            help="the link between machines, Gb/s per GPU (bits, as NICs are sold), which the "
            "planner prices collectives that leave a machine at (default: what `fitgpt probe` "
            "measured across these machines, else 400: docs/planner.md)",
        )
