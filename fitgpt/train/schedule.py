"""Learning rate: linear warm-up from 0, then cosine decay to min_lr at the last step; the
default peak by the model's width."""

from __future__ import annotations

import math

import numpy as np

# The peak learning rate a run gets when it names none, by hidden size: GPT-3's (Brown et al.
# 2020, table 2.1: 125 M to 175 B, d_model 768 to 12288), and 2e-3 for the 128-wide CPU demo
# (`tiny`), interpolated log-log between these points and held beyond the ends. One rate for
# every size was the default before: 2e-3, ten to thirty times GPT-3's above a billion
# parameters, where the 20b preset's loss jumped from 11.7 to 46 after its first step
# (benchmarks/results/user_path_x2_h200_2026-11-24; docs/training.md). Wider models take
# smaller steps because Adam moves every weight by about the rate at once, and a matrix product
# sums those moves over its whole width.
DEFAULT_LR_BY_WIDTH = (
    (128, 2.0e-3),
    (768, 6.0e-4),
    (1024, 3.0e-4),
    (1536, 2.5e-4),
    (2048, 2.0e-4),
    (2560, 1.6e-4),
    (4096, 1.2e-4),
    (5140, 1.0e-4),
    (12288, 0.6e-4),
)
MIN_LR_RATIO = 0.1  # the cosine ends at a tenth of the peak, as GPT-3's does


def default_lr(n_embd: int) -> float:
    """The peak learning rate for a model n_embd wide (DEFAULT_LR_BY_WIDTH), to 2 significant
    digits so that logs and configs read plainly."""
    widths, rates = zip(*DEFAULT_LR_BY_WIDTH, strict=True)
    log_lr = np.interp(math.log(n_embd), np.log(widths), np.log(rates))  # held at the ends
    return float(f"{math.exp(log_lr):.2g}")


def lr_at(step: int, lr: float, min_lr: float, warmup: int, total: int) -> float:
    if step < warmup:
        return lr * (step + 1) / warmup
    if total <= warmup:
        return lr
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return min_lr + 0.5 * (lr - min_lr) * (1.0 + math.cos(math.pi * progress))


def end_lr(lr: float) -> float:
    """The default learning rate at the end of the cosine for a peak of lr: MIN_LR_RATIO of it,
    to 3 significant digits (6e-5 for 6e-4, not 5.9999999999999995e-05)."""
    return float(f"{lr * MIN_LR_RATIO:.3g}")
