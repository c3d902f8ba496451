"""Llama 3 as model/family.py describes a family: how tensor parallelism cuts it, what it
counts (parameters, FLOPs, activations) and the config fields it refuses. The qwen2, qwen3 and
mistral folders subclass LlamaFamily, allowing one field each."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, ClassVar

from fitgpt.errors import UserError
from fitgpt.model.families.llama.model import Llama
from fitgpt.model.family import Family, Split

if TYPE_CHECKING:
    from fitgpt.model.config import ModelConfig


class LlamaFamily(Family):
    """Llama 3 as model/family.py describes a family. Tensor parallelism (Megatron-LM's split):
    q, kv (k and v cut on their own: whole key/value heads per rank) and mlp.fc (gate and up
    on their own) column-parallel, the two proj row-parallel, the embedding and an untied head
    by vocabulary rows; the norms replicated (q_norm and k_norm serve every head: their
    gradients are summed over the ranks, parallel/layers.py). Qwen2, Qwen3 and Mistral are this
    family with one field each allowed (the class attributes below; their folders subclass
    it)."""

    name = "llama"
    model = Llama
    splits: ClassVar[dict[str, Split]] = {
        "attn.q.weight": Split(0),
        "attn.q.bias": Split(0),
        "attn.kv.weight": Split(0, 2),
        "attn.kv.bias": Split(0, 2),
        "mlp.fc.weight": Split(0, 2),
        "attn.proj.weight": Split(1),
        "mlp.proj.weight": Split(1),
        "wte.weight": Split(0),
        "lm_head.weight": Split(0),
    }
    head_shared = ("attn.q_norm.weight", "attn.k_norm.weight")
    # rotary's multiplies and concatenations, SwiGLU's silu and product are fused: a whole
    # Llama-3.1-8B step (micro-batch 4 x 4096, 8 of 32 blocks offloaded) took 7.46 s compiled
    # against 8.00 s eager on an H100 (results/llama_speed_h100_2026-11-27)
    compiled_checkpointed: ClassVar[float] = 0.933
    # rotary on q and k, SwiGLU's silu and product over F = 3.5h, RMSNorm, residual adds: ~1.5 s
    # of an 8.0 s Llama-3.1-8B step in the profile beside 5.8 s of matmuls (which the curve
    # prices at 5.84). The same step's measured time needs 1.198 (eager, 7.93-8.04 s) and
    # 1.189 (compiled, 7.40-7.48 s, after the 0.933 above) of the matmul term, H100,
    # results/llama_speed_h100_2026-11-27: the mean of the two
    matmul_time: ClassVar[float] = 1.19
    # what the Hugging Face class of the family has: the config must say the same
    has_qkv_bias: ClassVar[bool] = False  # always (Qwen2) or never
    has_qk_norm: ClassVar[bool] = False  # always (Qwen3) or never
    has_window: ClassVar[bool] = False  # may have a sliding window (Mistral)

    def check(self, cfg: ModelConfig) -> None:
        n = self.name
        if cfg.position != "rope":
            raise UserError(f"position={cfg.position!r}: the {n} family uses rotary positions")
        if cfg.bias:
            raise UserError(f"bias=True: the {n} family has no biases in its linears or norms")
        if cfg.embed_norm:
            raise UserError(f"embed_norm=True: the {n} family has no norm after the embedding")
        if cfg.head_dim % 2:
            raise UserError(f"head dimension {cfg.head_dim} must be even for rotary positions")
        if cfg.qkv_bias != self.has_qkv_bias:
            say = "always has" if self.has_qkv_bias else "has no"
            raise UserError(f"qkv_bias={cfg.qkv_bias}: the {n} family {say} q/k/v biases")
        if cfg.qk_norm != self.has_qk_norm:
            say = "always normalises" if self.has_qk_norm else "does not normalise"
            raise UserError(f"qk_norm={cfg.qk_norm}: the {n} family {say} q and k per head")
        if cfg.sliding_window is not None and not self.has_window:
            raise UserError(
                f"sliding_window={cfg.sliding_window}: the {n} family has no sliding window "
                "(mistral has); drop it"
            )

    def ffn_default(self, cfg: ModelConfig) -> int:
        """Llama's rule: two thirds of 4·hidden (the gate makes three matrices of it), rounded
        up to a multiple of 256."""
        return 256 * math.ceil(int(8 * cfg.n_embd / 3) / 256)

    def tp_sizes(self, cfg: ModelConfig) -> list[tuple[int, str]]:
        return [
            (cfg.n_head, "the head count (--heads)"),
            (cfg.kv_heads, "the key/value heads (--kv-heads)"),
            (cfg.ffn_width, "the MLP width (--ffn-hidden)"),
            (cfg.padded_vocab_size, "the padded vocabulary"),
        ]

    def num_params(self, cfg: ModelConfig) -> int:
        """Exact, equal to Llama.num_params() (checked by the tests): per block two norms (2H),
        q (N·D·H), kv (2·K·D·H), proj (H·N·D) and the MLP (3·F·H), with qkv_bias N·D + 2·K·D
        more and qk_norm 2·D; then the embedding V·H, the final norm H, and an untied head V·H."""
        H, N, K, D, F = cfg.n_embd, cfg.n_head, cfg.kv_heads, cfg.head_dim, cfg.ffn_width
        per_block = 2 * H + 2 * N * D * H + 2 * K * D * H + 3 * F * H
        if cfg.qkv_bias:
            per_block += N * D + 2 * K * D
        if cfg.qk_norm:
            per_block += 2 * D
        V = cfg.padded_vocab_size
        return cfg.n_layer * per_block + V * H + H + (0 if cfg.tie_embeddings else V * H)

    def matmul_params(self, cfg: ModelConfig) -> int:
        """Every active parameter but the input embedding when the head has its own (a lookup
        multiplies nothing; a tied one is counted as the head's)."""
        n = self.active_params(cfg)
        return n if cfg.tie_embeddings else n - cfg.padded_vocab_size * cfg.n_embd

    def attention_flops(self, cfg: ModelConfig) -> float:
        """QK^T and AV over the full S×S square, by the heads' width: 12·L·N·D·S."""
        return 12.0 * cfg.n_layer * cfg.n_head * cfg.head_dim * cfg.seq_len

    def block_activations(self, cfg: ModelConfig) -> tuple[int, int]:
        """Left whole by TP, 4H: the two RMSNorms' inputs and outputs (a fused RMSNorm keeps
        its input and per-token statistics; CPU's decomposed one keeps one H more). Cut by it,
        as measured on the CPU (tests/test_llama.py): q and k after the rotation (N·D + K·D),
        v, a view that holds kv's whole output (2·K·D), and attention's output, which proj
        reads as a view (N·D; GPT-2's count has a re-laid copy of it too); the MLP's gate and
        up (2F), silu(gate) and the product proj reads (2F); with qk_norm q before its norm
        (N·D; k's is the kv output already held). Flash attention: no S² term."""
        N, K, D, F = cfg.n_head, cfg.kv_heads, cfg.head_dim, cfg.ffn_width
        cut = 2 * N * D + 3 * K * D + 4 * F
        if cfg.qk_norm:
            cut += N * D
        return 4 * cfg.n_embd, cut

    def mlp_activations(self, cfg: ModelConfig) -> tuple[int, int]:
        """Saved whole: gate and up, silu(gate) and the product (4F, block_activations' MLP
        part). A piece's backward at its peak (measured, tests/test_long.py: 6F less H): the
        recomputed gate and up, their gradients' concatenation (2F) and the two gradients it
        is made of (2F)."""
        return 4 * cfg.ffn_width, 6 * cfg.ffn_width


FAMILY = LlamaFamily()
# a Llama made directly, not by build_model (which sets the config's family on the instance)
Llama.family = FAMILY
