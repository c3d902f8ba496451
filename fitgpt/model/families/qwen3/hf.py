"""Qwen3's Hugging Face name map: Qwen3ForCausalLM stores what Llama's does (llama/hf.py), its
per-head q and k norms beside the attention, and its config.json has Qwen2's window keys
(qwen2/hf.py reads and writes them) and attention_bias."""

from __future__ import annotations

from typing import ClassVar

from fitgpt.model.config import ModelConfig
from fitgpt.model.families.qwen2.hf import Qwen2Mapping
from fitgpt.model.families.qwen3.family import Qwen3Family


class Qwen3Mapping(Qwen2Mapping):
    family: ClassVar[type[Qwen3Family]] = Qwen3Family
    hf_class: ClassVar[str] = "Qwen3ForCausalLM"

    def hf_extras(self, cfg: ModelConfig) -> dict:
        return {"attention_bias": False} | super().hf_extras(cfg)


MAPPING = Qwen3Mapping()
