"""The one way a run is planned: `plan_run(run, hardware, rates, fixed)`.

`fitgpt train` (through `plan_engine`, on rank 0), `fitgpt plan` (which prints every candidate),
`fitgpt capacity` and the benchmark harness all call it with the same typed inputs: the resolved
run config (its model is the one the engine will build), the machine, its measured rates, and
the engine fields the user fixed. What comes back is every candidate with its Placement, bytes
and step time, the chosen one first, and the one-line refusal when none fits.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from fitgpt.dist import DistContext
from fitgpt.dist.context import decided_on_rank0
from fitgpt.engine.config import EngineConfig
from fitgpt.errors import UserError
from fitgpt.plan import hardware, rates
from fitgpt.plan.candidate import Candidate
from fitgpt.plan.fixed import Fixed
from fitgpt.plan.hardware import Hardware
from fitgpt.plan.memory import GiB, Workload
from fitgpt.plan.planner import plan, refusal, why
from fitgpt.plan.rates import Rates


@dataclass
class Plans:
    """Every candidate plan of one run, the chosen (fastest that fits) first."""

    candidates: list[Candidate]
    work: Workload
    grad_accum: int
    hw: Hardware
    rates: Rates
    fixed: Fixed

    @property
    def best(self) -> Candidate:
        return self.candidates[0]

    @property
    def fits(self) -> bool:
        return self.best.fits

    def refusal(self) -> str:
        """One line: the leanest plan's shortfall and what would fit instead."""
        w, r = self.work, self.rates
        return refusal(w, self.grad_accum, self.hw, r, self.candidates, self.fixed)

    def summary(self) -> str:
        """The line `fitgpt train` prints: the plan, its prediction, and why it was chosen."""
        c = self.best
        mem = c.est.compute_total if c.est.compute else c.est.host_total
        return (
            f"plan: {c.name} (predicted {mem / GiB:.1f} GiB per rank, "
            f"{c.time['total']:.2f} s/step) — {why(c, self.candidates)}"
        )


def workload_of(run, world: int, device: str, nodes: int = 1) -> Workload:
    """What the memory and step-time models price for `run` on `world` ranks of `device`, over
    `nodes` machines."""
    prec = run.precision.resolved(device).precision
    t = run.train
    return Workload(run.model, t.micro_batch, world, prec, device, t.steps, nodes)


def plan_run(run, hw: Hardware, r: Rates, fixed: Fixed) -> Plans:
    """Every plan for `run` on `hw`, the chosen one first (nothing allocated)."""
    # ranks: every node's GPUs, or a CPU run's processes
    work = workload_of(run, hw.world, hw.device, hw.nnodes)
    f = fixed.with_(nvme_path=run.engine.nvme_path)  # the disk the user offered
    if "compile" not in f:  # --compile as the run asks it; each plan resolves it
        f = f.with_(compile=run.engine.compile)  # (plan/candidate.py settle_compile)
    cands = plan(work, run.train.grad_accum, hw, r, f)
    return Plans(cands, work, run.train.grad_accum, hw, r, fixed)


def plan_engine(run, ctx: DistContext, fixed: Fixed, force: bool, log=print):
    """`run` with its EngineConfig replaced by the planner's choice (fixed fields kept).

    Rank 0 decides and broadcasts, so every rank of a multi-machine job runs the same plan even
    when their free memory differs. Refuses (UserError) before anything is allocated when the
    plan cannot fit, unless `force` (then the leanest plan is tried: capacity is measured).
    """

    def decide() -> dict:
        hw = hardware.for_run(run.engine, ctx.world, ctx.device.type)
        r = rates.for_run(hw.gpu_name, run.engine)
        plans = plan_run(run, hw, r, fixed)
        if not plans.fits and not force:
            raise UserError(plans.refusal() + " (--force tries anyway)")
        log(plans.summary())
        if hw.nnodes > 1:  # the figure the plan's collectives between nodes were priced at
            log(f"between nodes: {r.inter_node_gbit:.3g} Gb/s per GPU ({r.inter_node_source})")
        return dataclasses.asdict(plans.best.ecfg)

    ecfg = decided_on_rank0(ctx, decide)
    ecfg["cpu_mem"] = run.engine.cpu_mem  # the machine's RAM as stated: the engine checks it too
    ecfg["gpu_mem"] = run.engine.gpu_mem  # the GPU's share as stated: the engine caps it
    ecfg["inter_node_gbps"] = run.engine.inter_node_gbps  # the link as stated
    return dataclasses.replace(run, engine=EngineConfig(**ecfg))
