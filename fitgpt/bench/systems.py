"""The systems a sweep compares: fitgpt (planner's choice), its ablations, and the peers.

Every system trains fitgpt's own model definition (fitgpt/model/gpt.py), so parameter counts and
FLOPs are identical across systems and the throughput figures compare exactly.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

from fitgpt.bench.config import BenchConfig
from fitgpt.dist import DistContext
from fitgpt.engine.base import Batch
from fitgpt.engine.config import EngineConfig, OptimConfig, PrecisionConfig
from fitgpt.errors import UserError
from fitgpt.model import ModelConfig


class Runner(Protocol):
    def step(self, micro_batches: list[Batch]) -> float:
        """One optimizer step; returns the loss; must end with the device synchronised."""
        ...


@dataclass(frozen=True)
class System:
    name: str
    help: str
    build: Callable[[ModelConfig, BenchConfig, DistContext], Runner]
    bench_changes: dict = field(default_factory=dict)  # e.g. no gradient accumulation
    # the engine fields this system fixes (the planner predicts its capacity from them); None for
    # systems the memory model does not cover (the peers)
    fixed: dict | None = None
    precision: str = "auto"

    def plan_fixed(self, bench: BenchConfig) -> dict | None:
        if self.fixed is None:
            return None
        return {k: (bench.checkpointing if v == "bench" else v) for k, v in self.fixed.items()}


class EngineRunner:
    """A fitgpt engine (or the plain torch one) behind the Runner interface."""

    def __init__(self, engine) -> None:
        self.engine = engine

    def step(self, micro_batches: list[Batch]) -> float:
        return self.engine.train_step(micro_batches, lr=1e-4).loss  # ends in a host sync


def fitgpt_system(fixed: dict | None = None, precision: str = "auto"):
    """fitgpt's engine with the planner choosing every field not in `fixed` (an ablation fixes
    one technique off and lets the planner do its best with the rest)."""

    def build(model: ModelConfig, bench: BenchConfig, ctx: DistContext) -> Runner:
        from fitgpt.engine.factory import build_engine

        # auto: bf16 on GPUs (the protocol), fp32 on CPUs (CPU bf16 is ~20x slower)
        pcfg = PrecisionConfig(precision=precision).resolved(ctx.device.type)
        f = {k: (bench.checkpointing if v == "bench" else v) for k, v in (fixed or {}).items()}
        ecfg = planned(model, bench, ctx, pcfg.precision, {"engine": "zero", **f})
        return EngineRunner(build_engine(model, ecfg, pcfg, OptimConfig(), ctx, bench.seed))

    return build


def planned(
    model: ModelConfig, bench: BenchConfig, ctx: DistContext, precision: str, fixed: dict
) -> EngineConfig:
    """The planner's plan for this trial; when nothing is predicted to fit, the leanest plan is
    tried anyway (force): capacity is measured, never assumed."""
    from fitgpt.plan import hardware, rates
    from fitgpt.plan.memory import Workload
    from fitgpt.plan.planner import choose

    hw = hardware.detect(gpus=ctx.world, device=ctx.device.type, nvme=bench.nvme_path or None)
    work = Workload(model, bench.micro_batch, ctx.world, precision, ctx.device.type)
    chosen, _ = choose(work, bench.grad_accum, hw, rates.load(hw.gpu_name), fixed, force=True)
    return chosen.ecfg


def ddp(model: ModelConfig, bench: BenchConfig, ctx: DistContext) -> Runner:
    from fitgpt.engine.factory import build_engine

    ecfg = EngineConfig(engine="ddp", checkpointing=bench.checkpointing)
    pcfg = PrecisionConfig("auto").resolved(ctx.device.type)
    return EngineRunner(build_engine(model, ecfg, pcfg, OptimConfig(), ctx, bench.seed))


def peer(module: str, builder: str) -> Callable[[ModelConfig, BenchConfig, DistContext], Runner]:
    """A peer's builder from fitgpt/bench/peers/, imported only when a trial builds it: DeepSpeed
    is an optional extra, and nothing else in fitgpt may import it."""

    def build(model: ModelConfig, bench: BenchConfig, ctx: DistContext) -> Runner:
        import importlib

        mod = importlib.import_module(f"fitgpt.bench.peers.{module}")
        return getattr(mod, builder)(model, bench, ctx)

    return build


def _fitgpt(
    name: str, help_: str, fixed: dict | None = None, precision: str = "auto", **bench
) -> System:
    fixed = {"engine": "zero", **(fixed or {})}
    return System(name, help_, fitgpt_system(fixed, precision), bench, fixed, precision)


SYSTEMS: dict[str, System] = {
    s.name: s
    for s in [
        _fitgpt("fitgpt", "fitgpt with its planner's choice"),
        _fitgpt(
            "fitgpt-no-accum",
            "fitgpt without gradient accumulation (an update every micro-batch)",
            grad_accum=1,
        ),
        _fitgpt("fitgpt-no-mixed", "fitgpt in fp32 (no mixed precision)", precision="fp32"),
        _fitgpt(
            "fitgpt-no-ckpt", "fitgpt without activation checkpointing", {"checkpointing": "off"}
        ),
        _fitgpt("fitgpt-no-zero", "fitgpt without ZeRO partitioning (stage 0)", {"zero_stage": 0}),
        _fitgpt(
            "fitgpt-no-offload",
            "fitgpt without CPU/NVMe offload",
            {"offload_optimizer": "none", "offload_params": "none"},
        ),
        *[
            _fitgpt(
                f"zero{k}",
                f"fitgpt's engine at ZeRO stage {k}, checkpointing as --checkpointing",
                {"zero_stage": k, "checkpointing": "bench"},
            )
            for k in range(4)
        ],
        System(
            "ddp",
            "PyTorch: fp32 weights + fused AdamW on the GPU, bf16 autocast, DDP across "
            "ranks (the seed's baseline)",
            ddp,
            fixed={"engine": "ddp", "checkpointing": "bench"},
        ),
        System(
            "deepspeed-z3-offload",
            "DeepSpeed 0.19.8 ZeRO-3: bf16 parameters and the optimizer offloaded to pinned CPU "
            "memory, DeepSpeedCPUAdam (needs fitgpt[bench])",
            peer("deepspeed_peer", "zero3_offload"),
        ),
        System(
            "deepspeed-z2-offload",
            "DeepSpeed 0.19.8 ZeRO-2 (ZeRO-Offload): the optimizer offloaded to pinned CPU "
            "memory, DeepSpeedCPUAdam (needs fitgpt[bench])",
            peer("deepspeed_peer", "zero2_offload"),
        ),
        System(
            "fsdp2-offload",
            "PyTorch FSDP2 (fully_shard per block) with CPUOffloadPolicy: parameters, gradients "
            "and fused AdamW on the CPU, bf16 compute",
            peer("fsdp2_peer", "build"),
        ),
    ]
}


def get_system(name: str) -> System:
    if name not in SYSTEMS:
        raise UserError(f"system {name!r} is unknown; choose from {', '.join(SYSTEMS)}")
    return SYSTEMS[name]
