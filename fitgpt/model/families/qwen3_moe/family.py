"""Qwen3-MoE as model/family.py describes a family: the Qwen3 family's attention (q/k norms)
with a mixture of experts in the layers ModelConfig.moe_layers names. MoeCounts holds what any
mixture-of-experts Llama counts (the mixtral folder uses it too): parameters by the total,
FLOPs by the active ones (the k experts a token goes to), activations of a sparse layer."""

from __future__ import annotations

from typing import TYPE_CHECKING, ClassVar

from fitgpt.errors import UserError
from fitgpt.model.families.llama.family import LlamaFamily
from fitgpt.model.families.qwen3.family import Qwen3Family
from fitgpt.model.families.qwen3_moe.model import MoeLlama

if TYPE_CHECKING:
    from fitgpt.model.config import ModelConfig

# what tp_sizes puts first: no T > 1 divides it, so tensor parallelism is refused in one line
NO_EXPERT_TP = (1, "the experts (tensor parallelism does not split them yet: use 1)")


class MoeCounts(LlamaFamily):
    """A LlamaFamily whose sparse layers' MLP is E experts of width F' and a router (E·H):
    3·F'·H per expert instead of the dense 3·F·H."""

    has_experts = True
    # the sparse layers' matmuls are grouped GEMMs over sorted tokens, with the routing around
    # them (softmax, top-k, the sort, the gather, the weighted scatter-add back): one whole
    # SparseMoe layer ran at 248 TFLOP/s forward + backward where its grouped matmuls alone ran
    # at 493 (H200, results/moe_h200_2026-11-28 grouped.json). Qwen3-30B-A3B's shape at 6 and 8
    # layers took 0.706 and 0.904 s a step against 0.53 and 0.68 priced at Llama's 1.19 (same
    # results): 1.66 of the matmul term prices both within 5%. Calibrated on Qwen3-MoE; Mixtral
    # and gpt-oss take it untimed (their experts are fewer and wider, or clamped and biased)
    matmul_time: ClassVar[float] = 1.66

    def tp_sizes(self, cfg: ModelConfig) -> list[tuple[int, str]]:
        return [NO_EXPERT_TP, *super().tp_sizes(cfg)]

    def check_every_layer_sparse(self, cfg: ModelConfig, who: str, topk: str) -> None:
        """Refuse, in one line, a config of a family whose routing weights always sum to 1
        (`topk`: how the family makes them) and whose every layer is sparse (Mixtral, gpt-oss)
        saying otherwise."""
        if cfg.num_experts is None:
            return  # ModelConfig refuses that, naming the fields to set
        if not cfg.norm_topk_prob:
            raise UserError(f"norm_topk_prob=False: {topk}; set it")
        if cfg.mlp_only_layers or cfg.decoder_sparse_step != 1:
            raise UserError(
                f"mlp_only_layers={list(cfg.mlp_only_layers)}, decoder_sparse_step="
                f"{cfg.decoder_sparse_step}: every {who} layer is sparse"
            )

    def sparse_mlp(self, cfg: ModelConfig, experts: int) -> int:
        """Parameters of one sparse MLP with `experts` experts: the router and theirs."""
        return cfg.num_experts * cfg.n_embd + experts * 3 * cfg.moe_ffn_hidden * cfg.n_embd

    def num_params(self, cfg: ModelConfig) -> int:
        """Exact, the total (every expert), equal to the built model's and to transformers'
        (tests/test_moe.py): Llama's count with each sparse layer's dense MLP (3·F·H) replaced
        by the router (E·H) and E experts (3·F'·H each)."""
        dense = 3 * cfg.ffn_width * cfg.n_embd
        sparse = len(cfg.moe_layers)
        return super().num_params(cfg) + sparse * (self.sparse_mlp(cfg, cfg.num_experts) - dense)

    def active_params(self, cfg: ModelConfig) -> int:
        """The parameters one token computes with: the k experts it is routed to of each sparse
        layer (and the whole router), everything else."""
        moe = cfg.num_experts - cfg.experts_per_token
        return (
            self.num_params(cfg) - len(cfg.moe_layers) * moe * 3 * cfg.moe_ffn_hidden * cfg.n_embd
        )

    # elements one (token, expert) assignment saves per unit of expert width F' inside its
    # expert: SwiGLU's gate and up (2F'), silu(gate) and the product (2F')
    expert_saved: ClassVar[int] = 4

    def route_saved(self, cfg: ModelConfig) -> int:
        """What the routing saves per token, in elements of their own dtype: the router's
        probabilities (E), the top-k weights, their sum, the indexes and the sorted rows'
        (measured, tests/test_moe_memory.py)."""
        return cfg.num_experts + 1 + 5 * cfg.experts_per_token

    def block_activations(self, cfg: ModelConfig) -> tuple[int, int]:
        """A sparse block's (the larger of the two kinds, priced for every block): Llama's
        attention part, then per token the routing's (route_saved), its k gathered copies of
        the input (k·H), each copy's expert intermediates (expert_saved·k·F'), the expert
        outputs before their weighting and after it (the scatter-add back keeps its source:
        2·k·H). Measured on the CPU, saved tensor by saved tensor (tests/test_moe_memory.py);
        before, the weighted outputs were not counted (gpt-oss-20b at 4 × 4,096 tokens ran out
        of an H200 its plan filled: results/moe_h200_2026-11-28)."""
        whole, cut = super().block_activations(cfg)
        k, H, Fe = cfg.experts_per_token, cfg.n_embd, cfg.moe_ffn_hidden
        cut += -4 * cfg.ffn_width + self.route_saved(cfg) + 3 * k * H
        return whole, cut + self.expert_saved * k * Fe

    def mlp_backward_bytes(self, cfg: ModelConfig, tokens: int, w: int) -> int:
        """A sparse MLP's backward beside its saved set: the gradients of the expert rows (the
        outputs' and the inputs', 2·k·H; the intermediates', 4·k·F' at their widest) for
        `tokens` tokens, and one expert matrix's gradient for all E experts, made whole by the
        grouped matmul's backward before it is added to the chunk's gradient (E·2F'·H)."""
        k, H, Fe, E = cfg.experts_per_token, cfg.n_embd, cfg.moe_ffn_hidden, cfg.num_experts
        return ((2 * k * H + 4 * k * Fe) * tokens + E * 2 * Fe * H) * w

    def mlp_activations(self, cfg: ModelConfig) -> tuple[int, int]:
        """The sparse MLP never runs a piece of tokens at a time (model/pieces.py)."""
        return 0, 0


class Qwen3MoeFamily(MoeCounts, Qwen3Family):
    """Qwen3-MoE: q/k norms (Qwen3's), a sliding window in every layer where config.json's
    use_sliding_window sets one (as transformers' Qwen3MoeModel), dense layers where
    mlp_only_layers / decoder_sparse_step say."""

    name = "qwen3_moe"
    model = MoeLlama
    has_window = True


FAMILY = Qwen3MoeFamily()
MoeLlama.family = FAMILY
