"""Llama's Hugging Face name map: fitgpt's Llama network (model.py) and Hugging Face's
LlamaForCausalLM (model/hf_map.py says what a map is; interop/ reads and writes checkpoints
through it). The qwen2, qwen3 and mistral folders subclass LlamaMapping for Qwen2ForCausalLM,
Qwen3ForCausalLM and MistralForCausalLM: the fitgpt family's name is HF's model_type.

The four compute the same function with a few switches (RMSNorm, rotary positions, SwiGLU,
grouped-query attention): Qwen2 adds biases to q, k and v; Qwen3 an RMSNorm over each head of q
and k before the rotation; Mistral a sliding window. They store it alike:

| fitgpt (model.py)                  | HF                                      | layout                 |
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
rope_parameters; with both, as transformers 5 reads them: _rope) ⇄ rope_theta and rope_scaling,
max_position_embeddings ⇄ max_positions, tie_word_embeddings ⇄ tie_embeddings (untied where the
weights hold a head other than the embedding: hf_read.py stored_head), sliding_window ⇄
sliding_window.

The training context (seq_len) is no property of the weights: rotary positions have no table.
Import sets it to max_position_embeddings capped at IMPORT_SEQ_LEN (Llama 3.1 says 131072, a
context nobody fine-tunes at by default) and keeps max_position_embeddings in max_positions, which
export writes back.

Refused on import, in one line naming the key and the value: hidden_act other than silu; a
rope_scaling (rope_type) other than the default, linear, llama3 and yarn (yarn with DeepSeek's
mscale keys too), one lacking a key transformers requires, or a partial_rotary_factor;
attention_bias or mlp_bias (Llama, Qwen3 and Mistral put them on every projection, fitgpt has
none there); a head_dim that is odd (rotary pairs) or missing where heads do not divide
hidden_size; key/value heads that do not divide the heads; a Qwen2/3 sliding window
(use_sliding_window with any layer sliding): fitgpt's qwen families attend fully, only its
mistral family slides a window (in every layer). What differs by family is a method each
folder's mapping overrides: sliding_window (config.json → the window) and hf_extras (the keys
only its HF class has).
"""

from __future__ import annotations

from typing import ClassVar

from fitgpt.errors import UserError
from fitgpt.model.config import ModelConfig, RopeScaling
from fitgpt.model.families.llama.family import LlamaFamily
from fitgpt.model.hf_map import HFMapping, TensorMap, float_field, int_field, tied

IMPORT_SEQ_LEN = 4096  # the training context an import records, at most (see the docstring)
ROPE_TYPES = ("default", "linear", "llama3", "yarn")  # what fitgpt's rotary embedding computes
# The keys each scaling type requires (transformers' _validate_*_rope_parameters: a KeyError
# there); original_max_position_embeddings defaults to max_position_embeddings.
ROPE_REQUIRED = {
    "linear": ("factor",),
    "llama3": ("factor", "low_freq_factor", "high_freq_factor"),
    "yarn": ("factor",),
}
# YaRN's optional keys, read when present and written back only then (RopeScaling's fields)
YARN_OPTIONAL = ("beta_fast", "beta_slow", "attention_factor")
# The HF classes' defaults, for keys a hand-written config.json may leave out.
DEFAULT_EPS, DEFAULT_THETA = 1e-6, 10000.0


def _rope(hf: dict, source: str) -> tuple[float, RopeScaling | None]:
    """rope_theta and the scaling, read as transformers 5 reads config.json (PreTrainedConfig's
    convert_rope_params_to_dict and standardize_rope_params, modeling_rope_utils.py):

    - a non-empty rope_scaling replaces rope_parameters whole: the long-context scaling a model
      card says to add to a transformers-5 folder is what runs;
    - rope_theta is the chosen dict's, else config.json's top-level one, else 10000 (so a
      rope_theta left in the replaced rope_parameters is dropped, as transformers drops it);
    - the type is rope_type, else type (older files), else default; llama3 and yarn without
      original_max_position_embeddings take max_position_embeddings.

    Refused in one line naming the key: what transformers refuses (a key its type requires is
    missing, a type it has no function for) and the types fitgpt's rotary positions do not
    compute (dynamic, longrope, ...), never imported as plain RoPE."""
    for name in ("rope_scaling", "rope_parameters"):
        if hf.get(name) is not None and not isinstance(hf[name], dict):
            raise UserError(f"{source}: {name}={hf[name]!r} must be a JSON object or null; fix it")
    key = "rope_scaling" if hf.get("rope_scaling") else "rope_parameters"
    scaling = hf.get(key) or {}
    if any(isinstance(v, dict) for v in scaling.values()):
        raise UserError(
            f"{source}: {key} differ by layer type ({', '.join(scaling)}); fitgpt rotates every "
            "layer alike"
        )
    theta = float_field(
        scaling if "rope_theta" in scaling else hf, "rope_theta", source, DEFAULT_THETA
    )
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind not in ROPE_TYPES:
        raise UserError(f"{source}: {key} type {kind!r}; {_unknown_rope(kind, key)}")
    partial = scaling.get("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0))
    if partial != 1.0:
        raise UserError(
            f"{source}: partial_rotary_factor={partial}; fitgpt rotates the whole head (1.0)"
        )
    if kind == "default":
        return theta, None
    missing = [k for k in ROPE_REQUIRED[kind] if k not in scaling]
    if missing:
        like = " as Llama 3.1's: factor 8, low_freq_factor 1, high_freq_factor 4" * (
            kind == "llama3"
        )
        raise UserError(
            f"{source}: {key} of type {kind!r} lacks {', '.join(missing)} (transformers refuses "
            f"it too); add {'them' if len(missing) > 1 else 'it'}{like}"
        )
    if kind == "linear":
        return theta, RopeScaling(
            kind="linear", factor=_rope_number(scaling, "factor", key, source)
        )
    field = f"{key}.original_max_position_embeddings"
    given = scaling.get("original_max_position_embeddings", hf.get("max_position_embeddings"))
    original = int_field({field: given}, field, source)
    if kind == "yarn":
        return theta, _yarn(scaling, key, source, original)
    return theta, RopeScaling(
        kind="llama3",
        factor=_rope_number(scaling, "factor", key, source),
        low_freq_factor=_rope_number(scaling, "low_freq_factor", key, source),
        high_freq_factor=_rope_number(scaling, "high_freq_factor", key, source),
        original_max_positions=original,
    )


def _unknown_rope(kind: object, key: str) -> str:
    """What to do about a rope type fitgpt does not compute, in words."""
    if kind == "dynamic":  # transformers' dynamic NTK equals plain RoPE up to the context
        return (
            "fitgpt does not compute dynamic NTK scaling, whose frequencies change with each "
            f"sequence's length; it equals plain RoPE up to max_position_embeddings: remove {key} "
            "to fine-tune within that"
        )
    if kind in ("longrope", "proportional"):
        return (
            f"fitgpt computes the {', '.join(ROPE_TYPES)} scalings only, so this checkpoint "
            "cannot be fine-tuned as it is"
        )
    return (
        f"no rotary scaling has that name (transformers has no function for it either): fix "
        f"rope_type to one of {', '.join(ROPE_TYPES)}, or remove {key} for plain RoPE"
    )


def _rope_number(scaling: dict, name: str, key: str, source: str) -> float:
    """A positive number of the rope dict, named as key.name in the error."""
    return float_field({f"{key}.{name}": scaling.get(name)}, f"{key}.{name}", source, None)


def _yarn(scaling: dict, key: str, source: str, original: int) -> RopeScaling:
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
        factor=_rope_number(scaling, "factor", key, source),
        original_max_positions=original,
        truncate=truncate,
        **opt,
    )


def _rope_out(r: RopeScaling) -> dict:
    """The rope_scaling keys of `r` as transformers reads them."""
    out: dict = {"rope_type": r.kind, "factor": r.factor}
    if r.kind == "linear":
        return out
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
    # the fitgpt family this maps (its name is HF's model_type) and its transformers class
    family: ClassVar[type[LlamaFamily]] = LlamaFamily
    hf_class: ClassVar[str] = "LlamaForCausalLM"
    layers_key = "num_hidden_layers"
    import_format = "hf-llama"

    def architecture(self, cfg: ModelConfig) -> str:
        return self.hf_class

    def sliding_window(self, hf: dict, n_layer: int, source: str) -> int | None:
        """The window config.json `hf` slides, or None: Llama has none (its HF class ignores
        sliding_window)."""
        return None

    def extra_fields(self, hf: dict, source: str) -> dict:
        """ModelConfig fields only this family has, from config.json `hf` (a mixture of
        experts': qwen3_moe/hf.py)."""
        return {}

    def hf_extras(self, cfg: ModelConfig) -> dict:
        """config.json's keys that only this family's HF class has (written last)."""
        return {"attention_bias": False, "mlp_bias": False}

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
        """Nothing to refuse: each family's check (family.py) already refuses, when the
        config is made, every switch its HF class lacks (q/k/v biases outside qwen2, q/k norms
        outside qwen3, a window outside mistral)."""

    def config_from_hf(self, hf: dict, source: str) -> ModelConfig:
        mt = self.family.name
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
            qkv_bias=self.family.has_qkv_bias,
            qk_norm=self.family.has_qk_norm,
            sliding_window=self.sliding_window(hf, n_layer, source),
            tie_embeddings=tied(hf, source, self.default_tied()),
            **self.extra_fields(hf, source),
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
            "architectures": [self.architecture(cfg)],
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
        return out | self.hf_extras(cfg)


MAPPING = LlamaMapping()
