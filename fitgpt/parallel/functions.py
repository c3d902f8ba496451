"""The communication of Megatron-style tensor parallelism, as autograd functions.

Shape legend: N rows (batch·tokens), H hidden, V padded vocabulary, T ranks in the TP group,
Vl = V/T the vocabulary rows of one rank.

  copy_to_tp      f: identity forward, all-reduce of the input's gradient backward. Before a
                  column-parallel matmul: every rank reads the whole input, and each contributes
                  a partial input gradient through its own columns.
  reduce_from_tp  g: all-reduce forward, identity backward. After a row-parallel matmul: the
                  partial outputs of the T ranks summed; the gradient reaches each unchanged.
  scatter_seq     sequence parallelism's g: reduce-scatter along the sequence forward (the
                  partial outputs summed, each rank keeping its S/T tokens), all-gather backward.
  gathered_linear sequence parallelism's f and the column-parallel matmul in one: all-gather
                  along the sequence ([B, S/T, H] → [B, S, H]) then the matmul forward;
                  backward, the input gathered again (only this rank's shard is kept: T times
                  less, one more all-gather per use, Megatron-LM's choice) and its gradient
                  reduce-scattered along the sequence.
  gather_seq      gathered_linear's all-gather alone (its backward a reduce-scatter along the
                  sequence), for the loss taken a piece of rows at a time (model/loss.py).
  vocab_parallel_cross_entropy: the loss of [N, Vl] logit shards without any rank holding the
                  [N, V] logits: a max, a sum of exponentials and the target's logit, each
                  all-reduced over the group ([N] floats each, instead of N·V).

Per transformer block that is 2 all-reduces of N·H elements forward (after attn.proj and
mlp.proj) and 2 backward (before qkv and fc), which plan/throughput.py prices.

The collectives are torch's functional ones (torch.distributed._functional_collectives): they
return new tensors, so torch.compile traces them in a compiled block without a graph break, and
gloo runs them on CPUs for the tests.
"""

from __future__ import annotations

import warnings

import torch
import torch.distributed._functional_collectives as funcol
import torch.nn.functional as F
from torch import Tensor

# renamed in 2.13 (all_gather_single / reduce_scatter_single), which 2.11 lacks: as engine/comm.py
warnings.filterwarnings("ignore", message=r".*all_gather_tensor.* is deprecated")
warnings.filterwarnings("ignore", message=r".*reduce_scatter_tensor.* is deprecated")


def all_reduce(t: Tensor, group, op: str = "sum") -> Tensor:
    """A new tensor: t reduced over `group` (None: a group of one, t itself)."""
    if group is None:
        return t
    return funcol.wait_tensor(funcol.all_reduce(t, op, group))


class _CopyToTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, group) -> Tensor:
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: Tensor):
        return all_reduce(grad, ctx.group), None


class _ReduceFromTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, group) -> Tensor:
        return all_reduce(x, group)

    @staticmethod
    def backward(ctx, grad: Tensor):
        return grad, None


def _gather(x: Tensor, group, tp: int) -> Tensor:
    """[B, S/T, …] of every rank → [B, S, …], in rank order."""
    if group is None:
        return x
    return funcol.wait_tensor(funcol.all_gather_tensor(x.contiguous(), 1, group))


def _scatter(x: Tensor, group, tp: int) -> Tensor:
    """[B, S, …] summed over ranks, rank r keeping tokens [r·S/T, (r+1)·S/T)."""
    if group is None:
        return x
    return funcol.wait_tensor(funcol.reduce_scatter_tensor(x.contiguous(), "sum", 1, group))


class _ScatterSeq(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, group, tp: int) -> Tensor:
        ctx.group, ctx.tp = group, tp
        return _scatter(x, group, tp)

    @staticmethod
    def backward(ctx, grad: Tensor):
        return _gather(grad, ctx.group, ctx.tp), None, None


class _GatherSeq(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, group, tp: int) -> Tensor:
        ctx.group, ctx.tp = group, tp
        return _gather(x, group, tp)

    @staticmethod
    def backward(ctx, grad: Tensor):
        return _scatter(grad, ctx.group, ctx.tp), None, None


class _GatheredLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_BSlH: Tensor, weight: Tensor, bias: Tensor | None, group, tp: int):
        y = F.linear(_gather(x_BSlH, group, tp), weight, bias)  # under autocast if enabled
        ctx.save_for_backward(x_BSlH, weight)  # the shard, not the gathered [B, S, H]
        ctx.group, ctx.tp = group, tp
        ctx.bias_dtype = None if bias is None else bias.dtype
        return y

    @staticmethod
    def backward(ctx, grad_BSO: Tensor):
        x, weight = ctx.saved_tensors
        cd = grad_BSO.dtype  # the forward's compute dtype (autocast's, or the weights')
        full_BSH = _gather(x, ctx.group, ctx.tp).to(cd)  # gathered again: freed on return
        grad_x = _scatter(grad_BSO @ weight.to(cd), ctx.group, ctx.tp).to(x.dtype)
        g_NO = grad_BSO.reshape(-1, grad_BSO.shape[-1])
        grad_w = (g_NO.t() @ full_BSH.reshape(-1, full_BSH.shape[-1])).to(weight.dtype)
        grad_b = None if ctx.bias_dtype is None else g_NO.sum(0).to(ctx.bias_dtype)
        return grad_x, grad_w, grad_b, None, None


def gathered_linear(x: Tensor, weight: Tensor, bias: Tensor | None, group, tp: int) -> Tensor:
    """all-gather(x along the sequence) W^T + b, keeping x's shard for backward."""
    if group is None:
        return F.linear(x, weight, bias)
    return _GatheredLinear.apply(x, weight, bias, group, tp)


def gather_seq(x: Tensor, group, tp: int) -> Tensor:
    """[B, S/T, …] → [B, S, …] forward, the gradient reduce-scattered back: sequence
    parallelism's f without the matmul, for the pieces loss (model/loss.py), which keeps none
    of its input for the backward."""
    if group is None:
        return x
    return _GatherSeq.apply(x, group, tp)


def scatter_seq(x: Tensor, group, tp: int) -> Tensor:
    return _ScatterSeq.apply(x, group, tp)


def copy_to_tp(x: Tensor, group) -> Tensor:
    return _CopyToTP.apply(x, group)


def reduce_from_tp(x: Tensor, group) -> Tensor:
    return _ReduceFromTP.apply(x, group)


class _VocabParallelCE(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits_NVl: Tensor, targets_N: Tensor, lo: int, real: int, group) -> Tensor:
        """Mean cross-entropy over targets != -1; logits fp32, this rank's rows [lo, lo+Vl)."""
        Vl = logits_NVl.shape[1]
        if lo + Vl > real:  # padded vocabulary rows: no token, kept out of the softmax
            logits_NVl = logits_NVl.clone()
            logits_NVl[:, max(0, real - lo) :] = float("-inf")
        top_N = all_reduce(logits_NVl.max(dim=1).values, group, "max")
        exp_NVl = (logits_NVl - top_N[:, None]).exp_()
        sum_N = all_reduce(exp_NVl.sum(dim=1), group)
        mine_N = (targets_N >= lo) & (targets_N < lo + Vl)
        local_N = (targets_N - lo).clamp_(0, Vl - 1)
        picked_N = logits_NVl.gather(1, local_N[:, None]).squeeze(1) - top_N
        picked_N = all_reduce(picked_N * mine_N, group)  # the target's logit, from its owner
        valid_N = targets_N != -1
        count = valid_N.sum()
        loss = ((sum_N.log() - picked_N) * valid_N).sum() / count
        exp_NVl /= sum_N[:, None]  # now the softmax, kept for backward: N·Vl fp32
        ctx.save_for_backward(exp_NVl, local_N, mine_N & valid_N, valid_N, count)
        return loss

    @staticmethod
    def backward(ctx, grad: Tensor):
        soft_NVl, local_N, hit_N, valid_N, count = ctx.saved_tensors
        g_NVl = soft_NVl * (valid_N[:, None] * (grad / count))
        rows = torch.arange(g_NVl.shape[0], device=g_NVl.device)
        g_NVl[rows, local_N] -= hit_N * (grad / count)  # d loss / d logit = softmax - one-hot
        return g_NVl, None, None, None, None


def vocab_parallel_cross_entropy(
    logits_NVl: Tensor, targets_N: Tensor, lo: int, real: int, group
) -> Tensor:
    """Mean next-token cross-entropy (-1 targets ignored) of vocabulary-split fp32 logits; the
    same value on every rank of the group. `real`: the unpadded vocabulary size."""
    return _VocabParallelCE.apply(logits_NVl, targets_N, lo, real, group)
