"""Tiny configs for fast CPU tests."""

from __future__ import annotations

import dataclasses

from fitgpt.data.config import DataConfig
from fitgpt.engine.config import EngineConfig, OptimConfig, PrecisionConfig
from fitgpt.model import ModelConfig
from fitgpt.train.config import RunConfig, TrainConfig

TINY = ModelConfig(n_layer=2, n_embd=32, n_head=4, seq_len=32, vocab_size=96)


def run_config(out, **overrides) -> RunConfig:
    """A tiny synthetic-data run; overrides go to the sub-config that has the field."""
    parts = {
        "model": TINY,
        "data": DataConfig(data="synthetic"),
        "train": TrainConfig(
            steps=10,
            micro_batch=4,
            grad_accum=1,
            lr=3e-3,
            min_lr=3e-4,
            warmup=2,
            eval_every=0,
            log_every=5,
            out=str(out),
            device="cpu",
        ),
        "engine": EngineConfig(engine="ddp"),
        "precision": PrecisionConfig(precision="fp32"),
        "optim": OptimConfig(),
    }
    per_part: dict[str, dict] = {}
    for key, value in overrides.items():
        for name, cfg in parts.items():
            if key in {f.name for f in dataclasses.fields(cfg)}:
                per_part.setdefault(name, {})[key] = value
                break
        else:
            raise KeyError(key)
    # one replace per sub-config: its checks see every override together
    for name, fields in per_part.items():
        parts[name] = dataclasses.replace(parts[name], **fields)
    return RunConfig(**parts)
