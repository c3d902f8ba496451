"""Mixtral as model/family.py describes a family: Mistral's (a sliding window allowed, no q/k
norms) with a mixture of experts in every layer (../qwen3_moe/family.py MoeCounts: parameters
by the total, FLOPs by the active ones), the top-k weights always renormalised."""

from __future__ import annotations

from typing import TYPE_CHECKING

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
        topk = "Mixtral always renormalises its top-k routing weights (qwen3_moe may not)"
        self.check_every_layer_sparse(cfg, "Mixtral", topk)


FAMILY = MixtralFamily()
Mixtral.family = FAMILY
