"""gpt-oss's named presets, 20b and 120b: their config.json's values (24 and 36 layers of 32
and 128 experts, 4 per token, hidden 2880, 64 heads of 64 over 8 key/value heads, windows of
128 in the even layers, YaRN x32 over 4096 positions), parameter counts equal to transformers'
GptOssForCausalLM built from the same values (tests/test_gpt_oss.py): 20,914,757,184 and
116,829,156,672."""

from __future__ import annotations

from fitgpt.model.config import ModelConfig, RopeScaling
from fitgpt.model.families.llama.presets import hf_preset

# the published rope_scaling (beta_fast and beta_slow written out, truncate false)
YARN = RopeScaling(kind="yarn", factor=32.0, original_max_positions=4096, beta_fast=32.0,
                   beta_slow=1.0, truncate=False)  # fmt: skip


def _gpt_oss(n_layer: int, experts: int) -> ModelConfig:
    return hf_preset("gpt_oss", n_layer, 2880, 64, 8, None, 201088, 131072, head_size=64,
                     rope_theta=150000.0, rope_scaling=YARN, qkv_bias=True, sliding_window=128,
                     num_experts=experts, experts_per_token=4, moe_ffn_hidden=2880,
                     norm_topk_prob=True, swiglu_alpha=1.702, swiglu_limit=7.0)  # fmt: skip


PRESETS: dict[str, ModelConfig] = {
    "gpt-oss-20b": _gpt_oss(24, 32),
    "gpt-oss-120b": _gpt_oss(36, 128),
}
