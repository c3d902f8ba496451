"""Qwen3-MoE's named presets, 30B-A3B and 235B-A22B: their config.json's values (128 experts,
8 per token, every layer sparse), parameter counts equal to transformers' Qwen3MoeForCausalLM
built from the same values (tests/test_moe.py)."""

from __future__ import annotations

from fitgpt.model.config import ModelConfig
from fitgpt.model.families.llama.presets import hf_preset


def _qwen3_moe(n_layer: int, n_embd: int, n_head: int, ffn: int, expert_ffn: int) -> ModelConfig:
    return hf_preset("qwen3_moe", n_layer, n_embd, n_head, 4, ffn, 151936, 40960, head_size=128,
                     rope_theta=1e6, norm_eps=1e-6, qk_norm=True, num_experts=128,
                     experts_per_token=8, moe_ffn_hidden=expert_ffn, norm_topk_prob=True)  # fmt: skip


PRESETS: dict[str, ModelConfig] = {
    "qwen3-moe-30b-a3b": _qwen3_moe(48, 2048, 32, 6144, 768),
    "qwen3-moe-235b-a22b": _qwen3_moe(94, 4096, 64, 12288, 1536),
}
