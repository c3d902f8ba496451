"""Mistral's Hugging Face name map: MistralForCausalLM stores what Llama's does (llama/hf.py);
its config.json's sliding_window, when set, slides in every layer, as fitgpt's mistral does."""

from __future__ import annotations

from typing import ClassVar

from fitgpt.model.config import ModelConfig
from fitgpt.model.families.llama.hf import LlamaMapping
from fitgpt.model.families.mistral.family import MistralFamily
from fitgpt.model.hf_map import int_field


class MistralMapping(LlamaMapping):
    family: ClassVar[type[MistralFamily]] = MistralFamily
    hf_class: ClassVar[str] = "MistralForCausalLM"

    def sliding_window(self, hf: dict, n_layer: int, source: str) -> int | None:
        if hf.get("sliding_window") is None:
            return None
        return int_field(hf, "sliding_window", source)

    def hf_extras(self, cfg: ModelConfig) -> dict:
        return {"sliding_window": cfg.sliding_window}


MAPPING = MistralMapping()
