"""Qwen3-MoE's Hugging Face name map: Qwen3MoeForCausalLM stores what Qwen3's does (llama/hf.py:
attention, q/k norms, norms, embedding and head), a dense layer's MLP as Llama's, and a sparse
layer's as a router and one tensor per expert and projection. MoeMapping holds what any
mixture-of-experts Llama maps (the mixtral folder subclasses it); Qwen3MoeMapping its names.

transformers 5 computes with the experts fused into 3-D tensors (experts.gate_up_proj
[E, 2F, H], experts.down_proj [E, H, F]) but save_pretrained writes them back one tensor per
expert (its conversion_mapping reversed), as the published folders hold them:

| fitgpt (model.py)                    | HF (Qwen3-MoE; Mixtral: ../mixtral/hf.py)        | layout          |
|--------------------------------------|--------------------------------------------------|-----------------|
| blocks.i.mlp.router.weight [E, H]    | model.layers.i.mlp.gate.weight                   | same            |
| blocks.i.mlp.experts.fc [E·2F, H]    | ….mlp.experts.e.gate_proj.weight, up_proj.weight | rows 2e, 2e+1   |
|                                      |                                                  | of 2E blocks    |
| blocks.i.mlp.experts.proj [E·H, F]   | ….mlp.experts.e.down_proj.weight                 | rows e of E     |

A folder holding the fused 3-D tensors themselves is refused on import (check_tensors names
the first): transformers writes none.

config.json ⇄ ModelConfig, besides Llama's: num_experts (transformers 5 writes it as
num_local_experts, its attribute_map) ⇄ num_experts, num_experts_per_tok ⇄ experts_per_token,
moe_intermediate_size ⇄ moe_ffn_hidden, norm_topk_prob, mlp_only_layers (numbers that are no
layer dropped: transformers ignores them), decoder_sparse_step;
router_aux_loss_coef ⇄ router_aux_loss_coef where output_router_logits is true (0 otherwise:
transformers adds no aux loss then; the file's coefficient is kept in hf_router_aux_loss_coef
and written back), written back with output_router_logits = coef > 0;
use_sliding_window with sliding_window ⇄ sliding_window (every layer, as Qwen3MoeModel).
"""

from __future__ import annotations

from typing import ClassVar

from fitgpt.errors import UserError
from fitgpt.model.config import ModelConfig
from fitgpt.model.families.llama.hf import LlamaMapping
from fitgpt.model.families.qwen3_moe.family import Qwen3MoeFamily
from fitgpt.model.hf_map import TensorMap, int_field

DEFAULT_AUX_COEF = 0.001  # transformers' router_aux_loss_coef default, written when fitgpt's is 0


def aux_coef(hf: dict, source: str) -> tuple[float, float | None]:
    """(the load-balancing weight transformers trains with: router_aux_loss_coef where
    output_router_logits is true, else none (0); the file's coefficient where it is off,
    kept for export (ModelConfig.hf_router_aux_loss_coef) unless it is the default, else None)."""
    on = hf.get("output_router_logits", False)
    if not isinstance(on, bool):
        raise UserError(f"{source}: output_router_logits={on!r} must be true or false; fix it")
    coef = hf.get("router_aux_loss_coef", DEFAULT_AUX_COEF)
    if not isinstance(coef, int | float) or isinstance(coef, bool) or coef < 0:
        raise UserError(f"{source}: router_aux_loss_coef={coef!r} must be a number >= 0")
    if on:
        return float(coef), None
    # None where it is transformers' default, so an import equals the preset of its shape
    return 0.0, (None if coef == DEFAULT_AUX_COEF else float(coef))


class MoeMapping(LlamaMapping):
    """A Llama mapping whose sparse layers' MLP is `moe` (router `gate`, experts' projections
    named by `projections`: gate, up, down)."""

    moe: ClassVar[str] = "mlp"
    projections: ClassVar[tuple[str, str, str]] = ("gate_proj", "up_proj", "down_proj")
    experts_key: ClassVar[str] = "num_experts"

    def moe_fields(self, hf: dict, source: str) -> dict:
        """The ModelConfig fields of the mixture, from config.json (each family's keys)."""
        key = self.experts_key if self.experts_key in hf else "num_local_experts"
        coef, kept = aux_coef(hf, source)
        return {
            "num_experts": int_field(hf, key, source),
            "experts_per_token": int_field(hf, "num_experts_per_tok", source),
            "router_aux_loss_coef": coef,
            "hf_router_aux_loss_coef": kept,
        }

    def extra_fields(self, hf: dict, source: str) -> dict:
        fields = self.moe_fields(hf, source)
        if fields["experts_per_token"] > fields["num_experts"]:
            raise UserError(
                f"{source}: num_experts_per_tok={fields['experts_per_token']} exceeds the "
                f"{fields['num_experts']} experts (torch.topk refuses it too); fix the file"
            )
        return fields

    def moe_extras(self, cfg: ModelConfig) -> dict:
        off = cfg.hf_router_aux_loss_coef  # the source's, where the aux loss is off
        off = DEFAULT_AUX_COEF if off is None else off
        return {
            self.experts_key: cfg.num_experts,
            "num_experts_per_tok": cfg.experts_per_token,
            "output_router_logits": cfg.router_aux_loss_coef > 0,
            "router_aux_loss_coef": cfg.router_aux_loss_coef or off,
        }

    def tensor_maps(self, cfg: ModelConfig) -> list[TensorMap]:
        """Llama's, each sparse layer's three MLP tensors replaced by its router and experts."""
        sparse = set(cfg.moe_layers)
        maps = []
        for m in super().tensor_maps(cfg):
            i = self.layer_of(m.hf)
            if i not in sparse or ".mlp." not in m.hf:
                maps.append(m)
            elif m.hf.endswith("mlp.gate_proj.weight"):  # where the layer's MLP begins
                maps += self.expert_maps(cfg, i)
        return maps

    def expert_maps(self, cfg: ModelConfig, i: int) -> list[TensorMap]:
        hf, fit, E = f"model.layers.{i}.{self.moe}.", f"blocks.{i}.mlp.", cfg.num_experts
        gate, up, down = self.projections
        maps = [TensorMap(hf + "gate.weight", fit + "router.weight")]
        for e in range(E):
            ex = f"{hf}experts.{e}."
            maps.append(TensorMap(f"{ex}{gate}.weight", fit + "experts.fc", part=(2 * e, 2 * E)))
            maps.append(TensorMap(f"{ex}{up}.weight", fit + "experts.fc", part=(2 * e + 1, 2 * E)))
            maps.append(TensorMap(f"{ex}{down}.weight", fit + "experts.proj", part=(e, E)))
        return maps


class Qwen3MoeMapping(MoeMapping):
    family: ClassVar[type[Qwen3MoeFamily]] = Qwen3MoeFamily
    hf_class: ClassVar[str] = "Qwen3MoeForCausalLM"

    def moe_fields(self, hf: dict, source: str) -> dict:
        only = hf.get("mlp_only_layers") or []
        if not isinstance(only, list) or not all(
            isinstance(i, int) and not isinstance(i, bool) for i in only
        ):
            raise UserError(f"{source}: mlp_only_layers={only!r} must be a list of layer numbers")
        # transformers makes layer i dense where i is in the list, so a number that is no layer
        # (a model cut to fewer layers keeps its list) changes nothing: dropped, as it has no
        # effect there (export writes the layers that are dense)
        n_layer = int_field(hf, "num_hidden_layers", source)
        only = [i for i in only if 0 <= i < n_layer]
        norm = hf.get("norm_topk_prob", False)
        if not isinstance(norm, bool):
            raise UserError(f"{source}: norm_topk_prob={norm!r} must be true or false; fix it")
        return super().moe_fields(hf, source) | {
            "moe_ffn_hidden": int_field(hf, "moe_intermediate_size", source),
            "norm_topk_prob": norm,
            "mlp_only_layers": tuple(only),
            "decoder_sparse_step": int_field(hf, "decoder_sparse_step", source, 1),
        }

    def sliding_window(self, hf: dict, n_layer: int, source: str) -> int | None:
        """Qwen3MoeConfig keeps sliding_window only with use_sliding_window, and the model then
        slides it in every layer."""
        if not hf.get("use_sliding_window", False) or hf.get("sliding_window") is None:
            return None
        return int_field(hf, "sliding_window", source)

    def hf_extras(self, cfg: ModelConfig) -> dict:
        return {
            "attention_bias": False,
            "use_sliding_window": cfg.sliding_window is not None,
            "sliding_window": cfg.sliding_window,
            "moe_intermediate_size": cfg.moe_ffn_hidden,
            "norm_topk_prob": cfg.norm_topk_prob,
            "mlp_only_layers": list(cfg.mlp_only_layers),
            "decoder_sparse_step": cfg.decoder_sparse_step,
        } | self.moe_extras(cfg)


MAPPING = Qwen3MoeMapping()
