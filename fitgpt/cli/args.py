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


def add_config_args(
    parser: argparse.ArgumentParser | argparse._ArgumentGroup,
    cls: type,
    prefix: str = "",
    skip: tuple[str, ...] = (),
) -> None:
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        if f.name in skip or f.metadata.get("cli") is False:
            continue
        tp = hints[f.name]
        if get_origin(tp) is typing.Union or type(tp).__name__ == "UnionType":
            tp = next(a for a in get_args(tp) if a is not type(None))
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()  # type: ignore[misc]
        help_ = f"{f.metadata.get('help', '')} (default: {default})"
        kw: dict[str, Any] = {"dest": _dest(f, prefix), "default": None, "help": help_}
        if tp is bool:
            parser.add_argument(_flag(f), action=argparse.BooleanOptionalAction, **kw)
        elif get_origin(tp) is Literal:
            choices = list(get_args(tp))
            parser.add_argument(_flag(f), choices=choices, type=type(choices[0]), **kw)
        else:
            parser.add_argument(_flag(f), type=tp, metavar=f.name.upper(), **kw)


def explicit(args: argparse.Namespace, cls: type, prefix: str = "") -> dict[str, Any]:
    """The fields of `cls` the user set on the command line."""
    out = {}
    for f in dataclasses.fields(cls):
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
