"""gpt-oss as model/family.py describes a family: a mixture of experts in every layer
(../qwen3_moe/family.py MoeCounts: parameters by the total, FLOPs by the active ones) with
biases on the attention's four projections, the router and the experts, a sink per head, and
its own fields (layer_types, swiglu_alpha, swiglu_limit)."""

from __future__ import annotations

from typing import TYPE_CHECKING, ClassVar

from fitgpt.errors import UserError
from fitgpt.model.families.gpt_oss.model import GptOss, layer_kinds, layer_windows
from fitgpt.model.families.llama.family import LlamaFamily
from fitgpt.model.families.qwen3_moe.family import MoeCounts
from fitgpt.model.family import Split

if TYPE_CHECKING:
    from fitgpt.model.config import ModelConfig


class GptOssFamily(MoeCounts):
    """gpt-oss (transformers' GptOssForCausalLM). Tensor parallelism is refused (MoeCounts:
    the experts are not split); the splits are Llama's, o's bias replicated."""

    name = "gpt_oss"
    model = GptOss
    splits: ClassVar[dict[str, Split]] = dict(LlamaFamily.splits)
    has_qkv_bias = True  # attention_bias: q, k, v and o (SinkAttention)
    has_window = True
    own_fields = ("layer_types", "swiglu_alpha", "swiglu_limit")
    # packing.py's Packing makes no FlexAttention mask for it: the sinks make their own
    # (model.py SinkMasks: FlexAttention with its log-sum-exp on CUDA, SDPA's mask elsewhere)
    flex_attention = False
    attention_sinks = True
    # SinkAttention takes its sequence length from its input and keeps every head's sink: the
    # head split's all-to-all hands it the whole sequence of 1/C of the heads
    no_context_parallel = "gpt-oss's attention sinks are not split by heads yet"
    # its sinks' FlexAttention (model.py flex_sink_attention: the kernel with its log-sum-exp,
    # then y·σ(L − sink)) at 64 heads of 64, timed alone on an H200 forward + backward at
    # 4 × 4,096 tokens (results/moe_sink_h200_2026-11-28 sink.json): 8.00 ms a full layer and
    # 2.43 ms a sliding one (window 128), against 4.24 and 0.51 ms priced for the blocks they
    # score (plan/throughput.py flex_keys) at the H200's default attention rate and the curve's
    # share at width 2880: 10.44 ms a pair of layers, as the presets alternate them, over
    # 4.75 priced. (Alone, 1.89 a full layer and 4.8 a sliding one: its fixed work per query
    # block, the sinks' pass and the mask's bookkeeping, weighs more where the window is short.)
    attention_time: ClassVar[float] = 2.20

    def check(self, cfg: ModelConfig) -> None:
        super().check(cfg)
        topk = "gpt-oss's routing weights are a softmax over the top k logits (they sum to 1)"
        self.check_every_layer_sparse(cfg, "gpt-oss", topk)
        for name in ("swiglu_alpha", "swiglu_limit"):
            v = getattr(cfg, name)
            if not isinstance(v, int | float) or isinstance(v, bool) or not v > 0:
                raise UserError(
                    f"{name}={v!r}: gpt-oss's clamped SwiGLU needs a positive number "
                    "(the published models: swiglu_alpha 1.702, swiglu_limit 7.0)"
                )
        if cfg.sliding_window is None and "sliding_attention" in layer_kinds(cfg):
            raise UserError(
                "layer_types has sliding_attention layers but sliding_window is not set: "
                "set it (the published models: 128)"
            )

    # the clamped SwiGLU keeps more per (token, expert) than SwiGLU: gate and up with their
    # bias (2F'), the clamped gate and up, σ(α·g), g·σ, up + 1 and the product (6F' in all of
    # these; measured, tests/test_moe_memory.py)
    expert_saved: ClassVar[int] = 7

    def route_saved(self, cfg: ModelConfig) -> int:
        """The router's probabilities (E) and logits' top k, no renormalising sum (measured)."""
        return cfg.num_experts + 6 * cfg.experts_per_token

    def layer_windows(self, cfg: ModelConfig) -> tuple[int | None, ...]:
        return layer_windows(cfg)

    def block_activations(self, cfg: ModelConfig) -> tuple[int, int]:
        """MoeCounts', with what the sinks' FlexAttention path adds on CUDA (model.py
        flex_sink_attention): the attention output scaled by σ(L − sink), a second N·D the
        output projection reads, and the factor itself (N per token)."""
        whole, cut = super().block_activations(cfg)
        return whole, cut + cfg.n_head * cfg.head_dim + cfg.n_head

    def sparse_mlp(self, cfg: ModelConfig, experts: int) -> int:
        """One layer's router (E·H + E) and `experts` experts, each H·2F + 2F + F·H + H."""
        return cfg.num_experts * (cfg.n_embd + 1) + experts * self.expert(cfg)

    def expert(self, cfg: ModelConfig) -> int:
        """One expert's parameters: gate_up and its bias, down and its bias."""
        H, F_ = cfg.n_embd, cfg.moe_ffn_hidden
        return 3 * H * F_ + 2 * F_ + H

    def num_params(self, cfg: ModelConfig) -> int:
        """Exact, equal to the built model's and to transformers' (tests/test_gpt_oss.py): per
        block two norms (2H), q, k, v and o with their biases (2·N·D·H + 2·K·D·H + N·D + 2·K·D
        + H), the sinks (N) and the sparse MLP; the embedding, the final norm, the head."""
        H, N, K, D = cfg.n_embd, cfg.n_head, cfg.kv_heads, cfg.head_dim
        attn = 2 * N * D * H + 2 * K * D * H + N
        if cfg.qkv_bias:
            attn += N * D + 2 * K * D + H
        per_block = 2 * H + attn + self.sparse_mlp(cfg, cfg.num_experts)
        V = cfg.padded_vocab_size
        return cfg.n_layer * per_block + V * H + H + (0 if cfg.tie_embeddings else V * H)

    def active_params(self, cfg: ModelConfig) -> int:
        """The total less the E - k experts of each layer a token does not go to. (The
        published active counts, 3.6 B and 5.1 B, leave the input embedding out: this less
        V·H.)"""
        idle = cfg.num_experts - cfg.experts_per_token
        return self.num_params(cfg) - cfg.n_layer * idle * self.expert(cfg)


FAMILY = GptOssFamily()
GptOss.family = FAMILY
