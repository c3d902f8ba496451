"""The systems a sweep compares: fitgpt (planner's choice), its ablations, and the peers.

Every system trains fitgpt's own model definition (fitgpt/model/gpt.py), so parameter counts and
FLOPs are identical across systems and the throughput figures compare exactly.
"""

from __future__ import annotations

import dataclasses
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


class EngineRunner:
    """A fitgpt engine (or the plain torch one) behind the Runner interface."""

    def __init__(self, engine) -> None:
        self.engine = engine

    def step(self, micro_batches: list[Batch]) -> float:
        return self.engine.train_step(micro_batches, lr=1e-4).loss  # ends in a host sync


def fitgpt_system(**engine_changes) -> Callable[[ModelConfig, BenchConfig, DistContext], Runner]:
    def build(model: ModelConfig, bench: BenchConfig, ctx: DistContext) -> Runner:
        from fitgpt.engine.factory import build_engine

        ecfg = dataclasses.replace(
            fitgpt_choice(model, bench, ctx), **engine_changes.get("engine", {})
        )
        # auto: bf16 on GPUs (the protocol), fp32 on CPUs (CPU bf16 is ~20x slower)
        pcfg = PrecisionConfig(precision=engine_changes.get("precision", "auto")).resolved(
            ctx.device.type
        )
        return EngineRunner(build_engine(model, ecfg, pcfg, OptimConfig(), ctx, bench.seed))

    return build


def fitgpt_choice(model: ModelConfig, bench: BenchConfig, ctx: DistContext) -> EngineConfig:
    """What fitgpt runs when the user asks for nothing: the planner's plan once it exists;
    until then the chunked engine, ZeRO-2 across ranks, checkpointing every block."""
    stage = 2 if ctx.world > 1 else 0
    return EngineConfig(engine="zero", zero_stage=stage, checkpointing=bench.checkpointing)


def ddp(model: ModelConfig, bench: BenchConfig, ctx: DistContext) -> Runner:
    from fitgpt.engine.factory import build_engine

    ecfg = EngineConfig(engine="ddp", checkpointing=bench.checkpointing)
    pcfg = PrecisionConfig("auto").resolved(ctx.device.type)
    return EngineRunner(build_engine(model, ecfg, pcfg, OptimConfig(), ctx, bench.seed))


SYSTEMS: dict[str, System] = {
    s.name: s
    for s in [
        System("fitgpt", "fitgpt with its planner's choice", fitgpt_system()),
        System(
            "fitgpt-no-accum",
            "fitgpt without gradient accumulation (an update every micro-batch)",
            fitgpt_system(),
            {"grad_accum": 1},
        ),
        System(
            "fitgpt-no-mixed",
            "fitgpt in fp32 (no mixed precision)",
            fitgpt_system(precision="fp32"),
        ),
        System(
            "fitgpt-no-ckpt",
            "fitgpt without activation checkpointing",
            fitgpt_system(engine={"checkpointing": "off"}),
        ),
        System(
            "fitgpt-no-zero",
            "fitgpt without ZeRO partitioning (stage 0)",
            fitgpt_system(engine={"zero_stage": 0}),
        ),
        System(
            "fitgpt-no-offload",
            "fitgpt without CPU/NVMe offload",
            fitgpt_system(engine={"offload_optimizer": "none", "offload_params": "none"}),
        ),
        System("zero1", "fitgpt's engine, ZeRO stage 1", fitgpt_system(engine={"zero_stage": 1})),
        System("zero2", "fitgpt's engine, ZeRO stage 2", fitgpt_system(engine={"zero_stage": 2})),
        System("zero3", "fitgpt's engine, ZeRO stage 3", fitgpt_system(engine={"zero_stage": 3})),
        System(
            "ddp",
            "PyTorch: fp32 weights + fused AdamW on the GPU, bf16 autocast, DDP across "
            "ranks (the seed's baseline)",
            ddp,
        ),
    ]
}


def get_system(name: str) -> System:
    if name not in SYSTEMS:
        raise UserError(f"system {name!r} is unknown; choose from {', '.join(SYSTEMS)}")
    return SYSTEMS[name]
