"""Which Hugging Face name map reads or writes a checkpoint: looked up in the family registry's
table (model/families/__init__.py: HF `model_type` → family for import, the family itself for
export) and loaded from that family's folder (its hf.py's MAPPING: model/hf_map.py says what a
map holds). The reader (hf_read.py: `fitgpt import hf` and `--init-from`) and the export
(hf_export.py) read and write tensors through the map alone, so they name no family; no module
outside model/families/ does either.
"""

from __future__ import annotations

import importlib

from fitgpt.errors import UserError
from fitgpt.model import ModelConfig
from fitgpt.model.families import HF_FAMILY, hf_mapping, module
from fitgpt.model.hf_map import HFMapping


def _mapping(family: str) -> HFMapping:
    return importlib.import_module(module(family, "hf")).MAPPING


def _known_types() -> str:
    return ", ".join(HF_FAMILY)


def mapping_for_hf(hf: dict, source: str) -> HFMapping:
    """The mapping of config.json `hf` by its model_type. A config without one is GPT-2's when
    it has GPT-2's own key names (old GPT-2 files lack model_type), else refused."""
    mt = hf.get("model_type")
    if mt is None and "n_embd" in hf:
        mt = "gpt2"
    if mt is None:
        raise UserError(
            f"{source} has no model_type; fitgpt reads model_type {_known_types()}: add the "
            "key, or pass the checkpoint's own config.json"
        )
    if mt in HF_FAMILY:
        return _mapping(HF_FAMILY[mt])
    raise UserError(
        f"{source}: model_type={mt!r}; fitgpt imports only GPT-2, Llama, Qwen2, Qwen3, "
        f"Mistral, Qwen3-MoE, Mixtral and gpt-oss checkpoints (model_type {_known_types()})"
    )


def mapping_for_model(cfg: ModelConfig) -> HFMapping:
    """The mapping that exports `cfg`'s family, or one line saying there is none (the
    registry's lookup, model/families hf_mapping)."""
    return hf_mapping(cfg)


# ---- one call per question, whatever the family ---------------------------------------------
def model_config_from_hf(hf: dict, source: str) -> ModelConfig:
    return mapping_for_hf(hf, source).config_from_hf(hf, source)


def check_exportable(cfg: ModelConfig) -> None:
    mapping_for_model(cfg).check_exportable(cfg)
