"""Qwen2 and Qwen2.5: the Llama family with biases on q, k and v."""

from __future__ import annotations

from fitgpt.model.families.llama.family import LlamaFamily


class Qwen2Family(LlamaFamily):
    name = "qwen2"
    has_qkv_bias = True


FAMILY = Qwen2Family()
