"""Model configuration.

One ModelConfig describes a model of any family (model/family.py): the fields every decoder has
(layers, width, heads, context, vocabulary), and those only some families honour (key/value
heads, rotary positions, q/k norms, biases on q/k/v, a sliding window). Each family refuses the
fields it cannot honour, in one line, when the config is made (Family.check), found through
the registry (model/families/__init__.py), which loads the family by name. The registry sits
above this module: it hands its lookup to this module when it loads (`use_registry`), so this
module imports no family and nothing here is imported back. The named presets
live in each family's folder (model/presets.py gathers them).

Vocabulary padding lives here and only here: `padded_vocab(v)` is what training, generation and
export all call, so a checkpoint's embedding shape never disagrees with the model that loads it.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field, replace
from typing import Literal

from fitgpt.errors import UserError

# ModelConfig -> its Family: the registry's family_of, handed over by model/families/__init__.py
# when it loads. fitgpt.model's package init loads the registry right after this module, so no
# config is made before it is set; the cost is that the family behind a config is found by a
# name looked up at run time, not one an import names.
_family_of = None


def use_registry(family_of) -> None:
    """Find every config's family with `family_of` (the registry's; model/families)."""
    global _family_of
    _family_of = family_of


VOCAB_MULTIPLE = 128  # tensor-core friendly; GPT-2's 50257 becomes 50304
GPT2_VOCAB = 50257


def padded_vocab(vocab_size: int, multiple: int = VOCAB_MULTIPLE) -> int:
    """The embedding rows for a tokenizer of `vocab_size` tokens: rounded up to `multiple`."""
    return int(math.ceil(vocab_size / multiple) * multiple)


# Initialisation by width. GPT-2 drew every weight from N(0, 0.02) whatever the width; at 6144
# and beyond that is two to four times the spread its peers start from: "small init"
# sqrt(2/(5·d)) (Nguyen & Salazar 2019; GPT-NeoX and Pythia, 0.0081 at 6144) and OPT-175B's
# 0.006 at 12288 (sqrt(2/(5·12288)) = 0.0057). The rule below is the smaller of the two, so
# widths up to 1000 (GPT-2 small and medium, the CPU demo, every test model) keep exactly
# GPT-2's 0.02 (nanoGPT comparisons start from the same weights) and wider models follow small
# init. Why smaller: Adam's first updates move every weight by about the learning rate in the
# same direction, so a layer's output moves by lr x fan-in x the size of its inputs; smaller
# weights make smaller inputs to the next layer, so the same rate moves the network less
# (benchmarks/results/defaults_cpu_2026-11-26). The residual projections keep GPT-2's
# 1/sqrt(2L) on top (ModelConfig.residual_std); GPT-NeoX's "wang init" 2/(L·sqrt(d)) is within
# a factor 2 of it at every preset and would move GPT-2 1.5 B's residual init by 2x.
INIT_STD_MAX = 0.02


def small_init_std(n_embd: int) -> float:
    """The default standard deviation of the weights of a model n_embd wide."""
    return min(INIT_STD_MAX, math.sqrt(2 / (5 * n_embd)))


ROPE_KINDS = ("linear", "llama3", "yarn")  # the rotary scalings families/llama/model.py computes
# a layer's attention (ModelConfig.layer_types): over every key before it, or the last
# sliding_window of them (transformers' names)
LAYER_TYPES = ("full_attention", "sliding_attention")
# fields only some families honour (their Family.own_fields), and the value that means "not
# set": every other family refuses them set
OWN_FIELDS = {"layer_types": (), "swiglu_alpha": None, "swiglu_limit": None}


def layer_types_problem(types: tuple | list, n_layer: int) -> str | None:
    """What is wrong with `types` as the layer_types of n_layer layers, in words; None: nothing
    (() is the family's own pattern)."""
    bad = [t for t in types if t not in LAYER_TYPES]
    if bad:
        return f"holds {bad[0]!r}: each entry is one of {', '.join(LAYER_TYPES)}"
    if types and len(types) != n_layer:
        return f"has {len(types)} entries for {n_layer} layers: give one per layer"
    return None


@dataclass(frozen=True)
class RopeScaling:
    """Rotary frequencies stretched for contexts past the length a model was trained at
    (Hugging Face's rope_scaling / rope_parameters), as families/llama/model.py rope_inv_freq
    computes:

    linear  every frequency divided by `factor` (position interpolation; transformers'
            "linear"): positions read as if `factor` times closer.
    llama3  Llama 3's: wavelengths longer than original_max_positions / low_freq_factor are
            divided by `factor`, shorter than original_max_positions / high_freq_factor kept,
            those between interpolated.
    yarn    YaRN (Peng et al. 2023; Qwen2.5's and Qwen3's long-context configs): frequencies
            that turn fewer than beta_slow times over original_max_positions divided by
            `factor`, more than beta_fast times kept, a linear ramp between; cos and sin
            multiplied by attention_factor (0.1·ln(factor) + 1 when not given).
    The yarn fields left None were absent from the config it came from: transformers'
    defaults apply (beta_fast 32, beta_slow 1, truncate true) and export leaves them out, so
    a config goes out as it came in. The llama3 fields mean nothing to yarn, and none but
    `factor` to linear."""

    kind: Literal["linear", "llama3", "yarn"] = "llama3"
    factor: float = 8.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_positions: int = 8192
    beta_fast: float | None = None  # yarn
    beta_slow: float | None = None  # yarn
    attention_factor: float | None = None  # yarn
    truncate: bool | None = None  # yarn: round the ramp's ends outwards to whole dimensions

    def __post_init__(self) -> None:
        if self.kind not in ROPE_KINDS:
            raise UserError(
                f"rope scaling {self.kind!r} is not supported: use one of {', '.join(ROPE_KINDS)}"
            )
        if self.original_max_positions < 1:
            raise UserError(
                f"rope scaling original_max_positions={self.original_max_positions} must be >= 1"
            )
        if self.kind == "linear":
            if not self.factor > 0:
                raise UserError(f"linear rope scaling factor={self.factor} must be positive")
            return
        if self.kind == "yarn":
            for name in ("beta_fast", "beta_slow", "attention_factor"):
                v = getattr(self, name)
                if v is not None and not v > 0:
                    raise UserError(f"yarn rope scaling {name}={v} must be positive")
            if not self.factor >= 1:
                raise UserError(f"yarn rope scaling factor={self.factor} must be >= 1")
            return
        if not (self.factor >= 1 and 0 < self.low_freq_factor < self.high_freq_factor):
            raise UserError(
                f"rope scaling factor={self.factor}, low_freq_factor={self.low_freq_factor}, "
                f"high_freq_factor={self.high_freq_factor}: need factor >= 1 and "
                "0 < low_freq_factor < high_freq_factor"
            )


@dataclass(frozen=True)
class ModelConfig:
    """A decoder of one family (`family`). Every field without metadata cli=False is a flag of
    `fitgpt train`; the family-specific ones keep defaults that mean GPT-2's behaviour."""

    n_layer: int = field(default=12, metadata={"help": "transformer blocks", "flag": "layers"})
    n_embd: int = field(
        default=768, metadata={"help": "hidden size (the width of every layer)", "flag": "hidden"}
    )
    n_head: int = field(
        default=12,
        metadata={"help": "attention heads (must divide the hidden size)", "flag": "heads"},
    )
    seq_len: int = field(default=1024, metadata={"help": "context length: tokens per sequence"})
    vocab_size: int = field(
        default=GPT2_VOCAB,
        metadata={
            "help": "vocabulary size, padded to a multiple of 128 in the embedding; training "
            "on text data uses its tokenizer's instead"
        },
    )
    bias: bool = field(default=True, metadata={"help": "biases in linear layers and LayerNorms"})
    dropout: float = field(default=0.0, metadata={"help": "dropout on embeddings, attention, MLP"})
    position: Literal["learned", "alibi", "rope"] = field(
        default="learned",
        metadata={"help": "learned absolute positions, ALiBi biases, or rotary (Llama families)"},
    )
    embed_norm: bool = field(
        default=False, metadata={"help": "LayerNorm after the embedding (BLOOM's stability fix)"}
    )
    tie_embeddings: bool = field(
        default=True, metadata={"help": "share the input embedding with the output head"}
    )
    # the network this config builds (model/families/): set by presets and Hugging Face import
    family: str = field(default="gpt2", metadata={"help": "model family", "cli": False})
    init_std: float | None = field(
        default=None,
        metadata={
            "help": "standard deviation of the initial weights (the residual projections get "
            "it divided by sqrt(2·layers))",
            "default_text": "by width: GPT-2's 0.02 up to 1000 wide, then sqrt(2/(5·hidden)): "
            "0.0158 at 1600, 0.0081 at 6144",
        },
    )
    # ---- honoured by some families only (Family.check refuses the rest) --------------------
    n_kv_head: int | None = field(
        default=None,
        metadata={
            "help": "key/value heads of grouped-query attention (must divide the heads)",
            "flag": "kv-heads",
            "default_text": "the head count",
        },
    )
    # D when it is not hidden/heads (Qwen3-32B: hidden 5120, 64 heads of 128)
    head_size: int | None = field(
        default=None, metadata={"help": "per-head dimension", "cli": False}
    )
    ffn_hidden: int | None = field(
        default=None,
        metadata={
            "help": "MLP width (a gated MLP's gate and up each)",
            "flag": "ffn-hidden",
            "default_text": "the family's: 4·hidden for GPT-2, 8·hidden/3 rounded up to 256 "
            "for the Llama families",
        },
    )
    norm_eps: float = field(default=1e-5, metadata={"help": "RMSNorm epsilon", "cli": False})
    rope_theta: float = field(
        default=10000.0, metadata={"help": "rotary base frequency", "cli": False}
    )
    rope_scaling: RopeScaling | None = field(
        default=None,
        metadata={"help": "rotary scaling past the training length: llama3 or yarn", "cli": False},
    )
    qkv_bias: bool = field(default=False, metadata={"help": "biases on q, k and v (Qwen2)"})
    qk_norm: bool = field(
        default=False, metadata={"help": "RMSNorm over each head of q and k (Qwen3)"}
    )
    sliding_window: int | None = field(
        default=None,
        metadata={
            "help": "attention sees at most this many tokens back (Mistral); only sequences "
            "longer than it are masked",
        },
    )
    # Hugging Face's max_position_embeddings (GPT-2's n_positions: its position table's rows),
    # kept for export; None: seq_len
    max_positions: int | None = field(
        default=None, metadata={"help": "positions the model was made for", "cli": False}
    )
    # ---- mixture of experts (the qwen3_moe and mixtral families; None/off: a dense MLP) -----
    num_experts: int | None = field(
        default=None, metadata={"help": "experts in each sparse MLP layer", "cli": False}
    )
    experts_per_token: int | None = field(
        default=None, metadata={"help": "experts each token is routed to (top-k)", "cli": False}
    )
    moe_ffn_hidden: int | None = field(
        default=None, metadata={"help": "MLP width of one expert", "cli": False}
    )
    norm_topk_prob: bool = field(
        default=False,
        metadata={"help": "renormalise the top-k routing weights to sum to 1", "cli": False},
    )
    # Qwen3-MoE's: these layers keep a dense MLP (ffn_hidden wide); of the rest, layer i is
    # sparse when (i + 1) is a multiple of decoder_sparse_step (ModelConfig.moe_layers)
    mlp_only_layers: tuple[int, ...] = field(
        default=(), metadata={"help": "layers with a dense MLP", "cli": False}
    )
    decoder_sparse_step: int = field(
        default=1, metadata={"help": "every n-th layer is sparse", "cli": False}
    )
    router_aux_loss_coef: float = field(
        default=0.0,
        metadata={
            "help": "weight of the load-balancing loss added to the training loss (a mixture "
            "of experts; Hugging Face's router_aux_loss_coef, 0: not added)",
            "default_text": "config.json's router_aux_loss_coef where its output_router_logits "
            "is true, else 0",
        },
    )
    # config.json's router_aux_loss_coef where its output_router_logits is false (fitgpt then
    # trains without the aux loss: router_aux_loss_coef 0), kept for export as max_positions is,
    # so the exported folder balances as its source would where a user turns the loss on in
    # transformers (Mixtral-8x7B's 0.02, gpt-oss's 0.9); None: transformers' default
    hf_router_aux_loss_coef: float | None = field(
        default=None,
        metadata={"help": "config.json's router_aux_loss_coef, the aux loss off", "cli": False},
    )

    # ---- gpt-oss's (the gpt_oss family's own fields: OWN_FIELDS; unset elsewhere) ---------------
    # each layer's attention, one of LAYER_TYPES per layer; (): the family's own pattern
    # (gpt-oss: sliding in the even layers, full in the odd, as transformers' GptOssConfig)
    layer_types: tuple[str, ...] = field(
        default=(), metadata={"help": "each layer's attention kind", "cli": False}
    )
    # the experts' clamped SwiGLU: (clamp(up, ±limit) + 1) · g·sigmoid(alpha·g), g = min(gate, limit)
    swiglu_alpha: float | None = field(
        default=None, metadata={"help": "the clamped SwiGLU's sigmoid gain", "cli": False}
    )
    swiglu_limit: float | None = field(
        default=None, metadata={"help": "the clamped SwiGLU's clamp", "cli": False}
    )

    def __post_init__(self) -> None:
        # JSON (meta.json: a resume, --init-from a run) brings rope_scaling back as the dict
        # to_dict made of it: the dataclass again, hashable (the planner caches by config)
        if isinstance(self.rope_scaling, dict):
            object.__setattr__(self, "rope_scaling", RopeScaling(**self.rope_scaling))
        for name in ("n_layer", "n_embd", "n_head", "seq_len", "vocab_size"):
            if getattr(self, name) < 1:
                raise UserError(f"{name}={getattr(self, name)} must be a positive integer")
        for name in ("n_kv_head", "head_size", "ffn_hidden", "sliding_window", "max_positions"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise UserError(f"{name}={getattr(self, name)} must be a positive integer")
        if self.head_size is None and self.n_embd % self.n_head:
            raise UserError(
                f"hidden={self.n_embd} is not divisible by heads={self.n_head}; "
                "choose heads that divide the hidden size"
            )
        if self.n_head % self.kv_heads:
            raise UserError(
                f"--kv-heads {self.kv_heads} does not divide heads={self.n_head}; "
                "choose key/value heads that divide the head count"
            )
        if not 0.0 <= self.dropout < 1.0:
            raise UserError(f"dropout={self.dropout} must be in [0, 1)")
        if self.position not in ("learned", "alibi", "rope"):
            raise UserError(f"position={self.position!r}: use 'learned', 'alibi' or 'rope'")
        if self.position == "learned" and self.seq_len > self.positions:
            raise UserError(
                f"seq_len={self.seq_len} is past the learned position table's "
                f"{self.positions} rows; train at seq_len <= {self.positions}"
            )
        if self.init_std is not None and not 0 < self.init_std < 1:
            raise UserError(f"--init-std {self.init_std} must be in (0, 1), e.g. 0.02")
        if not (self.norm_eps > 0 and self.rope_theta > 0):
            raise UserError(
                f"norm_eps={self.norm_eps} and rope_theta={self.rope_theta} must be positive"
            )
        self._check_experts()
        self._check_own_fields()
        _family_of(self).check(self)

    def _check_own_fields(self) -> None:
        """OWN_FIELDS unset for a family whose Family.own_fields lacks them; layer_types one
        known kind per layer."""
        # JSON (meta.json) brings layer_types back as a list: one type for equality
        object.__setattr__(self, "layer_types", tuple(self.layer_types))
        own = _family_of(self).own_fields
        for name, off in OWN_FIELDS.items():
            if name not in own and getattr(self, name) != off:
                raise UserError(
                    f"{name}={getattr(self, name)!r}: the {self.family} family has no such "
                    "setting (gpt_oss has); drop it"
                )
        why = layer_types_problem(self.layer_types, self.n_layer)
        if why:
            raise UserError(f"layer_types {why}")

    def _check_experts(self) -> None:
        """The mixture-of-experts fields: all at their defaults for a dense model (num_experts
        None), consistent with each other for a sparse one. Which families have experts is
        theirs to say (Family.has_experts)."""
        # JSON (meta.json, config.json) brings the layers back as a list: one type for equality
        object.__setattr__(self, "mlp_only_layers", tuple(self.mlp_only_layers))
        if not self.router_aux_loss_coef >= 0:
            raise UserError(
                f"--router-aux-loss-coef {self.router_aux_loss_coef} must be >= 0 (0: off)"
            )
        has = _family_of(self).has_experts
        if self.num_experts is None:
            moe = {"experts_per_token": None, "moe_ffn_hidden": None, "norm_topk_prob": False,
                   "mlp_only_layers": (), "decoder_sparse_step": 1, "router_aux_loss_coef": 0.0,
                   "hf_router_aux_loss_coef": None}  # fmt: skip
            for name, off in moe.items():
                if getattr(self, name) != off:
                    raise UserError(
                        f"{name}={getattr(self, name)!r} is for a mixture of experts; the "
                        f"{self.family} model has none (num_experts is not set): drop it"
                    )
            if has:
                raise UserError(
                    f"the {self.family} family is a mixture of experts: set num_experts, "
                    "experts_per_token and moe_ffn_hidden"
                )
            return
        if not has:
            raise UserError(
                f"num_experts={self.num_experts}: the {self.family} family has a dense MLP; "
                "use qwen3_moe, mixtral or gpt_oss for a mixture of experts"
            )
        for name in ("num_experts", "experts_per_token", "moe_ffn_hidden", "decoder_sparse_step"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise UserError(f"{name}={v!r} must be a positive integer")
        if self.experts_per_token > self.num_experts:
            raise UserError(
                f"experts_per_token={self.experts_per_token} exceeds num_experts="
                f"{self.num_experts}: route each token to at most every expert"
            )
        bad = [i for i in self.mlp_only_layers if not 0 <= i < self.n_layer]
        if bad:
            raise UserError(
                f"mlp_only_layers holds {bad[0]}, not a layer of {self.n_layer} (0 to "
                f"{self.n_layer - 1})"
            )

    @property
    def moe_layers(self) -> tuple[int, ...]:
        """The layers whose MLP is a mixture of experts, as transformers' Qwen3-MoE decides:
        those not in mlp_only_layers whose (index + 1) is a multiple of decoder_sparse_step.
        () for a dense model."""
        if self.num_experts is None:
            return ()
        step, dense = self.decoder_sparse_step, set(self.mlp_only_layers)
        return tuple(i for i in range(self.n_layer) if i not in dense and (i + 1) % step == 0)

    def weight_std(self) -> float:
        """The standard deviation of every initial weight matrix and embedding (INIT_STD_MAX,
        small_init_std): --init-std if given, else by the width."""
        return self.init_std if self.init_std is not None else small_init_std(self.n_embd)

    def residual_std(self) -> float:
        """The residual projections' (attention and MLP outputs): weight_std / sqrt(2L), GPT-2's
        and Megatron's scaling, so the residual stream's variance does not grow with depth."""
        return self.weight_std() / math.sqrt(2 * self.n_layer)

    @property
    def head_dim(self) -> int:
        """D: head_size, or hidden / heads."""
        return self.head_size if self.head_size is not None else self.n_embd // self.n_head

    @property
    def positions(self) -> int:
        """Rows of a learned position table: max_positions where set (a GPT-2 folder's
        n_positions, kept when a fine-tune trains at a shorter seq_len, as transformers keeps
        the whole table), else seq_len."""
        return self.max_positions or self.seq_len

    @property
    def kv_heads(self) -> int:
        """K: the key/value heads (n_kv_head, or one per query head)."""
        return self.n_kv_head if self.n_kv_head is not None else self.n_head

    @property
    def ffn_width(self) -> int:
        """F: the MLP width, ffn_hidden or the family's default."""
        return (
            self.ffn_hidden if self.ffn_hidden is not None else _family_of(self).ffn_default(self)
        )

    @property
    def padded_vocab_size(self) -> int:
        return padded_vocab(self.vocab_size)

    def num_params(self) -> int:
        """Exact parameter count, equal to the built model's (the family's closed form)."""
        return _family_of(self).num_params(self)

    def flops_per_token(self, adapters: int | None = None) -> float:
        """Model FLOPs per trained token (model/family.py Family.flops_per_token): for GPT-2
        6·N + 12·L·h·S, recompute not counted; with `adapters` LoRA elements trained on the
        frozen model, 4·N + 6 per adapter element + 12·L·h·S. The attention term counts QK^T
        and AV for the full S×S square, as the ANCHORS protocol does, so figures compare with
        the peers'. A run's count: train/config.py RunConfig.flops_per_token."""
        return _family_of(self).flops_per_token(self, adapters)

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> ModelConfig:
        known = {f for f in cls.__dataclass_fields__}
        unknown = set(d) - known
        if unknown:
            raise UserError(f"model config has unknown fields {sorted(unknown)}")
        # fields missing (a meta.json written before they existed) take their defaults
        return cls(**d)

    def replace(self, **changes) -> ModelConfig:
        return replace(self, **changes)
