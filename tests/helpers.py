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


def engine_losses(model_cfg, ecfg: EngineConfig, ctx, steps: int, clip: float) -> dict:
    """`steps` steps of 2 micro-batches of a global batch of 8 rows through build_engine (fp32,
    gradients clipped at `clip`); data-parallel rank d takes rows [d·b, (d+1)·b) (every rank of a
    TP group the same rows). The losses, gradient norms, the model's parameter shapes and module
    classes, and the engine's memory report."""
    import torch

    from fitgpt.engine.factory import build_engine

    e = build_engine(
        model_cfg, ecfg, PrecisionConfig(precision="fp32"), OptimConfig(grad_clip=clip), ctx
    )
    dp, d = (e.ctx.dp_world, e.ctx.dp_rank) if ctx.distributed else (1, 0)
    b = 8 // dp
    out = {"loss": [], "norm": []}
    for step in range(steps):
        g = torch.Generator().manual_seed(1000 + step)
        x = torch.randint(0, model_cfg.vocab_size, (16, model_cfg.seq_len + 1), generator=g)
        micro = [x[m * 8 : (m + 1) * 8][d * b : (d + 1) * b] for m in range(2)]
        st = e.train_step([(r[:, :-1], r[:, 1:]) for r in micro], 3e-3)
        out["loss"].append(st.loss)
        out["norm"].append(st.grad_norm)
    out["shapes"] = {n: list(p.shape) for n, p in e.model.named_parameters()}
    out["classes"] = sorted({type(m).__name__ for m in e.model.modules()})
    out["mem"] = e.memory_report()
    e.close()
    return out
