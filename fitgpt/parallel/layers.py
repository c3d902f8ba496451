"""Tensor parallelism applied to a built model of any family, from outside the model files
(Megatron-LM's split).

`parallelize(model, mesh)` swaps the modules whose weights the model's family cuts
(model/family.py Family.splits) for tensor-parallel ones that keep the same parameter names (so
chunk layouts, checkpoints and init-by-name work unchanged) and 1/T of the cut parameters'
elements (fitgpt/parallel/shard.py):

  ColumnParallelLinear  Y_r = X W_r^T (+ b_r): a linear whose weight is cut by output rows, the
                        input copied in (f: its gradient all-reduced backward). GPT-2's attn.qkv
                        (whole heads) and mlp.fc.
  RowParallelLinear     Y = sum_r X_r W_r^T (+ b): a weight cut by input columns, the partial
                        outputs all-reduced (g), the replicated bias added once. GPT-2's
                        attn.proj and mlp.proj, whose inputs are the column-parallel outputs.
  VocabParallelEmbedding  rank r looks up the ids in its rows [r·V/T, (r+1)·V/T), zeros for the
                        rest, and the T partial embeddings are all-reduced.
  TensorParallelLM.head_loss  the (tied) head's logits stay split by vocabulary: the loss is
                        the vocabulary-parallel cross-entropy (parallel/functions.py), or past
                        one piece of logits the same a piece of rows at a time (model/loss.py).
  HeadSharedRMSNorm     an RMSNorm applied to every head (Qwen3's q_norm and k_norm: the
                        family's head_shared): replicated, but each rank normalises only its
                        heads, so its weight's gradient is all-reduced backward (f on the
                        weight). Under sequence parallelism the engines sum every replicated
                        gradient over the group anyway (each rank's tokens), which covers it.

With sequence parallelism (`sequence_parallel=True`, Korthikanti et al. 2022) the residual
stream between the layers is split along the sequence too ([B, S/T, H] per rank): the norms,
dropout and residual adds work on 1/T of the tokens, the column-parallel layers all-gather their
input along the sequence (instead of copying it) and the row-parallel ones reduce-scatter their
output (instead of all-reducing it): the same bytes moved, 1/T of the activations outside
attention and the MLP kept. The replicated parameters' gradients are then partial sums over each
rank's tokens: the engines all-reduce them over the TP group.

The model keeps 1/T of its heads (DecoderLM.split_heads: the family's modules and per-head
buffers follow). A model built on the meta device (the engines) gets meta parameters of the
local shapes; a model holding real weights gets each rank's slice of them (tests, conversions).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from fitgpt.dist.mesh import Mesh
from fitgpt.model import DecoderLM, Split
from fitgpt.model.loss import loss_pieces, pieces_cross_entropy
from fitgpt.parallel.functions import (
    copy_to_tp,
    gather_seq,
    gathered_linear,
    reduce_from_tp,
    scatter_seq,
    vocab_parallel_cross_entropy,
)
from fitgpt.parallel.shard import shard_of


def _local_param(old: nn.Parameter, rule: Split | None, mesh: Mesh) -> nn.Parameter:
    """Rank mesh.tp_rank's part of parameter `old`, cut by `rule` (None: replicated); a meta
    parameter stays meta, of the local shape."""
    with torch.no_grad():
        return nn.Parameter(shard_of(rule, old.detach(), mesh.tp_rank, mesh.tp).clone())


class _Split:
    """Mixin: a module holding its TP group, and built from the full module it replaces."""

    mesh: Mesh
    sp: bool  # sequence parallelism: inputs/outputs split along the sequence

    @classmethod
    def of(cls, old: nn.Module, rules: dict, mesh: Mesh, sp: bool = False) -> nn.Module:
        """The split module replacing `old`, whose parameters are cut as `rules` says
        ({'weight': Split, 'bias': Split or None})."""
        new = cls.__new__(cls)
        nn.Module.__init__(new)
        for pname, p in old.named_parameters(recurse=False):
            setattr(new, pname, _local_param(p, rules.get(pname), mesh))
        if getattr(old, "bias", 0) is None:  # a Linear without bias stays without
            new.register_parameter("bias", None)
        for k, v in vars(old).items():  # training, in_features, padding_idx, ...
            if not k.startswith("_"):
                setattr(new, k, v)
        new.mesh, new.sp = mesh, sp
        return new

    def reduce_out(self, y: Tensor) -> Tensor:
        """The T partial outputs summed (g), or summed and split along the sequence."""
        g = self.mesh.tp_group
        return scatter_seq(y, g, self.mesh.tp) if self.sp else reduce_from_tp(y, g)


class ColumnParallelLinear(_Split, nn.Linear):
    def forward(self, x_NH: Tensor) -> Tensor:
        g = self.mesh.tp_group
        if self.sp:  # the input gathered along the sequence; only its shard kept for backward
            return gathered_linear(x_NH, self.weight, self.bias, g, self.mesh.tp)
        return F.linear(copy_to_tp(x_NH, g), self.weight, self.bias)


class RowParallelLinear(_Split, nn.Linear):
    def forward(self, x_NHl: Tensor) -> Tensor:
        y = self.reduce_out(F.linear(x_NHl, self.weight))
        return y if self.bias is None else y + self.bias


class HeadSharedRMSNorm(nn.RMSNorm):
    """An RMSNorm whose weight's gradient is summed over the TP group (the module docstring)."""

    mesh: Mesh

    def forward(self, x: Tensor) -> Tensor:
        w = copy_to_tp(self.weight, self.mesh.tp_group)
        return F.rms_norm(x, self.normalized_shape, w, self.eps)


class VocabParallelEmbedding(_Split, nn.Embedding):
    def forward(self, idx_BT: Tensor) -> Tensor:
        Vl = self.weight.shape[0]
        lo = self.mesh.tp_rank * Vl
        other_BT = (idx_BT < lo) | (idx_BT >= lo + Vl)  # ids another rank holds
        x = F.embedding((idx_BT - lo).masked_fill(other_BT, 0), self.weight)
        x = x.masked_fill(other_BT[..., None], 0.0)
        return self.reduce_out(x)


class TensorParallelLM:
    """Mixed into a parallelized model's class (parallelize): only the embedding under sequence
    parallelism and the head differ in code; the rest is the family's."""

    mesh: Mesh
    sequence_parallel: bool

    def embed(self, idx_BT: Tensor, past: int | Tensor = 0) -> Tensor:
        if not self.sequence_parallel:
            return super().embed(idx_BT, past)
        x = self.wte(idx_BT)  # [B, T/TP, H]: this rank's tokens, reduce-scattered
        t0 = self.mesh.tp_rank * x.shape[1]
        if isinstance(past, Tensor):  # packed rows' positions: this rank's slice of them
            return self.embed_rest(x, past[:, t0 : t0 + x.shape[1]])
        return self.embed_rest(x, past + t0)

    def forward(
        self,
        idx_BT: Tensor,
        targets_BT: Tensor | None = None,
        cache=None,
        segments_BT: Tensor | None = None,
    ) -> Tensor:
        if cache is not None and self.sequence_parallel:
            raise ValueError("a sequence-parallel model trains; sample from inference_model()")
        return super().forward(idx_BT, targets_BT, cache, segments_BT)

    def _head_shard(self, x_BTH: Tensor) -> Tensor:
        """[B, T, Vl] logits of this rank's vocabulary rows."""
        g, x, w = self.mesh.tp_group, self.final_norm(x_BTH), self.head_weight()
        if self.sequence_parallel:
            return gathered_linear(x, w, None, g, self.mesh.tp)
        return F.linear(copy_to_tp(x, g), w)

    def head_loss(self, x_BTH: Tensor, targets_BT: Tensor) -> Tensor:
        w = self.head_weight()
        lo = self.mesh.tp_rank * w.shape[0]
        rows = loss_pieces(targets_BT.numel(), w.shape[0])  # decided on this rank's Vl logits
        if rows:  # a piece of rows at a time (model/loss.py), the all-reduces per piece
            g, x = self.mesh.tp_group, self.final_norm(x_BTH)
            x = gather_seq(x, g, self.mesh.tp) if self.sequence_parallel else copy_to_tp(x, g)
            x_NH = x.reshape(-1, x.shape[-1])
            return pieces_cross_entropy(
                x_NH, w, targets_BT.reshape(-1), rows, self.cfg.vocab_size, lo, g
            )
        logits = self._head_shard(x_BTH)
        lo = self.mesh.tp_rank * logits.shape[-1]
        # fp32 softmax, as DecoderLM.head_loss: the [B·T, Vl] fp32 copy is this rank's 1/T of it
        return vocab_parallel_cross_entropy(
            logits.float().view(-1, logits.shape[-1]),
            targets_BT.reshape(-1),
            lo,
            self.cfg.vocab_size,
            self.mesh.tp_group,
        )

    @torch.no_grad()
    def head(self, x_BTH: Tensor) -> Tensor:
        """Full [B, T, V] logits on every rank (an all-gather of the shards; no gradient): for
        evaluation code that asks for logits. Training uses head_loss, which never gathers."""
        part = self._head_shard(x_BTH).contiguous()
        if self.mesh.tp_group is None:
            logits = part
        else:
            parts = [torch.empty_like(part) for _ in range(self.mesh.tp)]
            torch.distributed.all_gather(parts, part, group=self.mesh.tp_group)
            logits = torch.cat(parts, dim=-1)
        logits[..., self.cfg.vocab_size :] = float("-inf")
        return logits


_TP_CLASSES: dict[type, type] = {}


def tensor_parallel_class(cls: type) -> type:
    """`cls` with TensorParallelLM mixed in (one class per family, made once)."""
    if cls not in _TP_CLASSES:
        _TP_CLASSES[cls] = type(f"TensorParallel{cls.__name__}", (TensorParallelLM, cls), {})
    return _TP_CLASSES[cls]


def parallelize(model: DecoderLM, mesh: Mesh, sequence_parallel: bool = False) -> DecoderLM:
    """Split `model` in place over mesh's TP group (T = mesh.tp > 1); returns it. Which modules
    are split, and how, follows the family's Splits: a linear cut by rows becomes column-parallel,
    by columns row-parallel; the token embedding vocabulary-parallel. The head is never
    sequence-parallel in effect: TensorParallelLM._head_shard gathers its input itself."""
    sp, rule = sequence_parallel, model.family.split_rule
    shared = model.family.head_shared

    def rule_of_shared(name: str) -> bool:
        return any(name.endswith("." + suffix) for suffix in shared)

    swaps = []
    for path, module in model.named_modules():
        if not path or not isinstance(module, nn.Linear | nn.Embedding):
            continue
        rules = {n: rule(f"{path}.{n}") for n, _ in module.named_parameters(recurse=False)}
        if rules.get("weight") is None:
            continue
        if isinstance(module, nn.Embedding):
            new = VocabParallelEmbedding.of(module, rules, mesh, sp)
        elif rules["weight"].dim == 0:
            new = ColumnParallelLinear.of(module, rules, mesh, sp)
        else:
            new = RowParallelLinear.of(module, rules, mesh, sp)
        swaps.append((path, new))
    for path, new in swaps:
        parent, _, name = path.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, name, new)
    if not sp:  # sequence parallelism sums every replicated gradient over the group already
        for path, module in model.named_modules():
            if any(
                rule_of_shared(f"{path}.{n}") for n, _ in module.named_parameters(recurse=False)
            ):
                if type(module) is not nn.RMSNorm:
                    raise TypeError(f"{path}: only an RMSNorm can be shared by heads under TP")
                module.__class__, module.mesh = HeadSharedRMSNorm, mesh
    model.split_heads(mesh.tp_rank, mesh.tp)
    model.__class__ = tensor_parallel_class(type(model))
    model.mesh, model.sequence_parallel = mesh, sp
    return model
