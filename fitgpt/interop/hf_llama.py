"""The mapping between fitgpt's Llama network (model/llama.py) and Hugging Face's
LlamaForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM and MistralForCausalLM (one entry of
hf.py's registry; the fitgpt family's name is HF's model_type).

The four compute the same function with a few switches (RMSNorm, rotary positions, SwiGLU,
grouped-query attention): Qwen2 adds biases to q, k and v; Qwen3 an RMSNorm over each head of q
and k before the rotation; Mistral a sliding window. They store it alike:

| fitgpt (model/llama.py)            | HF                                      | layout                 |
|------------------------------------|-----------------------------------------|------------------------|
| wte.weight [V_pad, H]              | model.embed_tokens.weight [V, H]        | rows cut / zero-padded |
| blocks.i.ln_1.weight               | model.layers.i.input_layernorm.weight   | same                   |
| blocks.i.attn.q.{weight,bias}      | ….self_attn.q_proj.{weight,bias}        | same                   |
| blocks.i.attn.kv.{weight,bias}     | ….self_attn.k_proj, then v_proj         | k rows, then v rows    |
| blocks.i.attn.q_norm/k_norm.weight | ….self_attn.q_norm/k_norm.weight        | same (Qwen3)           |
| blocks.i.attn.proj.weight          | ….self_attn.o_proj.weight               | same                   |
| blocks.i.ln_2.weight               | ….post_attention_layernorm.weight       | same                   |
| blocks.i.mlp.fc.weight [2F, H]     | ….mlp.gate_proj, then mlp.up_proj       | gate rows, then up     |
| blocks.i.mlp.proj.weight           | ….mlp.down_proj.weight                  | same                   |
| ln_f.weight                        | model.norm.weight                       | same                   |
| lm_head.weight (untied only)       | lm_head.weight (untied only)            | rows cut / zero-padded |

config.json ⇄ ModelConfig: hidden_size ⇄ n_embd, intermediate_size ⇄ ffn_hidden,
num_hidden_layers ⇄ n_layer, num_attention_heads ⇄ n_head, num_key_value_heads ⇄ n_kv_head,
head_dim ⇄ head_size, rms_norm_eps ⇄ norm_eps, rope_theta and rope_scaling (or transformers 5's
rope_parameters) ⇄ rope_theta and rope_scaling, max_position_embeddings ⇄ max_positions,
tie_word_embeddings ⇄ tie_embeddings, sliding_window ⇄ sliding_window.

The training context (seq_len) is no property of the weights: rotary positions have no table.
Import sets it to max_position_embeddings capped at IMPORT_SEQ_LEN (Llama 3.1 says 131072, a
context nobody fine-tunes at by default) and keeps max_position_embeddings in max_positions, which
export writes back.

Refused on import, in one line naming the key and the value: hidden_act other than silu; a
rope_scaling (rope_type) other than the default, llama3 and yarn (yarn with DeepSeek's mscale
keys too), or a partial_rotary_factor;
attention_bias or mlp_bias (Llama, Qwen3 and Mistral put them on every projection, fitgpt has
none there); a head_dim that is odd (rotary pairs) or missing where heads do not divide
hidden_size; key/value heads that do not divide the heads; a Qwen2/3 sliding window
(use_sliding_window with any layer sliding): fitgpt's qwen families attend fully, only its
mistral family slides a window (in every layer).
"""

from __future__ import annotations

from fitgpt.errors import UserError
from fitgpt.interop.hf import (
    HFMapping,
    TensorMap,
    float_field,
    int_field,
    register_mapping,
    tied,
)
from fitgpt.model import ModelConfig
from fitgpt.model.config import RopeScaling

ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "mistral": "MistralForCausalLM",
}
IMPORT_SEQ_LEN = 4096  # the training context an import records, at most (see the docstring)
ROPE_TYPES = ("default", "llama3", "yarn")  # what fitgpt's rotary embedding computes
# YaRN's optional keys, read when present and written back only then (RopeScaling's fields)
YARN_OPTIONAL = ("beta_fast", "beta_slow", "attention_factor")
# The HF classes' defaults, for keys a hand-written config.json may leave out.
DEFAULT_EPS, DEFAULT_THETA = 1e-6, 10000.0


def _rope(hf: dict, source: str) -> tuple[float, RopeScaling | None]:
    """rope_theta and the scaling, from transformers 5's rope_parameters or the older
    rope_theta + rope_scaling keys."""
    params = hf.get("rope_parameters")
    if params is not None and not isinstance(params, dict):
        raise UserError(f"{source}: rope_parameters={params!r} must be a JSON object; fix it")
    if params and any(isinstance(v, dict) for v in params.values()):
        raise UserError(
            f"{source}: rope_parameters differ by layer type ({', '.join(params)}); fitgpt "
            "rotates every layer alike"
        )
    key = "rope_parameters" if params else "rope_scaling"
    scaling = params or hf.get("rope_scaling") or {}
    if not isinstance(scaling, dict):
        raise UserError(f"{source}: rope_scaling={scaling!r} must be a JSON object or null")
    theta = float_field(scaling if "rope_theta" in scaling else hf, "rope_theta", source, 1e4)
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind not in ROPE_TYPES:
        raise UserError(
            f"{source}: {key} type {kind!r}; fitgpt's rotary positions support the default, "
            "'llama3' and 'yarn' scalings only"
        )
    partial = scaling.get("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0))
    if partial != 1.0:
        raise UserError(
            f"{source}: partial_rotary_factor={partial}; fitgpt rotates the whole head (1.0)"
        )
    if kind == "default":
        return theta, None
    if kind == "yarn":
        return theta, _yarn(scaling, key, source)
    return theta, RopeScaling(
        kind="llama3",
        factor=float_field(scaling, "factor", source, None),
        low_freq_factor=float_field(scaling, "low_freq_factor", source, None),
        high_freq_factor=float_field(scaling, "high_freq_factor", source, None),
        original_max_positions=int_field(scaling, "original_max_position_embeddings", source),
    )


def _yarn(scaling: dict, key: str, source: str) -> RopeScaling:
    """YaRN's fields; the optional ones kept None when absent (export leaves them out)."""
    for extra in ("mscale", "mscale_all_dim"):  # DeepSeek's variant of the attention factor
        if scaling.get(extra) is not None:
            raise UserError(
                f"{source}: {key} {extra}={scaling[extra]!r}; fitgpt's yarn takes "
                "attention_factor (or derives it from factor), not mscale"
            )
    opt = {
        k: float_field(scaling, k, source, None)
        for k in YARN_OPTIONAL
        if scaling.get(k) is not None
    }
    truncate = scaling.get("truncate")
    if truncate is not None and not isinstance(truncate, bool):
        raise UserError(f"{source}: {key} truncate={truncate!r} must be true or false")
    return RopeScaling(
        kind="yarn",
        factor=float_field(scaling, "factor", source, None),
        original_max_positions=int_field(scaling, "original_max_position_embeddings", source),
        truncate=truncate,
        **opt,
    )


def _rope_out(r: RopeScaling) -> dict:
    """The rope_scaling keys of `r` as transformers reads them."""
    out: dict = {"rope_type": r.kind, "factor": r.factor}
    if r.kind == "llama3":
        out |= {"low_freq_factor": r.low_freq_factor, "high_freq_factor": r.high_freq_factor}
    out["original_max_position_embeddings"] = r.original_max_positions
    if r.kind == "yarn":
        for k in YARN_OPTIONAL:
            if getattr(r, k) is not None:
                out[k] = getattr(r, k)
        if r.truncate is not None:
            out["truncate"] = r.truncate
    return out


def _sliding_window(hf: dict, mt: str, n_layer: int, source: str) -> int | None:
    """Mistral's window (every layer slides it when set), or None. Qwen2/3 slide one only with
    use_sliding_window, in the layers layer_types marks (derived, when absent, as transformers
    does: those from max_window_layers on); fitgpt's qwen families have none, so a window in
    any layer is refused (released Qwen2.5/Qwen3 checkpoints set use_sliding_window false)."""
    if mt == "llama":
        return None
    window = hf.get("sliding_window")
    if mt in ("qwen2", "qwen3") and not hf.get("use_sliding_window", False):
        window = None
    if window is None:
        return None
    window = int_field(hf, "sliding_window", source)
    if mt == "mistral":
        return window
    types = hf.get("layer_types")
    if types is None:
        first = hf.get("max_window_layers", 28)
        types = ["sliding_attention" if i >= first else "full_attention" for i in range(n_layer)]
    sliding = sum(t == "sliding_attention" for t in types) if isinstance(types, list) else -1
    if sliding == 0:
        return None
    raise UserError(
        f"{source}: use_sliding_window=true slides a window of {window} in {sliding} of "
        f"{n_layer} layers (max_window_layers={hf.get('max_window_layers')!r}); fitgpt's {mt} "
        "has full attention in every layer (its mistral family slides one window in all)"
    )


def _refuse_unsupported(hf: dict, mt: str, source: str) -> None:
    act = hf.get("hidden_act", "silu")
    if act != "silu":
        raise UserError(
            f"{source}: hidden_act={act!r}; fitgpt's {mt} MLP is SwiGLU with silu, other "
            "activations cannot be imported"
        )
    for key in ("attention_bias", "mlp_bias"):
        if hf.get(key, False) is not False:
            where = "q/k/v/o projections" if key == "attention_bias" else "MLP"
            raise UserError(
                f"{source}: {key}={hf[key]!r}; fitgpt's {mt} has no biases in its {where}"
                + (" (Qwen2 alone has q/k/v biases)" if key == "attention_bias" else "")
            )


def _heads(hf: dict, source: str) -> tuple[int, int, int | None]:
    """(heads, key/value heads, head_size or None when it is hidden_size / heads)."""
    hidden = int_field(hf, "hidden_size", source)
    heads = int_field(hf, "num_attention_heads", source)
    kv = (
        int_field(hf, "num_key_value_heads", source, heads)
        if hf.get("num_key_value_heads")
        else heads
    )
    if heads % kv:
        raise UserError(
            f"{source}: num_key_value_heads={kv} does not divide num_attention_heads={heads}; "
            "grouped-query attention shares each key/value head among a whole group"
        )
    if hf.get("head_dim") is None:
        if hidden % heads:
            raise UserError(
                f"{source}: hidden_size={hidden} is not divisible by num_attention_heads="
                f"{heads} and head_dim is not given; add head_dim"
            )
        return heads, kv, None
    head_dim = int_field(hf, "head_dim", source)
    if head_dim % 2:
        raise UserError(
            f"{source}: head_dim={head_dim} is odd; rotary positions rotate pairs of a head's "
            "channels, so it must be even"
        )
    return heads, kv, None if head_dim * heads == hidden else head_dim


class LlamaMapping(HFMapping):
    model_types = tuple(ARCHITECTURES)
    families = tuple(ARCHITECTURES)
    layers_key = "num_hidden_layers"
    import_format = "hf-llama"

    def architecture(self, cfg: ModelConfig) -> str:
        return ARCHITECTURES[cfg.family]

    def default_tied(self) -> bool:
        return False  # LlamaConfig, Qwen2/3Config and MistralConfig default to an untied head

    def canonical(self, key: str) -> str | None:
        """LlamaForCausalLM's spelling; a LlamaModel's keys (no `model.`) are prefixed; the
        rotary inv_freq buffers older checkpoints store are no weights."""
        if "rotary_emb." in key:
            return None
        if key.startswith(("layers.", "embed_tokens.", "norm.")):
            return "model." + key
        return key  # anything else is kept, so an unexpected tensor is named, not dropped

    def layer_of(self, name: str) -> int | None:
        parts = name.split(".")
        if parts[:2] == ["model", "layers"] and len(parts) > 2 and parts[2].isdigit():
            return int(parts[2])
        return None

    def tensor_maps(self, cfg: ModelConfig) -> list[TensorMap]:
        self.check_exportable(cfg)
        maps = [TensorMap("model.embed_tokens.weight", "wte.weight", vocab_rows=True)]
        for i in range(cfg.n_layer):
            hf, fit = f"model.layers.{i}.", f"blocks.{i}."
            att, fat = hf + "self_attn.", fit + "attn."
            maps.append(TensorMap(hf + "input_layernorm.weight", fit + "ln_1.weight"))
            for kind in ("weight", "bias") if cfg.qkv_bias else ("weight",):
                maps.append(TensorMap(f"{att}q_proj.{kind}", f"{fat}q.{kind}"))
                maps.append(TensorMap(f"{att}k_proj.{kind}", f"{fat}kv.{kind}", part=(0, 2)))
                maps.append(TensorMap(f"{att}v_proj.{kind}", f"{fat}kv.{kind}", part=(1, 2)))
            if cfg.qk_norm:
                maps.append(TensorMap(att + "q_norm.weight", fat + "q_norm.weight"))
                maps.append(TensorMap(att + "k_norm.weight", fat + "k_norm.weight"))
            maps.append(TensorMap(att + "o_proj.weight", fat + "proj.weight"))
            maps.append(TensorMap(hf + "post_attention_layernorm.weight", fit + "ln_2.weight"))
            maps.append(TensorMap(hf + "mlp.gate_proj.weight", fit + "mlp.fc.weight", part=(0, 2)))
            maps.append(TensorMap(hf + "mlp.up_proj.weight", fit + "mlp.fc.weight", part=(1, 2)))
            maps.append(TensorMap(hf + "mlp.down_proj.weight", fit + "mlp.proj.weight"))
        maps.append(TensorMap("model.norm.weight", "ln_f.weight"))
        if not cfg.tie_embeddings:
            maps.append(TensorMap("lm_head.weight", "lm_head.weight", vocab_rows=True))
        return maps

    def check_exportable(self, cfg: ModelConfig) -> None:
        """Nothing to refuse: each family's check (model/llama.py) already refuses, when the
        config is made, every switch its HF class lacks (q/k/v biases outside qwen2, q/k norms
        outside qwen3, a window outside mistral)."""

    def config_from_hf(self, hf: dict, source: str) -> ModelConfig:
        mt = hf["model_type"]
        _refuse_unsupported(hf, mt, source)
        n_layer = int_field(hf, "num_hidden_layers", source)
        heads, kv, head_size = _heads(hf, source)
        theta, scaling = _rope(hf, source)
        max_pos = int_field(hf, "max_position_embeddings", source)
        cfg = ModelConfig(
            family=mt,
            n_layer=n_layer,
            n_embd=int_field(hf, "hidden_size", source),
            n_head=heads,
            n_kv_head=kv if kv != heads else None,
            head_size=head_size,
            seq_len=min(max_pos, IMPORT_SEQ_LEN),
            max_positions=max_pos,
            vocab_size=int_field(hf, "vocab_size", source),
            bias=False,
            dropout=0.0,
            position="rope",
            norm_eps=float_field(hf, "rms_norm_eps", source, DEFAULT_EPS),
            rope_theta=theta,
            rope_scaling=scaling,
            qkv_bias=mt == "qwen2",
            qk_norm=mt == "qwen3",
            sliding_window=_sliding_window(hf, mt, n_layer, source),
            tie_embeddings=tied(hf, source, self.default_tied()),
        )
        # stored only where it is not the family's default, as n_kv_head and head_size are,
        # so an import equals the preset of its shape
        ffn = int_field(hf, "intermediate_size", source)
        return cfg if cfg.ffn_width == ffn else cfg.replace(ffn_hidden=ffn)

    def hf_config(self, cfg: ModelConfig, ids: dict) -> dict:
        """config.json for transformers 5 (rope_parameters) and 4 (rope_theta, rope_scaling)
        alike: each reads its own keys and ignores the other's."""
        self.check_exportable(cfg)
        rope: dict = {"rope_type": "default", "rope_theta": cfg.rope_theta}
        scaling = None
        if cfg.rope_scaling is not None:
            scaling = _rope_out(cfg.rope_scaling)
            rope = scaling | {"rope_theta": cfg.rope_theta}
        out = {
            "architectures": [ARCHITECTURES[cfg.family]],
            "model_type": cfg.family,
            "vocab_size": cfg.vocab_size,
            "hidden_size": cfg.n_embd,
            "intermediate_size": cfg.ffn_width,
            "num_hidden_layers": cfg.n_layer,
            "num_attention_heads": cfg.n_head,
            "num_key_value_heads": cfg.kv_heads,
            "head_dim": cfg.head_dim,
            "hidden_act": "silu",
            "max_position_embeddings": cfg.max_positions or cfg.seq_len,
            "rms_norm_eps": cfg.norm_eps,
            "rope_theta": cfg.rope_theta,
            "rope_scaling": scaling,
            "rope_parameters": rope,
            "tie_word_embeddings": cfg.tie_embeddings,
            "attention_dropout": 0.0,
            "initializer_range": cfg.weight_std(),
            "use_cache": True,
            "bos_token_id": ids.get("bos_token_id"),
            "eos_token_id": ids.get("eos_token_id"),
            "pad_token_id": None,
        }
        if cfg.family in ("llama", "qwen3"):
            out["attention_bias"] = False
        if cfg.family == "llama":
            out["mlp_bias"] = False
        if cfg.family == "mistral":
            out["sliding_window"] = cfg.sliding_window
        if cfg.family in ("qwen2", "qwen3"):  # full attention everywhere (model/llama.py)
            out["use_sliding_window"] = False
            out["sliding_window"] = None
            out["max_window_layers"] = cfg.n_layer
            out["layer_types"] = ["full_attention"] * cfg.n_layer
        return out


LLAMA = register_mapping(LlamaMapping())
