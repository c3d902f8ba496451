"""Weight gradients accumulated by their matrix product: the block linears of a compiled run
write dW straight into the chunk's gradient buffer, applied to a built model from outside.

Autograd computes a linear's weight gradient into a fresh tensor and AccumulateGrad then adds
it to `.grad` (a view of the chunk's flat buffer at stages 0-1): per micro-batch the product
writes dW (2 bytes per element), the add reads it and the buffer and writes the buffer (6). Here
the product accumulates into the buffer itself (cuBLAS's beta = 1: 4 bytes). Measured at the
2.7b preset on an H100, in one call, with the bias gradient then a sum added in place: 1039.3 →
1030.2 ms per step (`benchmarks/results/ab_speed2_h100_2026-11-24/final`; the adds took 23 ms
of the step in its profile). On a GPU the bias gradient is now a product too (_bias_grad).

How: each eligible nn.Linear's forward becomes the custom op `fitgpt::linear`, opaque to the
compiler, so a block stays one compiled graph (a Python autograd.Function would break it). Its
backward, `fitgpt::linear_backward`, returns dx and writes dW and db into the parameters'
`.grad`; it returns no gradient for them, so autograd adds nothing. Autograd still runs each
parameter's AccumulateGrad node, after the op, with no gradient: it leaves `.grad` as it is and
calls the post-accumulate-grad hooks, so the engine's gradient reducer (engine/chunked/reduce.py)
hears of both parameters as before and starts the chunk's reduction once its last gradient is
written. The backward finds the parameters from the weight's data pointer (the compiled graph
hands the op its inputs, not the Parameter objects).

Where: the chunk engine's regional compilation (`--compile on`), for linears whose chunk keeps
a full gradient buffer and persistent weights (ZeRO stages 0-1, not streamed): a stage-2/3
gradient is flattened per micro-batch and a streamed or sharded weight moves between uses.
Not for the whole-model CUDA graphs (a replay runs the captured kernels, never the op's Python
that finds the parameters, and this form was measured as regions only) nor
for tensor-parallel layers (their own linears). Without grad (evaluation, decoding) the
forward is plain F.linear.
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

# weight data pointer -> weak references to (weight, bias or None). Entries live from
# fuse_weight_grads to the handle's remove() (the engine's close()); weak, so an engine never
# closed keeps no parameter (and through .grad no gradient buffer) alive.
_OWNERS: dict[int, tuple[weakref.ref, weakref.ref | None]] = {}


def _owner(w: Tensor) -> tuple[nn.Parameter, nn.Parameter | None]:
    """The parameters whose gradients the backward of the linear with weight `w` writes."""
    refs = _OWNERS.get(w.data_ptr())
    weight = refs[0]() if refs else None
    if weight is None or weight.data_ptr() != w.data_ptr():
        raise RuntimeError(
            "fitgpt::linear's weight is no engine parameter (replaced or copied since the engine "
            "built it): build the engine again, or train it with --compile off"
        )
    return weight, refs[1]() if refs[1] is not None else None


@functools.cache
def _ones(n: int, dtype: torch.dtype, device: torch.device) -> Tensor:
    return torch.ones(n, dtype=dtype, device=device)


def _bias_grad(grad: Tensor, dy2: Tensor) -> None:
    """grad += the column sums of dy2 [rows, out]. On a GPU as one matrix-vector product with a
    vector of ones, beta = 1 into the buffer: no second kernel. cuBLAS accumulates in fp32, and
    with torch's default allow_bf16_reduced_precision_reduction may round a split reduction's
    partial sums to bf16; the 12-step losses agreed with the sum's to 1e-4. ATen's sum over rows
    and the add after it took 25.6 and 4.0 ms of the 2.7b step on an H100; as the product the
    step took 1006-1007 ms against 1012.1, and GPT-2 1.5 B's 701.4 against 713.5, in one call
    (`benchmarks/results/ab_speed3_h100_2026-11-24`). The vector of ones, one element per row, is
    kept per shape, dtype and device. On a CPU, ATen's pairwise sum: its product form
    accumulates in a row, 20x the fp32 rounding error at 8,192 rows."""
    if dy2.is_cuda:
        grad.addmv_(dy2.t(), _ones(dy2.shape[0], dy2.dtype, dy2.device))
    else:
        grad.add_(dy2.sum(0))


@functools.cache
def _ops():
    """The two custom ops, registered once per process, on first use."""

    @torch.library.custom_op(
        "fitgpt::linear", mutates_args=(), schema="(Tensor x, Tensor w, Tensor? b) -> Tensor"
    )
    def linear(x, w, b):
        return F.linear(x, w, b)

    @linear.register_fake
    def _(x, w, b):
        return x.new_empty(*x.shape[:-1], w.shape[0])

    @torch.library.custom_op(
        "fitgpt::linear_backward",
        mutates_args=(),
        schema="(Tensor dy, Tensor x, Tensor w) -> Tensor",
    )
    def linear_backward(dy, x, w):
        weight, bias = _owner(w)
        dy2, x2 = dy.reshape(-1, dy.shape[-1]), x.reshape(-1, x.shape[-1])
        weight.grad.addmm_(dy2.t(), x2)  # cuBLAS beta = 1: the product adds into the buffer
        if bias is not None:
            _bias_grad(bias.grad, dy2)
        return dy @ w

    @linear_backward.register_fake
    def _(dy, x, w):
        return dy.new_empty(*dy.shape[:-1], w.shape[1])

    # it writes .grad, which its schema cannot name: without this the compiler treats it as pure
    # and drops it where dx is unused (an input that needs no gradient), losing dW and db
    torch.fx.node.has_side_effect(torch.ops.fitgpt.linear_backward.default)

    def setup_context(ctx, inputs, output):
        x, w, _b = inputs
        ctx.save_for_backward(x, w)

    def backward(ctx, dy):
        x, w = ctx.saved_tensors
        return linear_backward(dy, x, w), None, None

    linear.register_autograd(backward, setup_context=setup_context)
    return linear


class FusedLinear(nn.Linear):
    """An nn.Linear whose forward is the custom op while grad is enabled. fuse_weight_grads swaps
    a module's class to it, not its forward attribute: every block's linear then has the same
    forward, so the compiled block function keeps one graph for all blocks (a per-module forward
    object is a guard that fails at each block: measured, 8 recompiles, then the rest eager)."""

    op: Callable[..., Tensor] | None = None  # fitgpt::linear, set when the ops are registered

    def forward(self, x: Tensor) -> Tensor:
        if not torch.is_grad_enabled():
            return F.linear(x, self.weight, self.bias)
        return FusedLinear.op(x, self.weight, self.bias)


class FusedWeightGrads:
    """The handle fuse_weight_grads returns: remove() gives the linears back their class."""

    def __init__(self, linears: list[nn.Linear]) -> None:
        self.linears = linears

    def remove(self) -> None:
        for lin in self.linears:
            _OWNERS.pop(lin.weight.data_ptr(), None)
            lin.__class__ = nn.Linear
        self.linears = []


def fuse_weight_grads(
    blocks: list[nn.Module], eligible: Callable[[nn.Parameter], bool]
) -> FusedWeightGrads:
    """Route every plain nn.Linear of `blocks` whose parameters are all `eligible` (their
    `.grad` a persistent buffer, their storage fixed) through the custom op. Returns the handle
    that undoes it."""
    FusedLinear.op, done = _ops(), []
    for block in blocks:
        for lin in block.modules():
            if type(lin) is not nn.Linear or not all(eligible(p) for p in lin.parameters()):
                continue
            bias = weakref.ref(lin.bias) if lin.bias is not None else None
            _OWNERS[lin.weight.data_ptr()] = (weakref.ref(lin.weight), bias)
            lin.__class__ = FusedLinear
            done.append(lin)
    return FusedWeightGrads(done)
