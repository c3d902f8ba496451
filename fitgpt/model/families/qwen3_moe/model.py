"""A mixture-of-experts Llama: the Llama network (../llama/model.py: its attention and blocks,
reused as they are) with a sparse MLP in the layers ModelConfig.moe_layers names, the others
keeping the dense SwiGLU. Qwen3-MoE is this network with q/k norms; Mixtral (../mixtral/)
with a sliding window and fp32 routing weights.

The sparse MLP computes what transformers' Qwen3MoeSparseMoeBlock and MixtralSparseMoeBlock
compute in training (transformers 5.23):
  router   logits = x·Wr^T [N, E]; p = softmax(logits) in fp32; the top k of p (torch.topk's
           order), divided by their sum when norm_topk_prob; Qwen3-MoE casts them back to the
           logits' dtype, Mixtral keeps them fp32 (fp32_scores).
  experts  expert e is a SwiGLU: down_e(silu(gate_e x) · up_e x); each token's output is the sum
           over its k experts of weight · expert(x), no token dropped (dropless: every expert
           takes all the tokens routed to it).
  aux loss Switch Transformer's load balance over the sparse layers, as transformers'
           load_balancing_loss_func: E · Σ_e (assignments to e / rows) · (mean p_e), both summed
           over the layers before the product, over every token of the forward (the targets'
           -1 play no part); added to the loss times router_aux_loss_coef (MoeLlama.forward).
           A training step adds each micro-batch's at the same weight, whatever its counted
           targets: the mean over micro-batches and ranks (engine/base.py step_share).

The experts are computed over tokens sorted by expert (Experts.forward): one argsort, one
gather of the inputs, one matmul per expert over its contiguous slice (or one grouped GEMM on a
GPU that has it), one index_add back. No loop over tokens.

Parameters (E experts, F the expert width, H hidden): `mlp.router.weight` [E, H];
`mlp.experts.fc` [E·2F, H], expert e's gate rows then its up rows (a view [E, 2F, H], the layout
of transformers' fused experts.gate_up_proj); `mlp.experts.proj` [E·H, F] (a view [E, H, F], its
experts.down_proj). Two-dimensional, so a Hugging Face expert's tensor is one block of rows of
them (hf.py).

Shape legend: B batch, T tokens, N = B·T tokens, H hidden, E experts, K experts per token,
M = N·K (token, expert) assignments, F one expert's MLP width.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, ClassVar

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from fitgpt.model.families.llama.model import Llama, LlamaBlock
from fitgpt.model.loss import compute_dtype

if TYPE_CHECKING:
    from fitgpt.model.config import ModelConfig


def grouped_gemm_ok(x: Tensor, w: Tensor) -> bool:
    """torch._grouped_mm (one kernel for every expert's matmul, offsets on the device: no host
    sync) serves bf16 operands on a CUDA GPU of compute capability 9.0 or more (H100), with
    rows 16-byte aligned. Anything else takes the per-expert matmuls: fp32 and fp16 (the
    kernel refuses them), autocast (weights fp32 beside bf16 inputs; F.linear casts, the
    grouped kernel does not), the CPU, older GPUs. Not yet timed on a GPU (issue 50)."""
    return (
        hasattr(torch, "_grouped_mm")
        and x.is_cuda
        and x.dtype == w.dtype == torch.bfloat16
        and torch.cuda.get_device_capability(x.device) >= (9, 0)
        and x.shape[-1] % 8 == 0
        and w.shape[-2] % 8 == 0
    )


def expert_matmul(x_MI: Tensor, w_EOI: Tensor, count_E: Tensor, grouped: bool) -> Tensor:
    """[M, O]: row m of x_MI times expert e's w_EOI[e]^T, rows grouped by expert (count_E[e]
    rows of expert e, in order). `grouped`: one torch._grouped_mm (grouped_gemm_ok), else the
    per-expert matmuls of the custom op expert_mm."""
    if grouped:
        offs = count_E.cumsum(0).to(torch.int32)  # on the device: no host sync
        return torch._grouped_mm(x_MI, w_EOI.transpose(-2, -1), offs=offs)
    dtype = compute_dtype(x_MI)  # autocast's cast, made here: the custom op is opaque to it
    return expert_mm(x_MI.to(dtype), w_EOI.to(dtype), count_E)


# The per-expert matmuls (one F.linear per expert over its contiguous rows) and their backward
# as custom ops, registered at import (registering inside a compiled region breaks its graph).
# Their slices need the groups' bounds on the host, a sync (free on a CPU; a GPU without the
# grouped kernel pays it once per op). Inside an op the compiler sees one opaque call of known
# output shape, so a compiled block holds a sparse layer whole, where the bounds read in
# Python broke the graph at every sparse layer (torch._dynamo.explain on one block: 6 breaks,
# 0 now; tests/test_moe_paths.py counts them).
def _bounds(count_E: Tensor) -> list[tuple[int, int]]:
    ends = count_E.cumsum(0).tolist()  # host sync
    return list(zip([0, *ends[:-1]], ends, strict=True))


@torch.library.custom_op(
    "fitgpt::expert_mm", mutates_args=(), schema="(Tensor x, Tensor w, Tensor count) -> Tensor"
)
def expert_mm(x_MI: Tensor, w_EOI: Tensor, count_E: Tensor) -> Tensor:
    return torch.cat([F.linear(x_MI[a:b], w_EOI[e]) for e, (a, b) in enumerate(_bounds(count_E))])


@expert_mm.register_fake
def _(x_MI, w_EOI, count_E):
    return x_MI.new_empty(x_MI.shape[0], w_EOI.shape[1])


@torch.library.custom_op(
    "fitgpt::expert_mm_wgrad",
    mutates_args=(),
    schema="(Tensor dy, Tensor x, Tensor count) -> Tensor",
)
def expert_mm_wgrad(dy_MO: Tensor, x_MI: Tensor, count_E: Tensor) -> Tensor:
    """[E, O, I]: expert e's dy rows^T times its x rows (zeros for an expert with none)."""
    dw_EOI = dy_MO.new_zeros(count_E.shape[0], dy_MO.shape[1], x_MI.shape[1])
    for e, (a, b) in enumerate(_bounds(count_E)):
        if b > a:
            torch.mm(dy_MO[a:b].t(), x_MI[a:b], out=dw_EOI[e])
    return dw_EOI


@expert_mm_wgrad.register_fake
def _(dy_MO, x_MI, count_E):
    return dy_MO.new_empty(count_E.shape[0], dy_MO.shape[1], x_MI.shape[1])


def _expert_mm_context(ctx, inputs, output) -> None:
    ctx.save_for_backward(*inputs)  # x_MI, w_EOI, count_E: no copy (the rows F.linear kept)


def _expert_mm_backward(ctx, dy_MO: Tensor):
    x_MI, w_EOI, count_E = ctx.saved_tensors
    dy_MO = dy_MO.contiguous()  # a compiled graph may hand a strided one
    dx = expert_mm(dy_MO, w_EOI.transpose(1, 2), count_E) if ctx.needs_input_grad[0] else None
    dw = expert_mm_wgrad(dy_MO, x_MI, count_E) if ctx.needs_input_grad[1] else None
    return dx, dw, None


expert_mm.register_autograd(_expert_mm_backward, setup_context=_expert_mm_context)


def sort_by_expert(
    idx_NK: Tensor, n_experts: int, x_NH: Tensor, w_EOI: Tensor
) -> tuple[Tensor, Tensor, Tensor, bool]:
    """The assignments grouped by expert, token order kept within each: (order_M, the
    assignment m = n·K + k at each sorted place; token_M, its token; count_E, the rows of each
    expert; whether one grouped GEMM serves x_NH and the experts' weights w_EOI). No host
    sync."""
    flat_M = idx_NK.reshape(-1)
    order_M = flat_M.argsort(stable=True)
    token_M = order_M // idx_NK.shape[1]
    count_E = torch.zeros(n_experts, dtype=torch.int64, device=x_NH.device)
    count_E.scatter_add_(0, flat_M, torch.ones_like(flat_M))  # no host sync (bincount has one)
    return order_M, token_M, count_E, grouped_gemm_ok(x_NH, w_EOI)


class Experts(nn.Module):
    """E SwiGLU experts in two parameters (module docstring), run over sorted tokens."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        E, H, F_ = cfg.num_experts, cfg.n_embd, cfg.moe_ffn_hidden
        self.n, self.width = E, F_
        std = cfg.weight_std()
        self.fc = nn.Parameter(torch.empty(E * 2 * F_, H).normal_(0.0, std))
        self.proj = nn.Parameter(torch.empty(E * H, F_).normal_(0.0, cfg.residual_std()))
        # expert parallelism (fitgpt/parallel/experts.py): this rank holds E/P experts (`n`)
        # and `exchange` sends the tokens to their experts' ranks and back; None: all E here
        self.exchange = None

    def weights(self, H: int) -> tuple[Tensor, Tensor]:
        """The experts' weights as [E, 2F, H] and [E, H, F] views (F.linear's [O, I] each)."""
        return self.fc.view(self.n, 2 * self.width, H), self.proj.view(self.n, H, self.width)

    def run(self, x_MH: Tensor, count_E: Tensor, grouped: bool, expert_M: Tensor) -> Tensor:
        """[M, H]: each row through its expert's SwiGLU, the rows grouped by expert (count_E[e]
        of expert e, in order; `grouped` as sort_by_expert gives it; expert_M, each row's
        expert, for experts with biases)."""
        fc_EOH, proj_EHF = self.weights(x_MH.shape[1])
        gate, up = expert_matmul(x_MH, fc_EOH, count_E, grouped).chunk(2, dim=-1)
        return expert_matmul(F.silu(gate) * up, proj_EHF, count_E, grouped)

    def forward(self, x_NH: Tensor, idx_NK: Tensor, w_NK: Tensor) -> Tensor:
        """[N, H]: Σ_k w_NK[n, k] · expert_{idx_NK[n, k]}(x_NH[n])."""
        if self.exchange is not None:
            return self.exchange(self, x_NH, idx_NK, w_NK)
        fc_EOH, _ = self.weights(x_NH.shape[1])
        order_M, token_M, count_E, grouped = sort_by_expert(idx_NK, self.n, x_NH, fc_EOH)
        x_MH = x_NH[token_M]  # M·H: each token once per expert it goes to (k copies)
        y_MH = self.run(x_MH, count_E, grouped, None) * w_NK.reshape(-1)[order_M, None]
        # summed back per token in expert order, as transformers' per-expert index_add_ does
        return torch.zeros_like(x_NH).index_add_(0, token_M, y_MH.to(x_NH.dtype))


class SparseMoe(nn.Module):
    """The router and the experts: the MLP of a sparse layer."""

    def __init__(
        self, cfg: ModelConfig, fp32_scores: bool, router: nn.Module | None = None,
        experts: nn.Module | None = None,
    ) -> None:  # fmt: skip
        """`router`, `experts`: a family's own (gpt-oss's have biases), else a bias-free linear
        and the SwiGLU Experts."""
        super().__init__()
        if router is None:
            router = nn.Linear(cfg.n_embd, cfg.num_experts, bias=False)
        self.router = router
        self.experts = experts if experts is not None else Experts(cfg)
        self.k, self.norm_topk = cfg.experts_per_token, cfg.norm_topk_prob
        self.fp32_scores = fp32_scores
        # training only: this forward's (Σ_n p [E] fp32 with its graph, assignments per expert
        # [E] fp32, N), taken by MoeLlama.forward for the aux loss and the load it logs
        self.route: tuple[Tensor, Tensor, int] | None = None

    def forward(self, x_BTH: Tensor) -> Tensor:
        B, T, H = x_BTH.shape
        x_NH = x_BTH.reshape(-1, H)
        logits_NE = self.router(x_NH)
        p_NE = F.softmax(logits_NE, dim=-1, dtype=torch.float32)
        w_NK, idx_NK = torch.topk(p_NE, self.k, dim=-1)
        if self.norm_topk:
            w_NK = w_NK / w_NK.sum(dim=-1, keepdim=True)
        if not self.fp32_scores:
            w_NK = w_NK.to(logits_NE.dtype)
        if self.training:
            self.route = self.route_stats(logits_NE, p_NE, idx_NK)
        return self.experts(x_NH, idx_NK, w_NK).view(B, T, H)

    def drop_forward_state(self) -> None:
        """Forget this forward's routing (its graph with it): MoeLlama.forward, once it has
        read it, and activation checkpointing after a block's recompute in the backward
        (engine/transforms/activation.py), whose copy nobody reads."""
        self.route = None

    def route_stats(self, logits_NE: Tensor, p_NE: Tensor, idx_NK: Tensor):
        """What the aux loss takes of this layer, as load_balancing_loss_func computes it: the
        softmax in the logits' dtype (the routing's fp32 one when they are fp32, else its own
        and its own top k), summed over the tokens in fp32, and the assignments per expert
        (counted on the device: no host sync)."""
        if logits_NE.dtype != torch.float32:
            p_NE = F.softmax(logits_NE, dim=-1)
            idx_NK = torch.topk(p_NE, self.k, dim=-1).indices
        flat = idx_NK.reshape(-1)
        count_E = torch.zeros(p_NE.shape[-1], dtype=torch.float32, device=flat.device)
        count_E.scatter_add_(0, flat, torch.ones_like(flat, dtype=torch.float32))
        return p_NE.float().sum(dim=0), count_E, p_NE.shape[0]


def load_balancing_loss(routes: list[tuple[Tensor, Tensor, int]], num_experts: int) -> Tensor:
    """transformers' load_balancing_loss_func (no attention mask) over the layers' route_stats:
    the assignments and the probabilities each summed over the layers, divided by the rows of
    all of them, multiplied expert by expert and summed, times E."""
    rows = sum(n for _, _, n in routes)
    prob_sum = torch.stack([p for p, _, _ in routes]).sum(0) if len(routes) > 1 else routes[0][0]
    count = torch.stack([c for _, c, _ in routes]).sum(0) if len(routes) > 1 else routes[0][1]
    return torch.sum((count / rows) * (prob_sum / rows).unsqueeze(0)) * num_experts


class MoeLlama(Llama):
    """Llama with a SparseMoe as the MLP of the layers cfg.moe_layers names. Training adds the
    load-balancing loss to the mean cross-entropy when cfg.router_aux_loss_coef > 0, and keeps
    the aux loss and every sparse layer's load for the metrics (router_report); evaluation and
    generation compute the language-model loss alone (a perplexity)."""

    fp32_scores: ClassVar[bool] = False  # Mixtral's router keeps its weights in fp32

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__(cfg)
        self._log: list[Tensor] | None = None  # [aux sum, forwards] and [layers, E] loads
        # set by the engines' step_share (engine/base.py), which weighs coef·aux apart from the
        # cross-entropy: forward then returns the cross-entropy and keeps the term in aux_term
        self.aux_apart = False
        self.aux_term: Tensor | None = None

    def make_block(self, cfg: ModelConfig, layer: int) -> nn.Module:
        sparse = layer in cfg.moe_layers
        return LlamaBlock(cfg, SparseMoe(cfg, self.fp32_scores) if sparse else None)

    def init_std(self, name: str) -> float | None:
        """Llama's, the experts' down projections residual like every MLP's."""
        if name.endswith("experts.proj"):
            return self.cfg.residual_std()
        return super().init_std(name)

    def sparse_mlps(self) -> list[SparseMoe]:
        return [b.mlp for b in self.blocks if isinstance(b.mlp, SparseMoe)]

    def forward(
        self,
        idx_BT: Tensor,
        targets_BT: Tensor | None = None,
        cache=None,
        segments_BT: Tensor | None = None,
    ) -> Tensor:
        out = super().forward(idx_BT, targets_BT, cache, segments_BT)
        routes = [m.route for m in self.sparse_mlps()]
        for m in self.sparse_mlps():
            m.drop_forward_state()  # the graph they hold goes with the loss's
        if not self.training or any(r is None for r in routes) or not routes:
            return out
        aux = load_balancing_loss(routes, self.cfg.num_experts)
        self._keep(aux.detach(), torch.stack([c for _, c, _ in routes]))
        if targets_BT is None or cache is not None or not self.cfg.router_aux_loss_coef:
            return out
        # transformers: loss += router_aux_loss_coef * aux_loss, after the mean cross-entropy
        term = self.cfg.router_aux_loss_coef * aux
        if self.aux_apart:
            self.aux_term = term
            return out
        return out + term

    def take_aux_term(self) -> Tensor | None:
        """coef·aux of the last training forward run with aux_apart, its graph with it (None
        when none was added: the coefficient 0, no targets); forgotten once taken."""
        term, self.aux_term = self.aux_term, None
        return term

    # Eager, also inside a compiled forward (a graph break, ~10 µs a forward): the whole-model
    # compile replays CUDA graphs, whose outputs the next replay overwrites; sums kept across
    # forwards must be tensors made outside them (grad-accum 2 crashed with "accessing tensor
    # output of CUDAGraphs that has been overwritten", results/moe_aux_h200_2026-11-29).
    # torch._disable_dynamo: torch.compiler.disable applied at the first call, which keeps
    # torch._dynamo (1-1.5 s) out of every command's start (model/loss.py, tests/test_startup.py)
    @torch._disable_dynamo
    def _keep(self, aux: Tensor, load_LE: Tensor) -> None:
        """Add one training forward's aux loss and loads to the running sums (on the device:
        no host sync until router_report reads them)."""
        if self._log is None:
            self._log = [torch.zeros(2, device=aux.device), torch.zeros_like(load_LE)]
        self._log[0] += torch.stack([aux.float(), torch.ones_like(aux, dtype=torch.float32)])
        self._log[1] += load_LE

    def router_report(self) -> dict:
        """The training forwards' mean aux loss since the last report, each sparse layer's
        share of the assignments per expert (1/E each when balanced), and the busiest expert's
        share over the even one, the most of any layer (1.0 balanced, E/K collapsed); reset.
        {} when no training forward ran. Reading it is a host sync."""
        if self._log is None:
            return {}
        (aux_sum, n), load_LE = self._log[0].tolist(), self._log[1]
        self._log = None
        share_LE = load_LE / load_LE.sum(dim=1, keepdim=True)
        return {
            "router_aux_loss": aux_sum / n,
            "expert_load_max": (share_LE.max() * share_LE.shape[1]).item(),
            "expert_load": [[round(v, 5) for v in row] for row in share_LE.tolist()],
        }
