"""The next-token loss over a large vocabulary, a piece of rows at a time.

The plain loss (DecoderLM.head_loss's small path) makes the [N, V] logits, an fp32 copy for the
softmax, the saved log-probabilities and in the backward their gradient: 2w + 8 bytes per
logit. At Llama 3's V = 128,256 and 8,192 tokens a micro-batch that is 12.6 GB (bf16). Here the
N rows go through in pieces of `rows`: for each, the logits, their fp32 softmax, the loss and
at once the gradients with respect to the piece's hidden rows and the head weight, so one
piece's [rows, V] logits exist at a time, in the forward and the backward alike.

Why the gradients are made in the forward (and the backward only scales them by grad_output),
not by recomputing each piece in the backward: the head's FLOPs stay the plain loss's 6·N·V·H
(recomputing costs 2·N·V·H more: 8.6 TFLOP per micro-batch at Llama 3.1 8B, ~1.4% of its step).
What it costs instead: the [N, H] hidden gradient and the [V, H] weight gradient exist from the
forward to the backward, where the plain path makes the same two in its backward, while every
activation is still alive: the same peak. The weight gradient is a sum over the pieces: one
read and write of [V, H] per piece after the first (addmm_'s beta = 1; estimated ~0.7 ms per
piece at Llama 3 8B on an H100, not yet measured: benchmarks/parts/loss_pieces_gpu.py), which is what bounds how small a piece should be (PIECE_LOGITS).

Precision: the softmax, the loss and the logit gradient are fp32 as in the plain path; the
matmuls run in the compute dtype (the working dtype, or autocast's). The gradient of the mean
(1/count applied in fp32) is cast to the compute dtype before its matmuls, as the plain path's
backward does. fp16 alone differs: there 1/count would flush the small probabilities' gradient
(p/count < 6e-8) to zero before the loss scale (applied only in the backward) could lift them,
so in fp16 the logit gradient stays unscaled (|g| <= 1), the weight gradient is summed in fp32
(a sum over N rows could exceed fp16's range) and both are scaled by grad_output/count in the
backward.

Vocabulary parallel (parallel/layers.py): each rank holds rows [lo, lo + Vl) of the head; the
max, the sum of exponentials and the target's logit of each piece are all-reduced over the
group ([rows] floats each); the hidden gradient returned is this rank's partial sum, which the
head's copy_to_tp (or sequence parallelism's gather) reduces in the backward.

Shape legend: N rows (batch·tokens), H hidden, V this rank's (padded) vocabulary rows, n the
rows of one piece.
"""

from __future__ import annotations

import torch
import torch.distributed._functional_collectives as funcol
from torch import Tensor
from torch.autograd.function import once_differentiable

# The most logits one piece holds; also the threshold: logits that fit in one piece take the
# plain path (every small model and test, bit-identical to before). 2^27 logits are 0.5 GiB in
# fp32; a piece holds them in the compute dtype and in fp32, then as the fp32 gradient and its
# compute-dtype copy (piece_bytes: w + 4 bytes per logit): ~0.75 GiB at bf16, against 12.6 GB
# for the plain loss of 8,192 tokens of Llama 3 (eight pieces of 1,046 rows). Smaller pieces
# cost a [V, H] read and write each (the weight gradient's sum) and matmuls of fewer rows.
PIECE_LOGITS = 2**27


def loss_pieces(tokens: int, vocab: int) -> int:
    """Rows per piece for the loss of `tokens` rows over `vocab` logits (this rank's: V/T under
    tensor parallelism), or 0: the plain loss, whose [tokens, vocab] logits fit in one piece.
    The model (head_loss) and the planner (plan/memory.py) both decide with it."""
    if tokens * vocab <= PIECE_LOGITS:
        return 0
    return max(1, PIECE_LOGITS // vocab)


def piece_bytes(tokens: int, vocab: int, hidden: int, w: int, fp16: bool = False) -> int:
    """Bytes the pieces loss holds at its peak, `w` bytes per working element: one piece's
    logits in the compute dtype and in fp32 for the softmax (made in place), then the fp32
    gradient and its compute-dtype copy: w + 4 per logit; the [V, H] weight gradient (summed
    in fp32 under fp16) and the [N, H] hidden one."""
    rows = min(tokens, loss_pieces(tokens, vocab) or tokens)
    return rows * vocab * (w + 4) + vocab * hidden * (4 if fp16 else w) + tokens * hidden * w


def _all_reduce(t: Tensor, group, op: str = "sum") -> Tensor:
    """A new tensor: t reduced over `group` (None: a group of one, t itself)."""
    if group is None:
        return t
    return funcol.wait_tensor(funcol.all_reduce(t, op, group))


def compute_dtype(x: Tensor) -> torch.dtype:
    """The matmuls' dtype: autocast's where it is on (the ddp engine's fp32 weights), else x's."""
    dev = x.device.type
    return torch.get_autocast_dtype(dev) if torch.is_autocast_enabled(dev) else x.dtype


class _PiecesCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_NH, w_VH, targets_N, rows: int, real: int, lo: int, group):
        cd = compute_dtype(x_NH)
        fp16 = cd == torch.float16
        N, V = x_NH.shape[0], w_VH.shape[0]
        with torch.autocast(x_NH.device.type, enabled=False):  # every dtype below explicit
            x, w = x_NH.to(cd), w_VH.to(cd)
            valid_N = targets_N != -1
            count = valid_N.sum()
            # the mean's 1/count per row, 0 for ignored rows (all ignored: loss nan, gradient 0,
            # as F.cross_entropy); fp16 applies it in the backward (module docstring)
            scale_N = torch.where(valid_N, 1 / count, 0.0) if not fp16 else valid_N.float()
            loss = torch.zeros((), device=x.device, dtype=torch.float32)
            grad_x = torch.empty_like(x)  # [N, H]: each piece writes its rows
            grad_w = None  # [V, H], the sum over the pieces
            for r0 in range(0, N, rows):
                r1 = min(N, r0 + rows)
                x_nH, t_n = x[r0:r1], targets_N[r0:r1]
                z_nV = (x_nH @ w.t()).float()  # the compute-dtype logits, freed at once
                if lo + V > real:  # padded vocabulary rows: no token, out of the softmax
                    z_nV[:, max(0, real - lo) :] = float("-inf")
                top_n = _all_reduce(z_nV.amax(dim=1), group, "max")
                mine_n = (t_n >= lo) & (t_n < lo + V)  # targets in this rank's rows
                local_n = (t_n - lo).clamp(0, V - 1)
                picked_n = z_nV.gather(1, local_n[:, None]).squeeze(1) - top_n
                picked_n = _all_reduce(picked_n * mine_n, group)  # from the target's owner
                z_nV = z_nV.sub_(top_n[:, None]).exp_()  # in place: z is exp(z - max) now
                sum_n = _all_reduce(z_nV.sum(dim=1), group)
                loss = loss + ((sum_n.log() - picked_n) * valid_N[r0:r1]).sum()
                # d loss / d logits = (softmax - one-hot) / count on valid rows, in fp32
                z_nV.mul_((scale_N[r0:r1] / sum_n)[:, None])
                hit = torch.arange(r1 - r0, device=x.device)
                z_nV[hit, local_n] -= mine_n * scale_N[r0:r1]
                g_nV = z_nV.to(cd)
                del z_nV  # the fp32 piece freed before the two matmuls
                grad_x[r0:r1] = g_nV @ w
                if grad_w is None:
                    grad_w = (g_nV.t() @ x_nH).to(torch.float32 if fp16 else cd)
                elif fp16:
                    grad_w += g_nV.t() @ x_nH  # fp32 sum of fp16 products
                else:
                    grad_w.addmm_(g_nV.t(), x_nH)  # accumulated in place (beta = 1)
            loss = loss / count
        ctx.save_for_backward(grad_x, grad_w, count)
        ctx.fp16 = fp16
        ctx.dtypes = (x_NH.dtype, w_VH.dtype)
        return loss

    @staticmethod
    @once_differentiable
    def backward(ctx, grad):
        grad_x, grad_w, count = ctx.saved_tensors
        post = grad / count.clamp(min=1) if ctx.fp16 else grad  # no row valid: gradients 0
        # scaled in place (a second backward through a retained graph fails on their version)
        gx = grad_x.mul_(post.to(grad_x.dtype)).to(ctx.dtypes[0])
        gw = grad_w.mul_(post.to(grad_w.dtype)).to(ctx.dtypes[1])
        return gx, gw, None, None, None, None, None


# Never traced by torch.compile (a graph break around it in a compiled head): the pieces are
# already one matmul, one fp32 softmax and two gradient matmuls each, and Inductor, given the
# piece loop unrolled, schedules the independent pieces' logits early. On the CPU the compiled
# loss held about one extra piece at 8-32 pieces and nearly the whole [N, V] from 64 on (548
# against 116 MiB eager at 128 pieces, its compile 239 s:
# benchmarks/memory/compiled_long_memory_cpu.py); on an H100 a compiled Llama-3.1-8B at 247,808
# tokens (237 pieces) ran out of memory in its first forward where the plan priced one piece
# (results/long_h100_2026-11-27). Cost: the head's final norm compiles apart from the loss.
# torch._disable_dynamo is torch.compiler.disable applied at the first call: the public one
# imports torch._dynamo when this module loads, 1-1.5 s of every fitgpt command's start
# (`fitgpt --help` took 4 s, 2 without it); a run that builds a model imports it anyway.
@torch._disable_dynamo
def pieces_cross_entropy(
    x_NH: Tensor,
    w_VH: Tensor,
    targets_N: Tensor,
    rows: int,
    real: int,
    lo: int = 0,
    group=None,
) -> Tensor:
    """Mean cross-entropy (targets of -1 ignored) of the logits x_NH @ w_VH.T, `rows` rows at a
    time (loss_pieces), without the [N, V] logits. `real`: the unpadded vocabulary (rows from
    `real` on are -inf); `lo`, `group`: this rank's first vocabulary row and the tensor-parallel
    group (None: one process holding the whole head). The gradients reach x_NH and w_VH
    through autograd's ordinary return (a tied head's lands on the embedding)."""
    return _PiecesCrossEntropy.apply(x_NH, w_VH, targets_N, rows, real, lo, group)
