"""Expert parallelism (`--expert-parallel P`): every sparse layer's E experts spread over the P
ranks of an EP group (dist/mesh.py ExpertGroups), rank r holding experts [r·L, (r+1)·L), L = E/P.

Each rank routes its own tokens as before (router, top k), then:
  dispatch  the (token, expert) assignments sorted by expert, so the rows bound for each rank
            are contiguous; the counts per expert traded first (one all-to-all of E integers
            and a host sync: the row splits must be known on the host), then the rows (an
            all-to-all of M·H elements: each rank sends the rows whose expert another rank
            holds, (P-1)/P of them on average);
  experts   the received rows regrouped by local expert (they arrive by source rank) and run
            as the unsplit model runs them (Experts.run: one matmul per expert, or one grouped
            GEMM);
  combine   the outputs put back in arrival order and sent home by the reverse all-to-all,
            then weighted and summed per token exactly as the unsplit model does.
Both all-to-alls are differentiable (AllToAll: the backward is the all-to-all with the splits
swapped), so the backward makes two more. Each rank's rows of expert e are whatever tokens any
rank of its EP group routed there, so the experts' gradients are already summed over those
tokens; the engine reduces them over the replica group only (engine/chunked/reduce.py), with the
1/W of the data-parallel mean folded into the loss as for every other gradient.

Parameters: `blocks.i.mlp.experts.fc` [L·2F, H] and `.proj` [L·H, F] on each rank: rank r's rows
of the full [E·2F, H] and [E·H, F], contiguous (expert e's rows are a block of each); gpt-oss's
`gate_up` [L, H, 2F], `down` [L, F, H] and their biases, the first dimension the expert's. Checkpoints
hold the full layout (engine/layout.py): engine/transforms/ep_state.py maps this rank's ranges to
the full ones, so a run saved at P = 2 loads at P = 1 and the reverse.

Shape legend: N this rank's tokens, K experts per token, M = N·K assignments, R rows received,
E experts, L = E/P local experts, P the EP group, H hidden.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor, nn

from fitgpt.dist.mesh import ExpertGroups
from fitgpt.model import ModelConfig, family_of
from fitgpt.model.families.qwen3_moe.model import grouped_gemm_ok


class AllToAll(torch.autograd.Function):
    """Rows of x sent to the group's ranks (in_splits[r] to rank r), out_splits[r] received
    from rank r; the backward sends the gradients back the same way reversed."""

    @staticmethod
    def forward(ctx, x: Tensor, out_splits: list[int], in_splits: list[int], group) -> Tensor:
        ctx.splits, ctx.group = (out_splits, in_splits), group
        out = x.new_empty((sum(out_splits), *x.shape[1:]))
        dist.all_to_all_single(out, x.contiguous(), out_splits, in_splits, group=group)
        return out

    @staticmethod
    def backward(ctx, g: Tensor):
        out_splits, in_splits = ctx.splits
        gx = g.new_empty((sum(in_splits), *g.shape[1:]))
        dist.all_to_all_single(gx, g.contiguous(), in_splits, out_splits, group=ctx.group)
        return gx, None, None, None


class ExpertExchange:
    """A family's experts module's forward under expert parallelism (module docstring):
    dispatch, the local experts (the module's `run` over rows grouped by expert, given each
    row's local expert for the families whose experts have biases), combine."""

    def __init__(self, groups: ExpertGroups) -> None:
        self.size, self.group = groups.size, groups.group

    def __call__(self, ex: nn.Module, x_NH: Tensor, idx_NK: Tensor, w_NK: Tensor) -> Tensor:
        P, L = self.size, ex.n
        flat_M = idx_NK.reshape(-1)
        order_M = flat_M.argsort(stable=True)  # by expert, so by destination rank
        token_M = order_M // idx_NK.shape[1]
        count_E = torch.zeros(P * L, dtype=torch.int64, device=x_NH.device)
        count_E.scatter_add_(0, flat_M, torch.ones_like(flat_M))
        recv_PL = torch.empty_like(count_E)  # [s·L + l]: rows rank s sends to local expert l
        dist.all_to_all_single(recv_PL, count_E, group=self.group)
        recv_PL = recv_PL.view(P, L)
        # host sync: the all-to-alls take their splits as host integers
        send, recv = torch.stack([count_E.view(P, L).sum(1), recv_PL.sum(1)]).tolist()
        x_RH = AllToAll.apply(x_NH[token_M], recv, send, self.group)
        # the received rows come by source rank, each source's by local expert: regroup them
        local_R = torch.arange(L, device=x_NH.device).repeat(P).repeat_interleave(recv_PL.view(-1))
        regroup_R = local_R.argsort(stable=True)
        count_L = recv_PL.sum(0)
        x_RH = x_RH[regroup_R]
        w_LOI, _ = ex.weights(x_NH.shape[1])
        y_RH = ex.run(x_RH, count_L, grouped_gemm_ok(x_RH, w_LOI), local_R[regroup_R])
        y_RH = y_RH[regroup_R.argsort()]  # back in arrival order
        y_MH = AllToAll.apply(y_RH, send, recv, self.group)
        y_MH = y_MH * w_NK.reshape(-1)[order_M, None]
        return torch.zeros_like(x_NH).index_add_(0, token_M, y_MH.to(x_NH.dtype))


# ---- what P must be -------------------------------------------------------------------------
def expert_parallel_refusal(
    ep: int, cfg: ModelConfig, world: int | None = None, tp: int = 1, cp: int = 1
) -> str | None:
    """The one line refusing P for this model on `world` ranks (None: not known yet), or None
    (P = 0, auto: the planner prices only the P this passes)."""
    if ep in (0, 1):
        return None
    family = family_of(cfg)
    if not family.has_experts:
        return f"--expert-parallel {ep}: the {cfg.family} family has no experts; use 1"
    if world is not None and world % ep:
        return (
            f"--expert-parallel {ep} does not divide the {world} rank(s) of this run: use a "
            f"divisor of {world}"
        )
    if cfg.num_experts % ep:
        return (
            f"--expert-parallel {ep} does not divide the model's {cfg.num_experts} experts: use "
            f"a divisor of {cfg.num_experts}"
        )
    if tp > 1 or cp > 1:
        return (
            f"--expert-parallel {ep} with --tensor-parallel or --context-parallel is not "
            "supported yet: use one of them"
        )
    return None


# ---- the model ----------------------------------------------------------------------------------
def expert_parallel(model: nn.Module, groups: ExpertGroups) -> nn.Module:
    """Keep this rank's E/P experts of every sparse layer (the model on the meta device: the
    engine binds and initialises the parameters afterwards) and route through ExpertExchange.
    Every parameter of a family's experts module is expert-major along its first dimension
    (E·rows or E), so this rank's are 1/P of its rows."""
    exchange = ExpertExchange(groups)
    for mlp in model.sparse_mlps():
        ex = mlp.experts
        L = ex.n // groups.size
        for name, p in list(ex.named_parameters(recurse=False)):
            setattr(ex, name, nn.Parameter(p.new_empty(p.shape[0] // ex.n * L, *p.shape[1:])))
        ex.n, ex.exchange = L, exchange
    return model
