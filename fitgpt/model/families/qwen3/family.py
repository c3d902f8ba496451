"""Qwen3: the Llama family with an RMSNorm over each head of q and k before the rotation."""

from __future__ import annotations

from fitgpt.model.families.llama.family import LlamaFamily


class Qwen3Family(LlamaFamily):
    name = "qwen3"
    has_qk_norm = True


FAMILY = Qwen3Family()
