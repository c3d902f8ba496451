"""Mistral: the Llama family with a sliding window (applied only to sequences longer than it)."""

from __future__ import annotations

from fitgpt.model.families.llama.family import LlamaFamily


class MistralFamily(LlamaFamily):
    name = "mistral"
    has_window = True


FAMILY = MistralFamily()
