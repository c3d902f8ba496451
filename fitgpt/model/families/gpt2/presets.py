"""GPT-2's named presets: `tiny`, the CPU demo (byte vocabulary set by the data at train time),
GPT-2's four sizes, and wider GPT-2-shaped models up to 40 B."""

from __future__ import annotations

from fitgpt.model.config import ModelConfig


def _p(n_layer: int, n_embd: int, n_head: int, seq_len: int = 1024, **kw) -> ModelConfig:
    return ModelConfig(n_layer=n_layer, n_embd=n_embd, n_head=n_head, seq_len=seq_len, **kw)


PRESETS: dict[str, ModelConfig] = {
    "tiny": _p(4, 128, 4, seq_len=128, vocab_size=256),
    "gpt2-125m": _p(12, 768, 12),
    "gpt2-350m": _p(24, 1024, 16),
    "gpt2-760m": _p(36, 1280, 20),
    "gpt2-1.5b": _p(48, 1600, 25),
    "2.7b": _p(32, 2560, 32),
    "6.7b": _p(32, 4096, 32),
    "13b": _p(40, 5120, 40),
    "20b": _p(44, 6144, 48),
    "40b": _p(48, 8192, 64),
}
