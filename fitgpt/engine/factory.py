"""Build the engine a config asks for."""

from __future__ import annotations

from fitgpt.adapters import AdapterConfig
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
    adapter: AdapterConfig | None = None,
) -> Engine:
    """The engine `ecfg` names, on `ctx` as it is laid out for `ecfg`'s T and C (DistContext
    .laid_out: a run's ranks are laid out once, by train/assemble.py); an engine lays out
    nothing itself. `adapter`: LoRA on a frozen base, which the ddp engine alone holds (a run's
    settle decides it: plan/adapter.py)."""
    if (ctx.tp, ctx.cp_size) != (ecfg.tensor_parallel, ecfg.context_parallel):
        raise ValueError(
            f"the ranks are laid out for --tensor-parallel {ctx.tp} --context-parallel "
            f"{ctx.cp_size}, the engine config asks {ecfg.tensor_parallel} and "
            f"{ecfg.context_parallel}: pass ctx.laid_out(T, C)"
        )
    if ctx.ep_size != ecfg.expert_parallel:
        raise ValueError(
            f"the ranks are laid out for --expert-parallel {ctx.ep_size}, the engine config asks "
            f"{ecfg.expert_parallel}: pass ctx.laid_out(T, C, P)"
        )
    if ecfg.engine == "ddp":
        if ecfg.expert_parallel > 1:  # plan/validate.py refuses it before a run gets here
            raise ValueError("expert parallelism runs on the chunked engine (--engine zero)")
        from fitgpt.engine.ddp import TorchEngine

        return TorchEngine(model_cfg, ecfg, pcfg, ocfg, ctx, seed, adapter)
    if adapter is not None and adapter.active:
        raise ValueError("LoRA adapters train on the ddp engine: settle the run (plan/adapter.py)")
    from fitgpt.engine.chunked.engine import ChunkEngine

    return ChunkEngine(model_cfg, ecfg, pcfg, ocfg, ctx, seed)
