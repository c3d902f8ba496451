"""The gated family as fitgpt.model.family describes one, registered by name on import."""

from __future__ import annotations

from typing import ClassVar

from families.gated.model import GatedLM
from fitgpt.model import Family, Split, register_family


class GatedFamily(Family):
    name = "gated-test"
    model = GatedLM
    splits: ClassVar[dict[str, Split]] = {
        "attn.qkv.weight": Split(0, 3),
        "attn.proj.weight": Split(1),
        "mlp.gate.weight": Split(0),
        "mlp.up.weight": Split(0),
        "mlp.down.weight": Split(1),
        "wte.weight": Split(0),
        "lm_head.weight": Split(0),
    }

    def tp_sizes(self, cfg):
        return [(cfg.n_head, "the heads"), (3 * cfg.n_embd, "the gated MLP's 3·hidden"),
                (cfg.padded_vocab_size, "the padded vocabulary")]  # fmt: skip

    def num_params(self, cfg):
        h, V = cfg.n_embd, cfg.padded_vocab_size
        return cfg.n_layer * (4 * h * h + 9 * h * h + 2 * h) + 2 * V * h + h

    def block_activations(self, cfg):
        return 4 * cfg.n_embd, 14 * cfg.n_embd


FAMILY = register_family(GatedFamily())
GatedLM.family = FAMILY
