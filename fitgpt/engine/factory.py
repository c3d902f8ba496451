"""Build the engine a config asks for."""

from __future__ import annotations

from fitgpt.dist import DistContext
from fitgpt.engine.base import Engine
from fitgpt.engine.config import EngineConfig, OptimConfig, PrecisionConfig
from fitgpt.model import ModelConfig


def build_engine(
    model_cfg: ModelConfig,
    ecfg: EngineConfig,
    pcfg: PrecisionConfig,
    ocfg: OptimConfig,
    ctx: DistContext,
    seed: int = 0,
) -> Engine:
    if ecfg.engine == "ddp":
        from fitgpt.engine.ddp import TorchEngine

        return TorchEngine(model_cfg, ecfg, pcfg, ocfg, ctx, seed)
    from fitgpt.engine.chunked.engine import ChunkEngine

    return ChunkEngine(model_cfg, ecfg, pcfg, ocfg, ctx, seed)
