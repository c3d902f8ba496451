"""The named presets of every family (`--preset`, `fitgpt presets`): each family's folder says
its own in presets.py, and PRESETS gathers them in the registry's order (model/families)."""

from __future__ import annotations

import importlib

from fitgpt.errors import UserError
from fitgpt.model.config import ModelConfig
from fitgpt.model.families import TABLE, module


def _gather() -> dict[str, ModelConfig]:
    out: dict[str, ModelConfig] = {}
    for family in TABLE:
        for name, cfg in importlib.import_module(module(family, "presets")).PRESETS.items():
            if name in out:  # a name must say one model: two folders may not both use it
                raise ValueError(f"preset {name!r} of {family} is {out[name].family}'s too")
            out[name] = cfg
    return out


PRESETS: dict[str, ModelConfig] = _gather()


def get_preset(name: str) -> ModelConfig:
    if name not in PRESETS:
        raise UserError(f"preset {name!r} does not exist; choose one of {', '.join(PRESETS)}")
    return PRESETS[name]
