"""GPT-2's Hugging Face name map: fitgpt's GPT (model.py) and Hugging Face's GPT2LMHeadModel
(model/hf_map.py says what a map is; interop/ reads and writes checkpoints through it).

The two compute the same function (pre-LayerNorm blocks, tanh GELU, learned positions, LayerNorm
eps 1e-5, attention scaled by 1/sqrt(head dim)); they differ in how they store it:

| fitgpt (model.py)                | HF GPT2LMHeadModel                      | layout                    |
|----------------------------------|-----------------------------------------|---------------------------|
| wte.weight [V_pad, H]            | transformer.wte.weight [V, H]           | rows cut / zero-padded    |
| wpe.weight [S, H]                | transformer.wpe.weight [n_positions, H] | S = n_positions           |
| blocks.i.ln_1/ln_2.{weight,bias} | transformer.h.i.ln_1/ln_2.*             | same                      |
| blocks.i.attn.qkv.weight [3H, H] | transformer.h.i.attn.c_attn.weight      | Conv1D stores [in, out]:  |
| blocks.i.attn.proj.weight        | transformer.h.i.attn.c_proj.weight      | transposed                |
| blocks.i.mlp.fc.weight [4H, H]   | transformer.h.i.mlp.c_fc.weight         | transposed                |
| blocks.i.mlp.proj.weight         | transformer.h.i.mlp.c_proj.weight       | transposed                |
| ln_f.*                           | transformer.ln_f.*                      | same                      |
| lm_head.weight (untied only)     | lm_head.weight (untied only)            | rows cut / zero-padded    |

V_pad is the vocabulary padded to a multiple of 128 (`padded_vocab`); HF holds exactly V rows.
The padded rows are no tokens (the model gives them -inf logits), so cutting them loses nothing
and zero-filling them on import adds nothing.

What HF GPT-2 cannot represent, and what we do about it:
- bias=False: HF GPT-2 always has biases. A model without biases equals one whose biases are
  zero, so export writes zero biases (exact). Import always gives bias=True.
- position='alibi' and embed_norm=True: no HF GPT-2 equivalent; refused.
- Activation: fitgpt uses torch's tanh GELU; export writes `gelu_pytorch_tanh`, the very same
  kernel (bit-identical). Import accepts every tanh approximation (`gelu_new`, the GPT-2 default,
  differs from it by float rounding only, 2.4e-7 at most); the erf GELU and others are refused.
- n_inner other than 4h, layer_norm_epsilon other than 1e-5, scale_attn_weights=false,
  scale_attn_by_inverse_layer_idx, cross-attention: refused on import.
- Dropout is a training choice, not part of the weights: import sets fitgpt's dropout to 0 (set
  --dropout when fine-tuning); export writes fitgpt's one dropout to HF's three.
"""

from __future__ import annotations

from fitgpt.errors import UserError
from fitgpt.model.config import ModelConfig
from fitgpt.model.hf_map import HFMapping, TensorMap, tied

# Every HF activation that computes 0.5·x·(1 + tanh(√(2/π)·(x + 0.044715·x³))).
TANH_GELUS = ("gelu_new", "gelu_pytorch_tanh", "gelu_python_tanh", "gelu_fast")
EXPORT_ACTIVATION = "gelu_pytorch_tanh"  # torch's own tanh GELU, the kernel fitgpt runs
LAYER_NORM_EPS = 1e-5  # torch's nn.LayerNorm default, which fitgpt uses


def _block_maps(i: int, bias: bool) -> list[TensorMap]:
    out = []
    for hf_mod, fit_mod, transpose in (
        ("ln_1", "ln_1", False),
        ("attn.c_attn", "attn.qkv", True),
        ("attn.c_proj", "attn.proj", True),
        ("ln_2", "ln_2", False),
        ("mlp.c_fc", "mlp.fc", True),
        ("mlp.c_proj", "mlp.proj", True),
    ):
        hf, fit = f"transformer.h.{i}.{hf_mod}", f"blocks.{i}.{fit_mod}"
        out.append(TensorMap(f"{hf}.weight", f"{fit}.weight", transpose))
        out.append(TensorMap(f"{hf}.bias", f"{fit}.bias" if bias else None))
    return out


def _int_field(hf: dict, key: str, source: str) -> int:
    v = hf.get(key)
    if not isinstance(v, int) or isinstance(v, bool) or v < 1:
        raise UserError(f"{source}: {key}={v!r} must be a positive integer; is this GPT-2's?")
    return v


def _refuse_unsupported(hf: dict, source: str) -> None:
    act = hf.get("activation_function", "gelu_new")
    if act not in TANH_GELUS:
        raise UserError(
            f"{source}: activation_function={act!r}; fitgpt's MLP is the tanh GELU "
            f"({', '.join(TANH_GELUS)}), other activations cannot be imported"
        )
    eps = hf.get("layer_norm_epsilon", LAYER_NORM_EPS)
    if eps != LAYER_NORM_EPS:
        raise UserError(f"{source}: layer_norm_epsilon={eps}; fitgpt's LayerNorms use 1e-05")
    n_inner, n_embd = hf.get("n_inner"), _int_field(hf, "n_embd", source)
    if n_inner is not None and n_inner != 4 * n_embd:
        raise UserError(f"{source}: n_inner={n_inner}; fitgpt's MLP is 4 x n_embd={4 * n_embd}")
    for key, ok in (
        ("scale_attn_weights", True),
        ("scale_attn_by_inverse_layer_idx", False),
        ("add_cross_attention", False),
    ):
        if hf.get(key, ok) != ok:
            raise UserError(f"{source}: {key}={hf[key]} has no fitgpt equivalent; cannot import")


class GPT2Mapping(HFMapping):
    layers_key = "n_layer"
    import_format = "hf-gpt2"
    # import reads every tanh GELU as the one fitgpt runs; export names that very kernel
    owned = ("activation_function",)

    def architecture(self, cfg: ModelConfig) -> str:
        return "GPT2LMHeadModel"

    def canonical(self, key: str) -> str | None:
        """GPT2LMHeadModel's spelling; None for buffers (attn.bias, masked_bias). Checkpoints
        saved from GPT2Model (openai-community/gpt2's own) lack the `transformer.` prefix; both
        spellings name the same tensor."""
        if key.endswith(("attn.bias", "attn.masked_bias")) and ".c_attn" not in key:
            return None
        if key.startswith(("transformer.", "lm_head.")):
            return key
        if key.startswith(("h.", "wte.", "wpe.", "ln_f.")):
            return "transformer." + key
        return None

    def layer_of(self, name: str) -> int | None:
        parts = name.split(".")
        return int(parts[2]) if parts[1:2] == ["h"] else None

    def tensor_maps(self, cfg: ModelConfig) -> list[TensorMap]:
        """Every tensor of the HF model for `cfg`, in HF's order (embeddings, blocks, head)."""
        self.check_exportable(cfg)
        maps = [
            TensorMap("transformer.wte.weight", "wte.weight", vocab_rows=True),
            TensorMap("transformer.wpe.weight", "wpe.weight"),
        ]
        for i in range(cfg.n_layer):
            maps += _block_maps(i, cfg.bias)
        maps.append(TensorMap("transformer.ln_f.weight", "ln_f.weight"))
        maps.append(TensorMap("transformer.ln_f.bias", "ln_f.bias" if cfg.bias else None))
        if not cfg.tie_embeddings:
            maps.append(TensorMap("lm_head.weight", "lm_head.weight", vocab_rows=True))
        return maps

    def check_exportable(self, cfg: ModelConfig) -> None:
        if cfg.position != "learned":
            raise UserError(
                f"position={cfg.position!r}: HF GPT-2 has learned positions only; a model "
                "trained with --position alibi cannot be exported as GPT-2"
            )
        if cfg.embed_norm:
            raise UserError(
                "embed_norm=True: HF GPT-2 has no LayerNorm after the embedding; a model "
                "trained with --embed-norm cannot be exported as GPT-2"
            )

    def config_from_hf(self, hf: dict, source: str) -> ModelConfig:
        _refuse_unsupported(hf, source)
        return ModelConfig(
            n_layer=_int_field(hf, "n_layer", source),
            n_embd=_int_field(hf, "n_embd", source),
            n_head=_int_field(hf, "n_head", source),
            seq_len=_int_field(hf, "n_positions", source),
            max_positions=_int_field(hf, "n_positions", source),  # the table, if seq_len shrinks
            vocab_size=_int_field(hf, "vocab_size", source),
            bias=True,
            dropout=0.0,
            tie_embeddings=tied(hf, source, True),
        )

    def hf_config(self, cfg: ModelConfig, ids: dict) -> dict:
        """config.json of the GPT2LMHeadModel equal to fitgpt's `cfg`."""
        self.check_exportable(cfg)
        return {
            "architectures": ["GPT2LMHeadModel"],
            "model_type": "gpt2",
            "vocab_size": cfg.vocab_size,
            "n_positions": cfg.positions,
            "n_embd": cfg.n_embd,
            "n_layer": cfg.n_layer,
            "n_head": cfg.n_head,
            "n_inner": None,
            "activation_function": EXPORT_ACTIVATION,
            "resid_pdrop": cfg.dropout,
            "embd_pdrop": cfg.dropout,
            "attn_pdrop": cfg.dropout,
            "layer_norm_epsilon": LAYER_NORM_EPS,
            "initializer_range": 0.02,
            "scale_attn_weights": True,
            "scale_attn_by_inverse_layer_idx": False,
            "reorder_and_upcast_attn": False,
            "add_cross_attention": False,
            "tie_word_embeddings": cfg.tie_embeddings,
            "use_cache": True,
            "bos_token_id": ids.get("bos_token_id"),
            "eos_token_id": ids.get("eos_token_id"),
            "pad_token_id": None,
            "dtype": "float32",
        }


MAPPING = GPT2Mapping()
