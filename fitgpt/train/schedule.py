"""Learning rate: linear warm-up from 0, then cosine decay to min_lr at the last step."""

from __future__ import annotations

import math


def lr_at(step: int, lr: float, min_lr: float, warmup: int, total: int) -> float:
    if step < warmup:
        return lr * (step + 1) / warmup
    if total <= warmup:
        return lr
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return min_lr + 0.5 * (lr - min_lr) * (1.0 + math.cos(math.pi * progress))
