"""One priced plan, a `Candidate`: its EngineConfig, predicted bytes and step time, and what it
is short of on this machine; and how candidates compare (the planner's sort, plan/planner.py).

`evaluate` prices one EngineConfig through its Placement (each chunk's tier and sharding: the
prices read those flags, never the ZeRO stage or the engine's name): the memory model's bytes
(plan/memory.py) and the step-time model's seconds (plan/throughput.py), against the GPU budget,
the host RAM of every rank on this machine and the disk's free space.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator
from contextvars import ContextVar
from dataclasses import dataclass

from fitgpt.engine.chunked.placement import Placement
from fitgpt.engine.config import EngineConfig
from fitgpt.engine.transforms.compile import SCOPES, compile_scope
from fitgpt.model.families import family_of
from fitgpt.plan import formats
from fitgpt.plan.hardware import Hardware
from fitgpt.plan.memory import Estimate, Workload, estimate, gpu_budget, layout_of, placement_of
from fitgpt.plan.rates import Rates
from fitgpt.plan.throughput import step_time


@dataclass
class Candidate:
    ecfg: EngineConfig
    est: Estimate
    time: dict[str, float]
    gpu_short: int  # bytes over the GPU budget (<= 0: fits)
    host_short: int
    disk_short: int = 0  # bytes of the nvme tier over the disk's free space
    # what each chunk's state does under this plan (ddp's: chunked False; evaluate sets it)
    placement: Placement | None = None
    disk_written: int = 0  # bytes written per optimizer step to this machine's disk tier
    disk: int = 0  # bytes of the nvme tier's files on this machine (every rank's)
    rung: int = 0  # the formats' rung on the ladder this run climbs (0: fp32 unless fixed)

    @property
    def fits(self) -> bool:
        return self.gpu_short <= 0 and self.host_short <= 0 and self.disk_short <= 0

    @property
    def tp(self) -> int:
        return max(1, self.ecfg.tensor_parallel)

    @property
    def compared_time(self) -> float:
        """Seconds for the tokens of one step without tensor parallelism: a T-way plan's step
        takes 1/T of them (T ranks share each micro-batch), so plans compare per token."""
        return self.time["total"] * self.tp

    @property
    def formats(self) -> formats.Formats:
        """(master, offloaded moments, device moments) as stored; "-" for an empty tier."""
        return formats.in_effect(self.placement)

    @property
    def name(self) -> str:
        e = self.ecfg
        base = "ddp" if e.engine == "ddp" else f"zero-{e.zero_stage}"
        off = ""
        if e.offload_optimizer != "none":
            p = self.placement
            n = len({c.spec.layer for c in p.chunks if c.block})
            what = "experts' optimizer" if e.offload_experts else "optimizer"
            off = f", {what} of {p.offloaded_blocks} of {n} blocks offloaded"
            if e.offload_optimizer == "nvme":
                off += f" ({p.nvme_blocks} of those on nvme, the rest on cpu)"
            else:
                off += " to cpu"
            if e.offload_params == "cpu":
                off += ", their weights streamed from cpu"
        tp = f", tensor-parallel {e.tensor_parallel}" if e.tensor_parallel > 1 else ""
        tp += f", expert-parallel {e.expert_parallel}" if e.expert_parallel > 1 else ""
        tp += ", sharded within each node" if e.shard_within == "node" else ""
        comp = {"blocks": ", compiled", "model": ", compiled whole"}.get(e.compile, "")
        k = e.keep_activations
        kept = f" (the last {k} blocks kept)" if k > 1 else " (the last block kept)" if k else ""
        return (
            f"{base}{tp}, checkpointing {e.checkpointing}{kept}{off}{comp}"
            f"{formats.label(self.formats)}"
        )


# The plans priced so far in this planning call (`priced_once`), or None outside one.
_PRICED: ContextVar[dict | None] = ContextVar("priced", default=None)


@contextlib.contextmanager
def priced_once() -> Iterator[None]:
    """Within it, `evaluate` prices each (work, grad_accum, hw, rates, ecfg) once. A refusal
    plans the model again for every alternative it names, and plan() prices its plans again
    with --checkpointing cpu among them: 70 B on 8 80 GiB GPUs priced 2,981 plans 8,497 times
    (9 s on a CPU before the refusal's line). Scoped to one call, not kept for the process: what
    a price reads besides its arguments (the rates' source, the modules' settings) cannot change
    under it. Nested scopes share the outermost one's prices."""
    token = _PRICED.set({}) if _PRICED.get() is None else None
    try:
        yield
    finally:
        if token is not None:
            _PRICED.reset(token)


def evaluate(
    work: Workload, grad_accum: int, hw: Hardware, rates: Rates, ecfg: EngineConfig, layout=None
) -> Candidate:
    """`ecfg` priced for this work on this machine (`layout`: the work's own, layout_of; given
    only to save rebuilding it). Within priced_once, a plan priced before is returned as a copy
    (plan/planner.py sets the copy's settled formats and rung)."""
    memo = _PRICED.get()
    if memo is None:
        return _evaluate(work, grad_accum, hw, rates, ecfg, layout)
    key = (work, grad_accum, hw, rates, ecfg)
    if key not in memo:
        memo[key] = _evaluate(work, grad_accum, hw, rates, ecfg, layout)
    return dataclasses.replace(memo[key])


def _evaluate(
    work: Workload, grad_accum: int, hw: Hardware, rates: Rates, ecfg: EngineConfig, layout=None
) -> Candidate:
    layout = layout or layout_of(work.model)
    placement = placement_of(work, ecfg, layout)
    ecfg = settle_compile(work, grad_accum, rates, ecfg, placement)
    est = estimate(work, ecfg, layout, placement)
    t = step_time(work, ecfg, grad_accum, rates, placement)
    ranks_here = hw.gpus if hw.device == "cuda" else work.ranks_per_node  # on one node
    gpu_short = est.compute_total - gpu_budget(hw.gpu_mem) if hw.device == "cuda" else 0
    host_short = est.host_total * ranks_here - hw.cpu_mem if hw.cpu_mem else 0
    disk = sum(est.nvme.values()) * ranks_here
    disk_short = 0
    if disk:
        # nvme_free is already net of the spare room the store leaves (engine/host/nvme.py)
        disk_short = disk - hw.nvme_free if hw.nvme_path else disk
    written = placement.disk_traffic()[1] * ranks_here
    return Candidate(ecfg, est, t, gpu_short, host_short, disk_short, placement, written, disk=disk)


def settle_compile(
    work: Workload, grad_accum: int, rates: Rates, ecfg: EngineConfig, placement
) -> EngineConfig:
    """`ecfg` with --compile resolved for this plan (engine/transforms/compile.py compile_scope, the
    one decision): auto weighs the compile against this plan's own eager step time times the run's
    steps; the scope follows this plan's placement. What comes back is what is priced, then
    built."""
    if ecfg.compile in SCOPES:
        return ecfg
    run_s = 0.0
    if ecfg.compile == "auto" and work.device == "cuda":
        eager = dataclasses.replace(ecfg, compile="off")
        run_s = work.steps * step_time(work, eager, grad_accum, rates, placement)["total"]
    resident = placement.resident
    scope = compile_scope(
        ecfg.compile, ecfg.engine, work.device, work.model.n_embd, work.world, resident,
        ecfg.checkpointing, run_s, family_of(work.model).compiled_checkpointed,
    )  # fmt: skip
    return dataclasses.replace(ecfg, compile=scope)


def speed(c: Candidate) -> tuple:
    """How plans that fit compare (the sort's tail): step time, then activations kept on the
    GPU over pinned host RAM (--checkpointing cpu takes pinned pages and shares the link with
    the optimizer's offload traffic: chosen only when it is faster or alone fits), then the
    smaller peak."""
    return (
        c.compared_time,
        c.ecfg.checkpointing == "cpu",
        c.est.compute_total,
        c.ecfg.engine != "zero",
    )


def in_ram(c: Candidate) -> bool:
    """Fits on the GPU and in host RAM without the disk tier."""
    return c.fits and not uses_disk(c)


def offloads(c: Candidate) -> bool:
    """Whether some blocks' optimizer state is updated on the host."""
    return c.placement.offloaded_blocks > 0


def uses_disk(c: Candidate) -> bool:
    return c.placement.nvme_blocks > 0


def shortfall(c: Candidate) -> int:
    """Bytes the plan is short of, over every tier that is short (room elsewhere cannot help)."""
    return max(c.gpu_short, 0) + max(c.host_short, 0) + max(c.disk_short, 0)


def leanest(cands: list[Candidate]) -> Candidate:
    return min(cands, key=shortfall)
