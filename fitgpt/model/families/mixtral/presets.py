"""Mixtral's named presets, 8x7B and 8x22B (v0.1): their config.json's values (8 experts, 2
per token, no sliding window), parameter counts equal to transformers' MixtralForCausalLM built
from the same values (tests/test_moe.py)."""

from __future__ import annotations

from fitgpt.model.config import ModelConfig
from fitgpt.model.families.llama.presets import hf_preset


def _mixtral(n_layer: int, n_embd: int, n_head: int, expert_ffn: int, max_pos: int) -> ModelConfig:
    return hf_preset("mixtral", n_layer, n_embd, n_head, 8, None, 32000, max_pos, rope_theta=1e6,
                     num_experts=8, experts_per_token=2, moe_ffn_hidden=expert_ffn,
                     norm_topk_prob=True)  # fmt: skip


PRESETS: dict[str, ModelConfig] = {
    "mixtral-8x7b": _mixtral(32, 4096, 32, 14336, 32768),
    "mixtral-8x22b": _mixtral(56, 6144, 48, 16384, 65536),
}
