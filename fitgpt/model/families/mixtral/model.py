"""Mixtral's network: the mixture-of-experts Llama (../qwen3_moe/model.py) whose router keeps
the top-k weights in fp32 (transformers' MixtralTopKRouter does not cast them back to the
logits' dtype, Qwen3-MoE's does; the experts' outputs are multiplied by them in fp32 and cast
to the stream's dtype after). Its attention slides a window where the config sets one (the
Llama network's, as Mistral's)."""

from __future__ import annotations

from typing import ClassVar

from fitgpt.model.families.qwen3_moe.model import MoeLlama


class Mixtral(MoeLlama):
    fp32_scores: ClassVar[bool] = True
