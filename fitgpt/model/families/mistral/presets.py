"""Mistral's named preset, 7 B v0.3 (its config.json's values)."""

from __future__ import annotations

from fitgpt.model.config import ModelConfig
from fitgpt.model.families.llama.presets import hf_preset

PRESETS: dict[str, ModelConfig] = {
    "mistral-7b": hf_preset("mistral", 32, 4096, 32, 8, 14336, 32768, 32768, rope_theta=1e6),
}
