"""Mixtral as model/family.py describes a family: Mistral's (a sliding window allowed, no q/k
norms) with a mixture of experts in every layer (../qwen3_moe/family.py MoeCounts: parameters
by the total, FLOPs by the active ones), the top-k weights always renormalised."""

from __future__ import annotations

from typing import TYPE_CHECKING

from fitgpt.errors import UserError
from fitgpt.model.families.mistral.family import MistralFamily
from fitgpt.model.families.mixtral.model import Mixtral
from fitgpt.model.families.qwen3_moe.family import MoeCounts

if TYPE_CHECKING:
    from fitgpt.model.config import ModelConfig


class MixtralFamily(MoeCounts, MistralFamily):
    name = "mixtral"
    model = Mixtral

    def check(self, cfg: ModelConfig) -> None:
        super().check(cfg)
        if cfg.num_experts is None:
            return  # ModelConfig refuses that, naming the fields to set
        if not cfg.norm_topk_prob:
            raise UserError(
                "norm_topk_prob=False: Mixtral always renormalises its top-k routing weights; "
                "set it (qwen3_moe may leave them as they are)"
            )
        if cfg.mlp_only_layers or cfg.decoder_sparse_step != 1:
            raise UserError(
                f"mlp_only_layers={list(cfg.mlp_only_layers)}, decoder_sparse_step="
                f"{cfg.decoder_sparse_step}: every Mixtral layer is sparse (qwen3_moe has dense "
                "layers)"
            )


FAMILY = MixtralFamily()
Mixtral.family = FAMILY
