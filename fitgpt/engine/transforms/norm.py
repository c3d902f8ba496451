"""LayerNorm through ATen's kernels inside compiled regions, for rows wider than Inductor keeps
in registers: applied to a built model from outside, a class swap as engine/transforms/wgrad.py
does.

Why: Inductor compiles each LayerNorm, fused with the residual add before it, into its own
reduction kernels. Up to INDUCTOR_PERSISTENT_MAX elements a row stays in registers (a
persistent reduction); a wider row is read in a loop, once for its statistics and again to
normalise it, and the backward loops likewise. At the 2.7b preset (h=2560) on an H100 these
kernels and the residual adds took 61 ms of a 1.04 s step
(`benchmarks/results/ab_speed2_h100_2026-11-24/profile`), 2.2x what their traffic costs at the
device's copy bandwidth. ATen's kernels, behind an op the compiler keeps whole, took the step
from 1019.9 to 1008.6 ms, and GPT-2 1.5 B's (h=1600) from 728.1 to 713.9 ms, in one call
(`benchmarks/results/ab_speed3_h100_2026-11-24`). The cost: the residual add before each
LayerNorm is a kernel of its own again.

How: each nn.LayerNorm of the model with a weight (the blocks', the head's final one and an
embedding norm's, which runs outside the regions anyway) becomes AtenLayerNorm, whose forward
under grad is the custom op `fitgpt::layer_norm` (torch.native_layer_norm) with
`fitgpt::layer_norm_backward` (aten.native_layer_norm_backward) as its backward. These are the
kernels an eager F.layer_norm runs, so the values are those of an eager run. The class changes,
not the forward attribute: one forward for every block keeps one compiled graph for all blocks
(engine/transforms/wgrad.py's reason).

Where: regional compilation on GPUs for models wider than INDUCTOR_PERSISTENT_MAX (aten_norms).
Without grad (evaluation, decoding) the forward is plain F.layer_norm.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

# the widest row Inductor's row reductions keep in registers (torch 2.11's
# should_use_persistent_reduction for an inner reduction); wider rows loop
INDUCTOR_PERSISTENT_MAX = 1024


def aten_norms(device_type: str, n_embd: int) -> bool:
    """Whether a compiled run's LayerNorms go through ATen: on GPUs, past Inductor's persistent
    width. At h=768 Inductor's fused add + LayerNorm is one pass and the whole model is one
    graph (engine/transforms/compile.py model_scope); only widths that loop were measured faster."""
    return device_type == "cuda" and n_embd > INDUCTOR_PERSISTENT_MAX


def _backward(dy: Tensor, x: Tensor, mean: Tensor, rstd: Tensor, w: Tensor, b: Tensor | None):
    dx, dw, db = torch.ops.aten.native_layer_norm_backward(
        dy, x, [x.shape[-1]], mean, rstd, w, b, [True, True, b is not None]
    )
    return dx, dw, db if db is not None else dx.new_empty(0)  # an op returns no None


@functools.cache
def _op() -> Callable[..., tuple[Tensor, Tensor, Tensor]]:
    """The two custom ops, registered once per process, on first use."""

    @torch.library.custom_op(
        "fitgpt::layer_norm",
        mutates_args=(),
        schema="(Tensor x, Tensor w, Tensor? b, float eps) -> (Tensor, Tensor, Tensor)",
    )
    def layer_norm(x, w, b, eps):
        return torch.native_layer_norm(x, [x.shape[-1]], w, b, eps)

    @layer_norm.register_fake
    def _(x, w, b, eps):
        # ATen's meta kernel: the output contiguous whatever x's strides, the statistics in fp32
        # for a 16-bit x on a GPU. The CPU kernel given a 16-bit x and fp32 parameters keeps
        # its statistics in the parameters' dtype, which the meta kernel does not follow.
        y, mean, rstd = torch.native_layer_norm(x, [x.shape[-1]], w, b, eps)
        if x.device.type == "cpu" and w.dtype != x.dtype:
            mean, rstd = mean.to(w.dtype), rstd.to(w.dtype)
        return y, mean, rstd

    @torch.library.custom_op(
        "fitgpt::layer_norm_backward",
        mutates_args=(),
        schema="(Tensor dy, Tensor x, Tensor mean, Tensor rstd, Tensor w, Tensor? b)"
        " -> (Tensor, Tensor, Tensor)",
    )
    def layer_norm_backward(dy, x, mean, rstd, w, b):
        return _backward(dy, x, mean, rstd, w, b)

    layer_norm_backward.register_fake(_backward)  # the meta kernel, as above

    def setup_context(ctx, inputs, output):
        x, w, b, _eps = inputs
        ctx.save_for_backward(x, output[1], output[2], w, b)

    def backward(ctx, dy, _dmean, _drstd):
        x, mean, rstd, w, b = ctx.saved_tensors
        # ATen's kernel reads dy as a contiguous row block; a compiled graph may hand a strided one
        dx, dw, db = layer_norm_backward(dy.contiguous(), x, mean, rstd, w, b)
        return dx, dw, db if b is not None else None, None

    layer_norm.register_autograd(backward, setup_context=setup_context)
    return layer_norm


class AtenLayerNorm(nn.LayerNorm):
    """An nn.LayerNorm whose forward under grad is the custom op (the module docstring)."""

    op: Callable[..., tuple[Tensor, Tensor, Tensor]] | None = None  # set by use_aten_norms

    def forward(self, x: Tensor) -> Tensor:
        if not torch.is_grad_enabled() or len(self.normalized_shape) != 1:
            return F.layer_norm(x, self.normalized_shape, self.weight, self.bias, self.eps)
        return AtenLayerNorm.op(x, self.weight, self.bias, self.eps)[0]


def use_aten_norms(model: nn.Module) -> int:
    """Swap every plain nn.LayerNorm of `model` that has a weight to AtenLayerNorm; returns how
    many. Kept for the model's life: its values are eager F.layer_norm's, with or without
    compilation, and its state dict and isinstance checks are nn.LayerNorm's."""
    AtenLayerNorm.op, n = _op(), 0
    for m in model.modules():
        if type(m) is nn.LayerNorm and m.weight is not None:
            m.__class__ = AtenLayerNorm
            n += 1
    return n
