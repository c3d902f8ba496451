"""The model families fitgpt ships, as data: each is a folder beside this file
(`<name>/`: its network, its Family, its presets, its Hugging Face name map), and TABLE below
says which folders there are and which Hugging Face `model_type` each reads. Nothing here
imports a family: `family_of` loads a folder's family.py by name the first time a config of it
is made, model/presets.py its presets.py and interop/hf.py its hf.py, and no family imports
this module back, so the registry and its members make no circle. Adding a family is a folder
and one line of TABLE. A family defined outside the package (a plugin, a test) registers its
Family with `register_family` instead, and has no presets or name map of fitgpt's.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from fitgpt.errors import UserError
from fitgpt.model.config import ModelConfig, use_registry

if TYPE_CHECKING:
    from fitgpt.model.decoder import DecoderLM
    from fitgpt.model.family import Family
    from fitgpt.model.hf_map import HFMapping

# family name (ModelConfig.family, and its folder's name) -> the config.json model_type values
# its hf.py reads. The order is `fitgpt presets`'.
TABLE: dict[str, tuple[str, ...]] = {
    "gpt2": ("gpt2",),
    "llama": ("llama",),
    "qwen2": ("qwen2",),
    "qwen3": ("qwen3",),
    "mistral": ("mistral",),
    "qwen3_moe": ("qwen3_moe",),
    "mixtral": ("mixtral",),
    "gpt_oss": ("gpt_oss",),
}
# HF model_type -> family name: TABLE read the other way
HF_FAMILY: dict[str, str] = {t: name for name, types in TABLE.items() for t in types}

# every Family made so far: TABLE's as they load, and those register_family added
_LOADED: dict[str, Family] = {}


def module(name: str, part: str) -> str:
    """The dotted name of `part` ("family", "presets", "hf") of TABLE's family `name`."""
    return f"{__name__}.{name}.{part}"


def register_family(family: Family) -> Family:
    """Make `family`, defined outside this package, buildable by name (ModelConfig.family);
    returns it."""
    _LOADED[family.name] = family
    return family


def family_of(cfg: ModelConfig) -> Family:
    """The family of the model `cfg` describes (a one-line refusal for an unknown one)."""
    name = cfg.family
    if name not in _LOADED and name in TABLE:
        _LOADED[name] = importlib.import_module(module(name, "family")).FAMILY
    try:
        return _LOADED[name]
    except KeyError:
        known = ", ".join(sorted({*TABLE, *_LOADED}))
        raise UserError(f"model family {name!r} is unknown: use one of {known}") from None


def build_model(cfg: ModelConfig) -> DecoderLM:
    """The family's network for `cfg` (on the current default device: the engines build it on
    the meta device and place every parameter themselves), its Family on it as `family` (one
    network may serve several families: Llama's serves four)."""
    family = family_of(cfg)
    net = family.model(cfg)
    net.family = family
    return net


def hf_mapping(cfg: ModelConfig) -> HFMapping:
    """The Hugging Face name map of `cfg`'s family (its folder's hf.py MAPPING), or one line
    saying there is none (a family registered from outside the package): what interop/ reads
    and writes checkpoints through, and fitgpt/adapters names LoRA's targets by."""
    if TABLE.get(cfg.family):
        return importlib.import_module(module(cfg.family, "hf")).MAPPING
    fams = ", ".join(f for f, types in TABLE.items() if types)
    raise UserError(
        f"model family {cfg.family!r} has no Hugging Face mapping: fitgpt reads and writes HF "
        f"checkpoints of the families {fams}"
    )


# every ModelConfig finds its family here (model/config.py: the registry sits above it)
use_registry(family_of)
