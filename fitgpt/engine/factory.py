"""Build the engine a config asks for."""

from __future__ import annotations

from fitgpt.adapters import AdapterConfig
from fitgpt.dist import DistContext
from fitgpt.engine.base import Engine
from fitgpt.engine.config import EngineConfig, OptimConfig, PrecisionConfig
from fitgpt.model import ModelConfig


def cap_gpu(gpu_mem: int, ctx: DistContext) -> None:
    """`--gpu-mem`: torch's caching allocator refuses to hold more than the stated bytes on
    this rank's GPU (set_per_process_memory_fraction), so the run meets the plan made for that
    size or fails as a GPU of that size would. Nothing on the CPU, or with 0 (the whole GPU).
    Memory outside the allocator (the CUDA context, NCCL's buffers) is not capped; the planner
    keeps its margin for it (plan/memory.py gpu_budget)."""
    if not gpu_mem or ctx.device.type != "cuda":
        return
    import torch

    total = torch.cuda.get_device_properties(ctx.device).total_memory
    torch.cuda.set_per_process_memory_fraction(min(1.0, gpu_mem / total), ctx.device)


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
    cap_gpu(ecfg.gpu_mem, ctx)
    if ecfg.engine == "ddp":
        if ecfg.expert_parallel > 1:  # plan/validate.py refuses it before a run gets here
            raise ValueError("expert parallelism runs on the chunked engine (--engine zero)")
        from fitgpt.engine.ddp import TorchEngine

        return TorchEngine(model_cfg, ecfg, pcfg, ocfg, ctx, seed, adapter)
    if adapter is not None and adapter.active:
        raise ValueError("LoRA adapters train on the ddp engine: settle the run (plan/adapter.py)")
    from fitgpt.engine.chunked.engine import ChunkEngine

    return ChunkEngine(model_cfg, ecfg, pcfg, ocfg, ctx, seed)
