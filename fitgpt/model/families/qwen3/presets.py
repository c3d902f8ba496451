"""Qwen3's named presets, 8 B and 32 B (their config.json's values)."""

from __future__ import annotations

from fitgpt.model.config import ModelConfig
from fitgpt.model.families.llama.presets import hf_preset


def _qwen3(n_layer: int, n_embd: int, n_head: int, ffn: int) -> ModelConfig:
    return hf_preset("qwen3", n_layer, n_embd, n_head, 8, ffn, 151936, 40960, head_size=128,
                     rope_theta=1e6, norm_eps=1e-6, qk_norm=True)  # fmt: skip


PRESETS: dict[str, ModelConfig] = {
    "qwen3-8b": _qwen3(36, 4096, 32, 12288),
    "qwen3-32b": _qwen3(64, 5120, 64, 25600),
}
