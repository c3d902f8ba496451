"""gpt-oss's Hugging Face name map: GptOssForCausalLM stores the Llama layout (llama/hf.py:
embedding, norms, q/k/v/o, head) with biases on the four attention projections, a sink per
head, and each layer's router and experts as transformers computes with them (no per-expert
tensors: the fused 3-D ones, in fitgpt as they are):

| fitgpt (model.py)                          | HF                                              | layout |
|--------------------------------------------|-------------------------------------------------|--------|
| blocks.i.attn.q/kv.{weight,bias}           | ….self_attn.q_proj, k_proj then v_proj          | Llama's |
| blocks.i.attn.proj.{weight,bias}           | ….self_attn.o_proj.{weight,bias}                | same   |
| blocks.i.attn.sinks [N]                    | ….self_attn.sinks                               | same   |
| blocks.i.mlp.router.{weight,bias} [E, H]   | ….mlp.router.{weight,bias}                      | same   |
| blocks.i.mlp.experts.gate_up [E, H, 2F]    | ….mlp.experts.gate_up_proj                      | same (gate, up interleaved) |
| blocks.i.mlp.experts.gate_up_bias [E, 2F]  | ….mlp.experts.gate_up_proj_bias                 | same   |
| blocks.i.mlp.experts.down [E, F, H]        | ….mlp.experts.down_proj                         | same   |
| blocks.i.mlp.experts.down_bias [E, H]      | ….mlp.experts.down_proj_bias                    | same   |

The published folders (openai/gpt-oss-20b, -120b) store gate_up_proj and down_proj as MXFP4
(quantization_config {"quant_method": "mxfp4"}: `*_blocks` and `*_scales`, uint8); import and
`--init-from` read them dequantized as transformers dequantizes them (interop/mxfp4.py), an
expert at a time. Export writes every tensor unquantized (`--dtype`, bf16 for the published
models' precision) and no quantization_config.

config.json ⇄ ModelConfig, besides Llama's: attention_bias (true; false is refused) ⇄ qkv_bias;
num_local_experts ⇄ num_experts, num_experts_per_tok ⇄ experts_per_token, intermediate_size ⇄
moe_ffn_hidden (the experts' width: there is no dense MLP), router_aux_loss_coef where
output_router_logits ⇄ router_aux_loss_coef (qwen3_moe/hf.py aux_coef), sliding_window ⇄
sliding_window, layer_types ⇄ layer_types (() where it is GptOssConfig's default pattern, so an
import equals the preset of its shape; export writes it out), swiglu_alpha and swiglu_limit
(1.702 and 7.0 where absent, transformers' defaults) ⇄ the same. norm_topk_prob is always true
(the softmax over the top k sums to 1).
"""

from __future__ import annotations

from typing import ClassVar

from fitgpt.errors import UserError
from fitgpt.model.config import ModelConfig, layer_types_problem
from fitgpt.model.families.gpt_oss.family import GptOssFamily
from fitgpt.model.families.gpt_oss.model import default_layer_types, layer_kinds
from fitgpt.model.families.qwen3_moe.hf import MoeMapping
from fitgpt.model.hf_map import TensorMap, float_field, int_field

# transformers' GptOssConfig defaults, for a config.json that leaves them out
SWIGLU_DEFAULTS = {"swiglu_alpha": 1.702, "swiglu_limit": 7.0}
QUANT_METHODS = ("mxfp4",)  # quantization_config.quant_method values fitgpt reads


class GptOssMapping(MoeMapping):
    family: ClassVar[type[GptOssFamily]] = GptOssFamily
    hf_class: ClassVar[str] = "GptOssForCausalLM"
    experts_key = "num_local_experts"
    import_format = "hf-gpt-oss"

    def sliding_window(self, hf: dict, n_layer: int, source: str) -> int | None:
        if hf.get("sliding_window") is None:
            return None
        return int_field(hf, "sliding_window", source)

    def moe_fields(self, hf: dict, source: str) -> dict:
        n_layer = int_field(hf, "num_hidden_layers", source)
        types = hf.get("layer_types")
        if types is not None:
            if not isinstance(types, list):
                raise UserError(f"{source}: layer_types={types!r} must be a list; fix the file")
            why = layer_types_problem(types, n_layer)
            if why:
                raise UserError(f"{source}: layer_types {why}; fix the file")
        types = tuple(types or ())
        return super().moe_fields(hf, source) | {
            "moe_ffn_hidden": int_field(hf, "intermediate_size", source),
            "norm_topk_prob": True,
            "layer_types": () if types == default_layer_types(n_layer) else types,
        } | {k: float_field(hf, k, source, v) for k, v in SWIGLU_DEFAULTS.items()}  # fmt: skip

    def config_from_hf(self, hf: dict, source: str) -> ModelConfig:
        """Llama's reading with attention_bias taken here (Llama refuses it), and no dense MLP:
        intermediate_size is the experts' width, ffn_hidden stays unset."""
        bias = hf.get("attention_bias", True)
        if bias is not True:
            raise UserError(
                f"{source}: attention_bias={bias!r}; fitgpt's gpt_oss has biases on q, k, v "
                "and o (every published gpt-oss does): set it to true"
            )
        rest = {k: v for k, v in hf.items() if k != "attention_bias"}
        return super().config_from_hf(rest, source).replace(ffn_hidden=None)

    def stored_maps(self, cfg: ModelConfig, hf: dict, source: str) -> list[TensorMap]:
        """tensor_maps, the experts' two projections read as MXFP4 where quantization_config
        says mxfp4 (the published folders)."""
        quant = hf.get("quantization_config")
        maps = self.tensor_maps(cfg)
        if quant is None:
            return maps
        method = quant.get("quant_method") if isinstance(quant, dict) else None
        if method not in QUANT_METHODS:
            raise UserError(
                f"{source}: quantization_config quant_method={method!r}; fitgpt reads gpt-oss "
                "unquantized or with MXFP4 experts (quant_method mxfp4) only"
            )
        packed = (".mlp.experts.gate_up_proj", ".mlp.experts.down_proj")
        return [TensorMap(m.hf, m.fitgpt, mxfp4=True) if m.hf.endswith(packed) else m for m in maps]

    def tensor_maps(self, cfg: ModelConfig) -> list[TensorMap]:
        """MoeMapping's (Llama's, each layer's MLP replaced by expert_maps), with o_proj's bias
        and the sinks after o_proj's weight."""
        maps = []
        for m in super().tensor_maps(cfg):
            maps.append(m)
            if m.hf.endswith("self_attn.o_proj.weight"):
                att, fat = m.hf.removesuffix("o_proj.weight"), m.fitgpt.removesuffix("proj.weight")
                if cfg.qkv_bias:
                    maps.append(TensorMap(att + "o_proj.bias", fat + "proj.bias"))
                maps.append(TensorMap(att + "sinks", fat + "sinks"))
        return maps

    def expert_maps(self, cfg: ModelConfig, i: int) -> list[TensorMap]:
        hf, fit = f"model.layers.{i}.mlp.", f"blocks.{i}.mlp."
        maps = [TensorMap(f"{hf}router.{k}", f"{fit}router.{k}") for k in ("weight", "bias")]
        for ours, theirs in (("gate_up", "gate_up_proj"), ("down", "down_proj")):
            maps.append(TensorMap(f"{hf}experts.{theirs}", f"{fit}experts.{ours}"))
            maps.append(TensorMap(f"{hf}experts.{theirs}_bias", f"{fit}experts.{ours}_bias"))
        return maps

    def hf_extras(self, cfg: ModelConfig) -> dict:
        return {
            "attention_bias": cfg.qkv_bias,
            "sliding_window": cfg.sliding_window,
            "layer_types": list(layer_kinds(cfg)),
            "intermediate_size": cfg.moe_ffn_hidden,
            "swiglu_alpha": cfg.swiglu_alpha,
            "swiglu_limit": cfg.swiglu_limit,
        } | self.moe_extras(cfg)


MAPPING = GptOssMapping()
