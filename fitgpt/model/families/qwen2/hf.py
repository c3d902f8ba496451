"""Qwen2's Hugging Face name map: Qwen2ForCausalLM stores what Llama's does (llama/hf.py), its q,
k and v biases beside their weights. Its config.json may slide a window in some layers
(use_sliding_window); fitgpt's qwen2 attends fully in every layer, so such a window is refused
on import and export writes full attention everywhere."""

from __future__ import annotations

from typing import ClassVar

from fitgpt.errors import UserError
from fitgpt.model.config import ModelConfig
from fitgpt.model.families.llama.hf import LlamaMapping
from fitgpt.model.families.qwen2.family import Qwen2Family
from fitgpt.model.hf_map import int_field


class Qwen2Mapping(LlamaMapping):
    family: ClassVar[type[Qwen2Family]] = Qwen2Family
    hf_class: ClassVar[str] = "Qwen2ForCausalLM"

    def sliding_window(self, hf: dict, n_layer: int, source: str) -> int | None:
        """None, or a refusal: Qwen2/3 slide a window only with use_sliding_window, in the
        layers layer_types marks (derived, when absent, as transformers does: those from
        max_window_layers on); fitgpt's qwen families have none, so a window in any layer is
        refused (released Qwen2.5/Qwen3 checkpoints set use_sliding_window false)."""
        if not hf.get("use_sliding_window", False) or hf.get("sliding_window") is None:
            return None
        window = int_field(hf, "sliding_window", source)
        types = hf.get("layer_types")
        if types is None:
            first = hf.get("max_window_layers", 28)
            types = [
                "sliding_attention" if i >= first else "full_attention" for i in range(n_layer)
            ]
        sliding = sum(t == "sliding_attention" for t in types) if isinstance(types, list) else -1
        if sliding == 0:
            return None
        raise UserError(
            f"{source}: use_sliding_window=true slides a window of {window} in {sliding} of "
            f"{n_layer} layers (max_window_layers={hf.get('max_window_layers')!r}); fitgpt's "
            f"{self.family.name} has full attention in every layer (its mistral family slides "
            "one window in all)"
        )

    def hf_extras(self, cfg: ModelConfig) -> dict:
        """Full attention everywhere (fitgpt's qwen families slide no window)."""
        return {
            "use_sliding_window": False,
            "sliding_window": None,
            "max_window_layers": cfg.n_layer,
            "layer_types": ["full_attention"] * cfg.n_layer,
        }


MAPPING = Qwen2Mapping()
