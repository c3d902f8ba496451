"""The systems a sweep compares: fitgpt (planner's choice), its ablations, and the peers.

Every system trains fitgpt's own model definition (model/families/gpt2/), so parameter counts and
FLOPs are identical across systems and the throughput figures compare exactly.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

from fitgpt.bench.config import BenchConfig
from fitgpt.bench.peers import LR
from fitgpt.dist import DistContext
from fitgpt.engine.base import Batch
from fitgpt.engine.config import EngineConfig, OptimConfig, PrecisionConfig
from fitgpt.errors import UserError
from fitgpt.model import ModelConfig
from fitgpt.plan.fixed import Fixed


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

    def plan_fixed(self, bench: BenchConfig) -> Fixed | None:
        """The fields the planner keeps for a trial at `bench`; None for a peer."""
        return None if self.fixed is None else bench_fixed(self.fixed, bench)


def bench_fixed(fixed: dict, bench: BenchConfig) -> Fixed:
    """A system's fixed engine fields at `bench` ("bench": the harness's checkpointing)."""
    return Fixed.of({k: (bench.checkpointing if v == "bench" else v) for k, v in fixed.items()})


class TrainerRunner:
    """fitgpt's engines as `fitgpt train` runs them: the run is assembled by the same call
    (fitgpt.train.assemble.assemble: resolved, validated, planned, laid out) and each step is the trainer's own (Trainer.step_once),
    so a setting that makes a trial fast makes `fitgpt train` fast too."""

    def __init__(self, trainer) -> None:
        self.trainer = trainer
        self.engine = trainer.engine

    def step(self, micro_batches: list[Batch]) -> float:
        stats, _, _ = self.trainer.step_once(micro_batches)  # ends in a host sync
        return stats.loss

    def record(self) -> dict:
        """The plan this trial runs, as the engine describes it, and the memory model's figures
        for it, recorded beside the measurement."""
        import dataclasses

        import torch

        from fitgpt.plan import rates
        from fitgpt.plan.apply import workload_of
        from fitgpt.plan.memory import GiB, estimate
        from fitgpt.plan.throughput import step_time

        run, ctx = self.trainer.run, self.trainer.ctx
        work = workload_of(run, ctx.world, ctx.device.type)
        est = estimate(work, run.engine)
        out = {
            "engine": dataclasses.asdict(run.engine),
            "placement": self.engine.describe()["placement"],
            "predicted_host_gib": est.host_total / GiB,
            "predicted_phase": est.peak_phase,
        }
        if est.compute:
            out["predicted_gpu_peak_gib"] = est.compute_peak / GiB
            out["predicted_gpu_total_gib"] = est.compute_total / GiB
        # the planner's step time, term by term, at the rates it used (a probe cached on this
        # machine, else its GPU family's defaults), beside the measured step_s
        gpu = torch.cuda.get_device_name(ctx.device) if ctx.device.type == "cuda" else "cpu"
        placement = getattr(self.engine, "placement", None)
        terms = step_time(work, run.engine, run.train.grad_accum, rates.load(gpu), placement)
        out["predicted_step_s"] = terms["total"]
        out["predicted_terms_s"] = terms
        return out


def bench_run(model: ModelConfig, bench: BenchConfig, precision: str, device: str, out: str = ""):
    """The RunConfig of a benchmark trial: `fitgpt train` on random tokens at the bench's batch,
    at a constant learning rate, saving nothing (the planner prices exactly this run)."""
    from fitgpt.data.config import DataConfig
    from fitgpt.train.config import RunConfig, TrainConfig

    train = TrainConfig(
        steps=bench.warmup + bench.steps,
        micro_batch=bench.micro_batch,
        grad_accum=bench.grad_accum,
        lr=LR,
        min_lr=LR,
        warmup=0,
        eval_every=0,
        save=False,
        seed=bench.seed,
        out=out or "runs/bench",
        device=device,
    )
    return RunConfig(
        model=model,
        data=DataConfig(data="uniform"),
        train=train,
        engine=EngineConfig(nvme_path=bench.nvme_path, compile=bench.compile),
        precision=PrecisionConfig(precision=precision),
        optim=OptimConfig(),
    )


def check_trial(system: System, bench: BenchConfig, layers: int, gpus: int, device: str) -> None:
    """Refuse, in one line, a trial `fitgpt train` would refuse (plan/validate.py: a T that does
    not divide the GPUs or heads, fp16 on a CPU, ...), before the first trial starts. `bench`:
    with the system's own changes. A peer's settings are its library's to judge."""
    from fitgpt.dist.context import device_type
    from fitgpt.train.assemble import Settings, settle

    if system.fixed is not None:
        run = bench_run(bench.model(layers), bench, system.precision, device)
        settle(Settings(run, system.plan_fixed(bench)), gpus, device_type(run.train.device))


def trained(fixed: dict, precision: str = "auto"):
    """A system run by the trainer, with the planner choosing every engine field not in `fixed`
    (an ablation fixes one technique off and lets the planner do its best with the rest). When
    nothing is predicted to fit, the leanest plan is tried anyway: capacity is measured, never
    assumed."""

    def build(model: ModelConfig, bench: BenchConfig, ctx: DistContext) -> Runner:
        import tempfile

        from fitgpt.train.assemble import Settings, assemble
        from fitgpt.train.loop import Trainer

        out = tempfile.mkdtemp(prefix="fitgpt-trial-")
        run = bench_run(model, bench, precision, ctx.device.type, out)
        settings = Settings(run, bench_fixed(fixed, bench), force=True)
        log = print if ctx.is_main else (lambda *_: None)
        return TrainerRunner(Trainer(assemble(settings, ctx, log)))

    return build


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
    return System(name, help_, trained(fixed, precision), bench, fixed, precision)


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
        _fitgpt(
            "fitgpt-no-speculate",
            "fitgpt with the host updates waiting for the gradient norm (no speculative update)",
            {"speculative_update": False},
        ),
        _fitgpt(
            "fitgpt-int8",
            "fitgpt with int8 Adam moments for the offloaded blocks (`fitgpt train --moments "
            "int8`: an opt-in for capacity; their loss cost is in docs/offload.md)",
            {"moments": "int8"},
        ),
        _fitgpt(
            "fitgpt-no-compact",
            "fitgpt with fp32 optimizer state (no split master, no bf16/int8 moments)",
            {"master": "fp32", "moments": "fp32", "device_moments": "fp32"},
        ),
        *[
            _fitgpt(
                f"zero{k}",
                f"fitgpt's engine at ZeRO stage {k}, checkpointing as --checkpointing",
                {"zero_stage": k, "checkpointing": "bench"},
            )
            for k in range(4)
        ],
        *[
            _fitgpt(
                f"tp{t}",
                f"fitgpt's engine with --tensor-parallel {t} (data-parallel over the other "
                "ranks at ZeRO stage 0), checkpointing as --checkpointing",
                {"tensor_parallel": t, "zero_stage": 0, "checkpointing": "bench"},
            )
            for t in (2, 4, 8)
        ],
        *[
            _fitgpt(
                f"cp{c}",
                f"fitgpt's engine with --context-parallel {c} (each sequence split over {c} "
                "ranks, data-parallel over the rest at ZeRO stage 1), checkpointing as "
                "--checkpointing",
                {"context_parallel": c, "zero_stage": 1, "checkpointing": "bench"},
            )
            for c in (2, 4, 8)
        ],
        _fitgpt(
            "tp2sp",
            "fitgpt's engine with --tensor-parallel 2 --sequence-parallel (ZeRO stage 0 over the "
            "other ranks), checkpointing as --checkpointing",
            {
                "tensor_parallel": 2,
                "sequence_parallel": True,
                "zero_stage": 0,
                "checkpointing": "bench",
            },
        ),
        System(
            "ddp",
            "PyTorch: fp32 weights + fused AdamW on the GPU, bf16 autocast, DDP across "
            "ranks (the seed's baseline)",
            trained({"engine": "ddp", "checkpointing": "bench"}),
            fixed={"engine": "ddp", "checkpointing": "bench"},
        ),
        System(
            "deepspeed-z3-offload",
            "DeepSpeed 0.19.8 ZeRO-3: bf16 parameters and the optimizer offloaded to pinned CPU "
            "memory, DeepSpeedCPUAdam (needs fitgpt[bench])",
            peer("deepspeed_peer", "zero3_offload"),
        ),
        System(
            "deepspeed-z3-nvme",
            "DeepSpeed 0.19.8 ZeRO-Infinity: ZeRO-3 with the bf16 parameters and the optimizer "
            "state on the disk at --nvme-path, DeepSpeedCPUAdam (needs fitgpt[bench] and libaio)",
            peer("deepspeed_peer", "zero3_nvme"),
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
