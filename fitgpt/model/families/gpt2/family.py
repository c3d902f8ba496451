"""GPT-2 as model/family.py describes a family: how tensor parallelism cuts it, what it counts
(parameters, FLOPs, activations) and the config fields it refuses."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, ClassVar

from fitgpt.errors import UserError
from fitgpt.model.families.gpt2.model import ALIBI_BIAS_MAX_BYTES, GPT
from fitgpt.model.family import Family, Split

if TYPE_CHECKING:
    from fitgpt.model.config import ModelConfig


class GPT2Family(Family):
    """GPT-2 as model/family.py describes a family; Megatron-LM's tensor-parallel split of it
    (Shoeybi et al. 2019): attn.qkv and mlp.fc column-parallel (q, k and v cut on their own, so
    every rank keeps whole heads), attn.proj and mlp.proj row-parallel (their biases replicated,
    added once after the all-reduce), the embedding and an untied head by vocabulary rows."""

    name = "gpt2"
    model = GPT
    splits: ClassVar[dict[str, Split]] = {
        "attn.qkv.weight": Split(0, 3),
        "attn.qkv.bias": Split(0, 3),
        "mlp.fc.weight": Split(0),
        "mlp.fc.bias": Split(0),
        "attn.proj.weight": Split(1),
        "mlp.proj.weight": Split(1),
        "wte.weight": Split(0),
        "lm_head.weight": Split(0),
    }

    def check(self, cfg: ModelConfig) -> None:
        """GPT-2 has one key/value head per head, hidden/heads per head, a 4·hidden MLP and
        learned or ALiBi positions: the Llama families' fields are refused."""
        wrong = [
            (cfg.position == "rope", "position='rope'", "use learned or alibi"),
            (cfg.kv_heads != cfg.n_head, f"--kv-heads {cfg.kv_heads}", f"use {cfg.n_head}"),
            (
                cfg.head_size not in (None, cfg.n_embd // cfg.n_head),
                f"head_size={cfg.head_size}",
                "leave it unset (hidden/heads)",
            ),
            (
                cfg.ffn_hidden not in (None, 4 * cfg.n_embd),
                f"--ffn-hidden {cfg.ffn_hidden}",
                f"GPT-2's MLP is 4·hidden = {4 * cfg.n_embd}",
            ),
            (cfg.qkv_bias, "--qkv-bias", "--bias sets GPT-2's biases"),
            (cfg.qk_norm, "--qk-norm", "drop it"),
            (cfg.sliding_window is not None, "--sliding-window", "drop it"),
            (cfg.rope_scaling is not None, "rope_scaling", "drop it"),
        ]
        for bad, what, fix in wrong:
            if bad:
                raise UserError(f"{what}: the gpt2 family does not have it ({fix})")
        bias = 6 * cfg.n_head * cfg.seq_len**2  # bytes: fp32, and its bf16 copy per block
        if cfg.position == "alibi" and bias > ALIBI_BIAS_MAX_BYTES:
            most = math.isqrt(ALIBI_BIAS_MAX_BYTES // (6 * cfg.n_head))
            raise UserError(
                f"position='alibi' at seq_len={cfg.seq_len}: ALiBi's [{cfg.n_head}, S, S] bias "
                f"takes {bias / 2**30:.0f} GiB, past {ALIBI_BIAS_MAX_BYTES // 2**30} GiB; use "
                f"seq_len <= {most} or learned positions"
            )

    def tp_sizes(self, cfg: ModelConfig) -> list[tuple[int, str]]:
        return [
            (cfg.n_head, "the head count (--heads)"),
            (4 * cfg.n_embd, "the MLP width 4·--hidden"),
            (cfg.padded_vocab_size, "the padded vocabulary"),
        ]

    def num_params(self, cfg: ModelConfig) -> int:
        """Exact, equal to GPT.num_params() (checked by the tests). Default options:
        12·L·h² + 13·L·h + (V+S)·h + 2h, V the padded vocabulary, S the position table's rows
        (cfg.positions: seq_len, or a folder's n_positions past it).
        - bias=False drops every linear bias and LayerNorm bias: 12·L·h² + 2·L·h + (V+S)·h + h.
        - position='alibi' drops the position table: minus S·h.
        - embed_norm=True adds one LayerNorm: plus 2h (plus h without bias).
        - tie_embeddings=False adds the output head: plus V·h.
        """
        h, L, V = cfg.n_embd, cfg.n_layer, cfg.padded_vocab_size
        ln = 2 * h if cfg.bias else h
        per_block = 12 * h * h + (9 * h if cfg.bias else 0) + 2 * ln
        n = L * per_block + V * h + ln
        if cfg.position == "learned":
            n += cfg.positions * h
        if cfg.embed_norm:
            n += ln
        if not cfg.tie_embeddings:
            n += V * h
        return n

    def block_activations(self, cfg: ModelConfig) -> tuple[int, int]:
        """17·h per token: the LayerNorms' inputs and outputs (4h, left whole by TP); q, k, v
        (3h), the attention output and its re-laid copy (2h), the MLP's fc and GELU outputs
        (8h): 13h cut by heads and MLP columns."""
        return 4 * cfg.n_embd, 13 * cfg.n_embd

    def mlp_activations(self, cfg: ModelConfig) -> tuple[int, int]:
        """Saved whole: fc's and GELU's outputs (8h, block_activations' MLP part). A piece's
        backward at its peak (measured, tests/test_long.py): 11h, the recomputed fc output and
        GELU's gradients beside it."""
        return 8 * cfg.n_embd, 11 * cfg.n_embd


FAMILY = GPT2Family()
GPT.family = FAMILY  # a GPT made directly, not by build_model, knows its family too
