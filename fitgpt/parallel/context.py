"""Context parallelism (`--context-parallel C`): every sequence split along its tokens over a
group of C ranks, for sequences whose activations one GPU cannot hold (docs/parallel.md).

Rank r of a CP group (dist/mesh.py cp_ranks: C consecutive ranks at T = 1) holds the contiguous
slice [r·S/C, (r+1)·S/C) of every row's tokens. Everything outside attention works on a token
alone (embedding, norms, MLP, head and loss), so it runs on the slice as it is, on 1/C of the
activations. Attention needs every token, and is run DeepSpeed-Ulysses style (Jacobs et al.
2023): before it each rank trades its slice of all heads for all tokens of N/C of the heads,
attention runs over the whole sequence for those heads, and the output is traded back.

    q = x W_q^T     [B, S/C, N·D]  --all-to-all-->  [B, S, N/C·D]   (k and v: K·D, K/C·D)
    attention of the local heads over all S tokens, by the model's own code and kernels
    y               [B, S, N/C·D]  --all-to-all-->  [B, S/C, N·D]   then y W_o^T

Why all-to-all and not ring attention (the evidence, read in the venv's torch 2.13):
  - torch.distributed.tensor.experimental.context_parallel is ring attention implemented by
    DTensor dispatch: it monkey-patches F.scaled_dot_product_attention for the whole process,
    needs a DeviceMesh and shards the buffers it is given in place. Its ring kernels accept only
    the flash, efficient and cuDNN SDPA ops ("CP only supports flash attention and memory
    efficient attention now"), so no CPU (math) backend for the gloo tests, and refuse an
    additive mask ("attn_bias is not supported yet"): not ALiBi's bias, not packed rows' boolean
    document mask. Its FlexAttention path all-gathers K and V instead (flex_cp_allgather).
  - fitgpt's attention is several kernels chosen per call (causal SDPA/flash, a sliding-window
    mask, ALiBi's float bias, the packed rows' mask or FlexAttention block mask:
    model/packing.py). Ulysses leaves attention whole over the sequence, so every one of them
    runs unchanged and the loss is the unsplit model's to rounding; ring attention would need
    its own version of each (per-block masks, a causal load balance that reorders tokens).
  - Its cost: C must divide the query heads and the key/value heads (Llama 3.1 8B: K = 8, so
    C <= 8, one box); the bytes are below.

Communication per transformer layer, per rank, forward (b bytes per element of the compute
dtype, B·S/C tokens here; each all-to-all keeps 1/C of its input and sends the rest):
    q, k, v in  (N + 2K)·D · B·S/C · b · (C-1)/C
    output      N·D · B·S/C · b · (C-1)/C
so (2N + 2K)·D·B·S·b·(C-1)/C² bytes sent by each rank; the backward the same again (the
all-to-alls' gradients are the inverse all-to-alls), and activation checkpointing's recompute
the forward's once more. Llama 3.1 8B (N=32, K=8, D=128), C=4, bf16, S=128k: 80·128·131072·2·3
/16 = 503 MB per layer forward. The weights are whole on every rank; their gradients are
partial (each rank's tokens) and are summed over the job with the data-parallel ones: a CP
rank is a data-parallel rank to the engines (ZeRO shards, offload tiers, streamed weights,
the token-weighted loss of engine/base.py), and one data rank to the loader (ctx.data_rank).

With tensor parallelism (applied first) a rank's N/T heads are split C ways again: C·T must
divide the heads and the key/value heads, the all-to-alls run over the CP group (ranks of one
TP index: dist/mesh.py cp_ranks) on 1/T of the bytes above, and sequence parallelism splits
each CP slice T ways more.

How it is applied: from outside the model, as tensor parallelism is (parallel/layers.py). The
attention's input linears (the family's head-cut q, kv or qkv: parts from its Split) get a
forward hook trading their output, its output linear (proj) a pre-hook trading its input;
model.split_heads(r, C) gives the attention modules N/C and K/C heads (the family's per-head
buffers, ALiBi's slopes, follow); ContextParallelLM hands the blocks the whole sequence's
positions (rotary tables, ALiBi's bias, the packed rows' mask: the loader keeps `segments`
whole) and the embedding this slice's (slice start + t, or the slice of the packed row's).

Shape legend: B batch, S whole sequence, Sl = S/C this rank's slice, C ranks, P parts of a
fused linear (q 1, kv 2, qkv 3), F features per part, Fl = F/C.
"""

from __future__ import annotations

import torch
import torch.distributed._functional_collectives as funcol
from torch import Tensor, nn

from fitgpt.dist.mesh import ContextGroup
from fitgpt.model import DecoderLM, ModelConfig, family_of


# ---- the all-to-alls -----------------------------------------------------------------------
def _all_to_all(x_C: Tensor, group) -> Tensor:
    """x [C, ...]: piece j goes to rank j; returns [C, ...], piece j from rank j. Costs, beside
    the transfer, a copy of the input into rank order here and one of the output back into
    [B, tokens, features] by the caller's reshape: two passes over each rank's q/k/v/y bytes."""
    return funcol.wait_tensor(funcol.all_to_all_single(x_C.contiguous(), None, None, group))


def _seq_to_heads(x_BSlF: Tensor, parts: int, cp: ContextGroup) -> Tensor:
    """[B, Sl, P·F] → [B, S, P·Fl]: this rank's 1/C of each part's features (heads) for every
    token (source rank j's slice is tokens [j·Sl, (j+1)·Sl))."""
    B, Sl, F = x_BSlF.shape
    C = cp.size
    x_CBSlPFl = x_BSlF.view(B, Sl, parts, C, F // (parts * C)).permute(3, 0, 1, 2, 4)
    y_CBSlPFl = _all_to_all(x_CBSlPFl, cp.group)
    return y_CBSlPFl.permute(1, 0, 2, 3, 4).reshape(B, C * Sl, F // C)


def _heads_to_seq(y_BSFl: Tensor, parts: int, cp: ContextGroup) -> Tensor:
    """The inverse: [B, S, P·Fl] → [B, Sl, P·F], every rank's heads of this rank's tokens."""
    B, S, Fl = y_BSFl.shape
    C = cp.size
    y_CBSlPFl = y_BSFl.view(B, C, S // C, parts, Fl // parts).transpose(0, 1)
    x_CBSlPFl = _all_to_all(y_CBSlPFl, cp.group)
    return x_CBSlPFl.permute(1, 2, 3, 0, 4).reshape(B, S // C, C * Fl)


class _SeqToHeads(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, parts: int, cp: ContextGroup) -> Tensor:
        ctx.parts, ctx.cp = parts, cp
        return _seq_to_heads(x, parts, cp)

    @staticmethod
    def backward(ctx, grad: Tensor):
        return _heads_to_seq(grad, ctx.parts, ctx.cp), None, None


class _HeadsToSeq(torch.autograd.Function):
    @staticmethod
    def forward(ctx, y: Tensor, parts: int, cp: ContextGroup) -> Tensor:
        ctx.parts, ctx.cp = parts, cp
        return _heads_to_seq(y, parts, cp)

    @staticmethod
    def backward(ctx, grad: Tensor):
        return _seq_to_heads(grad, ctx.parts, ctx.cp), None, None


def seq_to_heads(x_BSlF: Tensor, parts: int, cp: ContextGroup) -> Tensor:
    """Before attention: a slice of the tokens of all heads → all tokens of 1/C of the heads
    (backward: the inverse all-to-all of the gradient)."""
    return _SeqToHeads.apply(x_BSlF, parts, cp)


def heads_to_seq(y_BSFl: Tensor, parts: int, cp: ContextGroup) -> Tensor:
    """After attention: all tokens of 1/C of the heads → a slice of the tokens of all heads."""
    return _HeadsToSeq.apply(y_BSFl, parts, cp)


# ---- what C must divide --------------------------------------------------------------------
def cp_sizes(
    cfg: ModelConfig, world: int | None, tp: int = 1, sequence_parallel: bool = False
) -> list[tuple[int, int, str]]:
    """What C must divide: (size, T·C or C: what divides it, what it is, as the line names
    it). Under tensor parallelism a rank's heads are N/T, split C ways again."""
    tc = max(1, tp)
    checks = [(cfg.n_head, tc, "the head count (--heads)")]
    if cfg.kv_heads != cfg.n_head:
        checks.append((cfg.kv_heads, tc, "the key/value heads (--kv-heads)"))
    seq = "the sequence length (--seq-len)"
    checks.append((cfg.seq_len, tc if sequence_parallel else 1, seq))
    if world is not None:
        checks.insert(0, (world, tc, "the rank count (--gpus)"))
    return checks


def context_parallel_refusal(
    cp: int,
    cfg: ModelConfig,
    world: int | None = None,
    tp: int = 1,
    sequence_parallel: bool = False,
) -> str | None:
    """The one line refusing a C the model or the job cannot be split by, or None
    (plan/validate.py asks it for train, plan, capacity and the planner's candidates; C >= 1
    is EngineConfig's own check). `tp`: T (0, auto: judged once the planner has chosen)."""
    if cp <= 1 or tp == 0:
        return None
    why = family_of(cfg).no_context_parallel
    if why:
        return f"--context-parallel {cp}: {why} (the {cfg.family} family); use 1"
    checks = cp_sizes(cfg, world, tp, sequence_parallel)
    for n, other, what in checks:
        if n % (cp * other):
            ok = [d for d in range(1, cp + 1) if all(m % (d * o) == 0 for m, o, _ in checks)]
            names = [w for _, _, w in checks]
            by_tp = f" with --tensor-parallel {tp}" if tp > 1 else ""
            return (
                f"--context-parallel {cp}{by_tp} does not divide {what}, {n}: use one of "
                f"{', '.join(map(str, ok))} (C{'·T' if tp > 1 else ''} must divide "
                f"{', '.join(names[:-1])} and {names[-1]}: each rank takes 1/C of the tokens, "
                "then 1/C of the heads)"
            )
    return None


# ---- the model -----------------------------------------------------------------------------
class ContextParallelLM:
    """Mixed into a context-parallel model's class: the embedding takes this slice's positions,
    the blocks the whole sequence's (they attend over all of it, for their heads)."""

    cp: ContextGroup

    def embed(self, idx_BT: Tensor, past: int | Tensor = 0) -> Tensor:
        t0 = self.cp.rank * idx_BT.shape[1]
        if isinstance(past, Tensor):  # packed rows: the whole row's positions, this slice's
            return super().embed(idx_BT, past[:, t0 : t0 + idx_BT.shape[1]])
        return super().embed(idx_BT, past + t0)

    def block_aux(self, T: int, past: int, device, packing=None):
        return super().block_aux(T * self.cp.size, past, device, packing)

    def forward(
        self,
        idx_BT: Tensor,
        targets_BT: Tensor | None = None,
        cache=None,
        segments_BT: Tensor | None = None,
    ) -> Tensor:
        """idx and targets: this rank's slice of each row [B, S/C]; segments (packed rows): the
        whole row's [B, S] (BatchLoader keeps them whole)."""
        if cache is not None:
            raise ValueError("a context-parallel model trains; sample from inference_model()")
        if segments_BT is not None and segments_BT.shape[1] != idx_BT.shape[1] * self.cp.size:
            raise ValueError(
                f"context parallelism takes the whole row's segments, [B, "
                f"{idx_BT.shape[1] * self.cp.size}], not {list(segments_BT.shape)}"
            )
        return super().forward(idx_BT, targets_BT, cache, segments_BT)


_CP_CLASSES: dict[type, type] = {}


def context_parallel_class(cls: type) -> type:
    """`cls` with ContextParallelLM mixed in (one class per family, made once)."""
    if cls not in _CP_CLASSES:
        _CP_CLASSES[cls] = type(f"ContextParallel{cls.__name__}", (ContextParallelLM, cls), {})
    return _CP_CLASSES[cls]


def context_parallel(model: DecoderLM, cp: ContextGroup) -> DecoderLM:
    """Make `model` context-parallel over cp's group (C = cp.size > 1), in place; returns it.
    The parameters keep their names and shapes (every rank holds all of them), so the chunk
    layout, checkpoints and initialisation are the unsplit model's. Hooks, not new modules:
    the engines' own hooks and linears (streamed weights, engine/transforms/wgrad.py) stay as they
    are."""
    rule, found = model.family.split_rule, 0
    for path, module in model.named_modules():
        if ".attn." not in f".{path}" or not isinstance(module, nn.Linear):
            continue
        split = rule(f"{path}.weight")  # the family's cut by heads: which side, how many parts
        if split is None:
            continue
        if split.dim == 0:  # q, kv or qkv: their output traded for all tokens of 1/C of heads
            module.register_forward_hook(
                lambda m, args, out, p=split.parts: seq_to_heads(out, p, cp)
            )
        else:  # proj: its input traded back before the matmul
            module.register_forward_pre_hook(lambda m, args: (heads_to_seq(args[0], 1, cp),))
        found += 1
    if not found:
        raise TypeError(f"{type(model).__name__}: no attention linears (blocks.*.attn.*) to split")
    # under tensor parallelism (applied first: parallel/layers.py) this rank's N/T heads are
    # split C ways again: head block tp_rank·C + cp_rank of T·C
    mesh = getattr(model, "mesh", None)
    tp, tp_rank = (mesh.tp, mesh.tp_rank) if mesh is not None else (1, 0)
    model.split_heads(tp_rank * cp.size + cp.rank, tp * cp.size)
    model.__class__ = context_parallel_class(type(model))
    model.cp = cp
    return model
