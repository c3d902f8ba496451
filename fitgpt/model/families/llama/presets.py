"""Llama's named presets: `tiny-llama`, the CPU demo in the Llama family, and Llama 3.1/3.2's
shapes. The presets of Hugging Face models (here and in the qwen2, qwen3 and mistral folders,
made by hf_preset) are their config.json's values, parameter counts equal to theirs
(tests/test_llama.py builds each in transformers on the meta device); they train at 4096 tokens,
max_positions keeps the model's own context for export."""

from __future__ import annotations

from fitgpt.model.config import ModelConfig, RopeScaling

LLAMA3_ROPE = 500000.0  # Llama 3's rope_theta; Qwen2.5, Qwen3 and Mistral v0.3 use 1e6


def hf_preset(family: str, n_layer: int, n_embd: int, n_head: int, kv: int, ffn: int,
              vocab: int, max_positions: int, tied: bool = False, **kw) -> ModelConfig:  # fmt: skip
    """A Hugging Face model's shape (its config.json's values), trained at 4096 tokens: rotary
    positions, RMSNorm, no biases but those `kw` gives the family."""
    return ModelConfig(
        family=family, n_layer=n_layer, n_embd=n_embd, n_head=n_head, n_kv_head=kv,
        ffn_hidden=ffn, vocab_size=vocab, max_positions=max_positions, tie_embeddings=tied,
        seq_len=4096, position="rope", bias=False, **kw,
    )  # fmt: skip


def _llama3(n_layer: int, n_embd: int, n_head: int, ffn: int, factor: float, **kw):
    scaling = RopeScaling(factor=factor)
    return hf_preset("llama", n_layer, n_embd, n_head, 8, ffn, 128256, 131072,
                     rope_theta=LLAMA3_ROPE, rope_scaling=scaling, **kw)  # fmt: skip


PRESETS: dict[str, ModelConfig] = {
    "tiny-llama": ModelConfig(
        n_layer=4,
        n_embd=128,
        n_head=4,
        seq_len=128,
        vocab_size=256,
        n_kv_head=2,
        family="llama",
        position="rope",
        bias=False,
        tie_embeddings=False,
    ),
    "llama3.2-1b": _llama3(16, 2048, 32, 8192, 32.0, tied=True),
    "llama3.2-3b": _llama3(28, 3072, 24, 8192, 32.0, tied=True),
    "llama3.1-8b": _llama3(32, 4096, 32, 14336, 8.0),
    "llama3.1-70b": _llama3(80, 8192, 64, 28672, 8.0),
    "llama3.1-405b": _llama3(126, 16384, 128, 53248, 8.0),
}
