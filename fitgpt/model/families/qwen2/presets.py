"""Qwen2.5's named presets, 0.5 B to 72 B (their config.json's values)."""

from __future__ import annotations

from fitgpt.model.config import ModelConfig
from fitgpt.model.families.llama.presets import hf_preset


def _qwen2(n_layer: int, n_embd: int, n_head: int, kv: int, ffn: int, eps: float, **kw):
    vocab = 151936 if kw.get("tied") else 152064
    return hf_preset("qwen2", n_layer, n_embd, n_head, kv, ffn, vocab, 32768, rope_theta=1e6,
                     norm_eps=eps, qkv_bias=True, **kw)  # fmt: skip


PRESETS: dict[str, ModelConfig] = {
    "qwen2.5-0.5b": _qwen2(24, 896, 14, 2, 4864, 1e-6, tied=True),
    "qwen2.5-1.5b": _qwen2(28, 1536, 12, 2, 8960, 1e-6, tied=True),
    "qwen2.5-3b": _qwen2(36, 2048, 16, 2, 11008, 1e-6, tied=True),
    "qwen2.5-7b": _qwen2(28, 3584, 28, 4, 18944, 1e-6),
    "qwen2.5-14b": _qwen2(48, 5120, 40, 8, 13824, 1e-5),
    "qwen2.5-32b": _qwen2(64, 5120, 40, 8, 27648, 1e-5),
    "qwen2.5-72b": _qwen2(80, 8192, 64, 8, 29568, 1e-5),
}
