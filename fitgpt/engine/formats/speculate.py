"""The speculative update's way back: one AdamW step undone, so a step taken before the global
gradient norm was known can be redone with the right clip coefficient (engine/chunked/update.py).

Why an inverse and not a backup. A host-homed chunk's update starts during the backward, before
the global norm is known, assuming no clipping and no overflow. When that guess was wrong the
chunk's master and moments must return to their values before the step. A backup of what the
step overwrites costs 12 bytes per element in fp32 formats, i.e. a second copy of the offloaded
state (the host RAM that holds the largest models), and copying it out would add a third to the
DRAM traffic of every step, which is what the host update is bound by. Re-reading it from the disk
tier needs two file versions per chunk. The inverse below costs nothing in a step that was right
and one more pass over the chunk's state in a step that was wrong: it recomputes the step's
increment from the new moments (the kernel computed it from the same values), adds it back, and
solves the moment recurrences for their old values.

How close it comes back: the update's arithmetic is rounded, so the inverse is not exact to the
bit. Measured (tests/test_speculate.py), the restored master is within 8 fp32 ulps of the larger
of its old and new values (5.5 seen), and a moment within 2 ulps of the largest term of its
recurrence. That is absolute accuracy: where the step's gradient term dominated the old second
moment v, v comes back with a relative error of about 1e-7 · (that dominance), and a redone
step scaled by a clip coefficient c carries it as ~1.2e-7/c² relative in v (c = 0.01: 1e-3;
c = 0.001: 6%). So the update guesses only where a heavy clip is unlikely
(engine/chunked/update.py): never at the first step (whose moments come back exactly anyway: they
were zero) nor after a step that was clipped or skipped. A step that was right (the common case) is
bit-identical, since nothing is undone. Lossy moment formats (bf16, int8) undo the decoded values;
the result is encoded again, within the format's own rounding.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor


@torch.no_grad()
def undo_adamw_(
    p: Tensor,
    g: Tensor,
    m: Tensor,
    v: Tensor,
    step: float,
    lr: float,
    betas: tuple[float, float],
    weight_decay: float,
    eps: float,
) -> None:
    """Undo, in place, the AdamW step that took (p, m, v) to their current values with fp32
    gradient g (already scaled as the step scaled it) at step number `step` (the count the step
    used: 1 for the first). Inverse of torch's fused AdamW:
        p *= 1 - lr·wd;  m = lerp(m, g, 1 - b1);  v = b2·v + (1 - b2)·g²
        p -= lr/(1 - b1^t) · m / (sqrt(v)/sqrt(1 - b2^t) + eps).
    Allocates one fp32 temporary the size of p (callers pass pieces)."""
    b1, b2 = betas
    bc1, bc2_sqrt = 1 - b1**step, math.sqrt(1 - b2**step)
    denom = v.sqrt().div_(bc2_sqrt).add_(eps)
    p.addcdiv_(m, denom, value=lr / bc1)  # the increment back, from the moments it used
    if weight_decay != 0.0:
        p.div_(1 - lr * weight_decay)
    # the first step's moments were zero (a fresh state, or a weights-only load): exactly; a
    # beta of 0 forgets the old moment, so any value serves and zero is the finite one
    if step == 1 or b1 == 0.0:
        m.zero_()
    else:
        m.sub_(g, alpha=1 - b1).div_(b1)
    if step == 1 or b2 == 0.0:
        v.zero_()
    else:
        v.addcmul_(g, g, value=-(1 - b2)).div_(b2).clamp_(min=0.0)


@torch.no_grad()
def undo_optimizer_(
    opt: torch.optim.AdamW, g: Tensor, group_ranges: list[tuple[int, int]], lr: float, piece: int
) -> None:
    """Undo the last step of a chunk's torch AdamW (one flat fp32 parameter per param group,
    `group_ranges` its [lo, hi) in the gradient g, the step's scaled fp32 gradient), piece by
    piece so the temporary stays at `piece` elements; its step counts go back by one."""
    for group, (lo, hi) in zip(opt.param_groups, group_ranges):
        param = group["params"][0]
        state = opt.state[param]
        step = state["step"].item()
        for a in range(0, hi - lo, piece):
            b = min(a + piece, hi - lo)
            undo_adamw_(
                param[a:b], g[lo + a : lo + b], state["exp_avg"][a:b], state["exp_avg_sq"][a:b],
                step, lr, group["betas"], group["weight_decay"], group["eps"],
            )  # fmt: skip
        state["step"] -= 1
