"""Mixtral's Hugging Face name map: MixtralForCausalLM stores what Mistral's does
(llama/hf.py), and each layer's mixture of experts as the router and one tensor per expert and
projection (../qwen3_moe/hf.py MoeMapping, which says how transformers 5 saves them):

| fitgpt (model.py)                  | HF                                             | layout        |
|------------------------------------|------------------------------------------------|---------------|
| blocks.i.mlp.router.weight [E, H]  | model.layers.i.block_sparse_moe.gate.weight    | same          |
| blocks.i.mlp.experts.fc [E·2F, H]  | ….block_sparse_moe.experts.e.w1.weight, w3     | rows 2e, 2e+1 |
| blocks.i.mlp.experts.proj [E·H, F] | ….block_sparse_moe.experts.e.w2.weight         | rows e of E   |

config.json: intermediate_size is one expert's width (moe_ffn_hidden; Mixtral has no dense
MLP), num_local_experts ⇄ num_experts, num_experts_per_tok ⇄ experts_per_token, sliding_window
as Mistral's. Refused on import: router_jitter_noise other than 0 (transformers multiplies the
router's input by uniform noise in training; fitgpt routes without it)."""

from __future__ import annotations

from typing import ClassVar

from fitgpt.errors import UserError
from fitgpt.model.config import ModelConfig
from fitgpt.model.families.mistral.hf import MistralMapping
from fitgpt.model.families.mixtral.family import MixtralFamily
from fitgpt.model.families.qwen3_moe.hf import MoeMapping
from fitgpt.model.hf_map import int_field


class MixtralMapping(MoeMapping, MistralMapping):
    family: ClassVar[type[MixtralFamily]] = MixtralFamily
    hf_class: ClassVar[str] = "MixtralForCausalLM"
    moe = "block_sparse_moe"
    projections = ("w1", "w3", "w2")
    experts_key = "num_local_experts"

    def moe_fields(self, hf: dict, source: str) -> dict:
        jitter = hf.get("router_jitter_noise", 0.0)
        if jitter not in (0, 0.0, None):
            raise UserError(
                f"{source}: router_jitter_noise={jitter!r}; fitgpt's router takes no noise: set "
                "it to 0"
            )
        return super().moe_fields(hf, source) | {
            "moe_ffn_hidden": int_field(hf, "intermediate_size", source),
            "norm_topk_prob": True,
        }

    def config_from_hf(self, hf: dict, source: str) -> ModelConfig:
        """intermediate_size is the experts' width, not a dense MLP's: ffn_hidden stays unset."""
        return super().config_from_hf(hf, source).replace(ffn_hidden=None)

    def hf_extras(self, cfg: ModelConfig) -> dict:
        return {
            "sliding_window": cfg.sliding_window,
            "intermediate_size": cfg.moe_ffn_hidden,
            "router_jitter_noise": 0.0,
        } | self.moe_extras(cfg)


MAPPING = MixtralMapping()
