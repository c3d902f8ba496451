"""The planner: enumerate plans, predict memory and speed, keep those that fit, choose the fastest.

A plan is an EngineConfig (engine, ZeRO stage, activation checkpointing, offload placement, the
optimizer state's storage formats). Fit means: the allocator peak plus context and a
fragmentation margin within each GPU, the host bytes of every rank on this machine within usable
RAM, and the disk tier within the disk's free space. The formats climb a ladder (plan/formats.py):
fp32 state whenever some plan fits with it, else the least compact rung with which one does; of
the plans that fit at that rung, the fastest. Where that plan offloads optimizer state on a GPU
machine, a more compact rung (formats in AUTO_FORMATS only) is chosen when its fastest plan takes
at least 10% less time: the host AdamW steps bf16 moments in 0.43 of fp32 state's time, and the
room they free keeps more blocks on the GPU. That costs no accuracy the planner does not already
accept for room: a split master leaves the forward's bf16 weights unchanged, and bf16 moments
kept the loss within the seed noise (1.56 B, 1,000 steps). A request that fits nowhere is
refused before anything is allocated, naming the shortfall and what would fit instead.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from fitgpt import units
from fitgpt.engine import validate
from fitgpt.engine.config import EngineConfig
from fitgpt.engine.fixed import Fixed
from fitgpt.engine.placement import Placement
from fitgpt.errors import UserError
from fitgpt.parallel.shard import tensor_parallel_refusal, tp_divisors
from fitgpt.plan import formats
from fitgpt.plan.hardware import Hardware
from fitgpt.plan.memory import (
    GPU_SAFETY_MARGIN,
    Estimate,
    GiB,
    Workload,
    estimate,
    gpu_budget,
    layout_of,
    placement_of,
)
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
    placement: Placement | None = None  # the zero engine's (None for ddp)
    disk_written: int = 0  # bytes written per optimizer step to this machine's disk tier
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
            n = sum(1 for c in p.chunks if c.block)
            off = f", optimizer of {p.offloaded_blocks} of {n} blocks offloaded"
            if e.offload_optimizer == "nvme":
                off += f" ({p.nvme_blocks} of those on nvme, the rest on cpu)"
            else:
                off += " to cpu"
            if e.offload_params == "cpu":
                off += ", their weights streamed from cpu"
        tp = f", tensor-parallel {e.tensor_parallel}" if e.tensor_parallel > 1 else ""
        return f"{base}{tp}, checkpointing {e.checkpointing}{off}{formats.label(self.formats)}"


def tp_degrees(work: Workload, fixed: Fixed) -> list[int]:
    """The tensor-parallel degrees to price: the one the user gave (default 1), or with auto
    (0) every T that divides the ranks, the heads, 4·hidden and the padded vocabulary (and the
    sequence, with --sequence-parallel: parallel/shard.py tp_divisors, the rule train checks)."""
    t = fixed.tensor_parallel
    if t != 0:
        why = tensor_parallel_refusal(t, work.model, work.world, fixed.sequence_parallel)
        if why:  # callers validate first (engine/validate.py); a T that cannot split is no plan
            raise UserError(why)
        return [t]
    return tp_divisors(work.model, work.world, fixed.sequence_parallel)


def enumerate_plans(world: int, fixed: Fixed) -> list[EngineConfig]:
    """Every plan the engines can run, restricted to the fields the user fixed (a plan those
    fields rule out, such as ddp with an offload flag, is left out)."""
    stages = [0, 1, 2, 3] if world > 1 else [0]
    plans = [EngineConfig(engine="ddp", checkpointing=ck) for ck in ("off", "full")]
    plans += [
        EngineConfig(engine="zero", zero_stage=s, checkpointing=ck)
        for s in stages
        for ck in ("off", "full")
    ]
    if "offload_optimizer" not in fixed:
        # block counts imply their tier (engine/validate.py: implied_tier), and streamed
        # weights imply the host tier: a count the planner then ignored would change nothing
        tier = validate.implied_tier(fixed)
        if tier == "none" and fixed.offload_params not in (None, "none"):
            tier = "cpu"
        if tier != "none":
            fixed = fixed.with_(offload_optimizer=tier)
    out = []
    for p in plans:
        if not fixed.agrees(p, ("engine", "zero_stage", "checkpointing")):
            continue
        try:
            out.append(fixed.applied(p))
        except UserError:
            continue  # the fixed fields rule this engine out
    if not out and fixed.names:
        out = [fixed.applied(EngineConfig())]  # its error
    return out


def runnable(work: Workload, e: EngineConfig) -> bool:
    """Whether train would run plan `e` for this work (engine/validate.py: the one validation
    of a run's settings): a plan it would refuse is never a candidate."""
    why = validate.refusal(work.model, e, work.precision, work.world, work.device, planning=True)
    return why is None


def evaluate(
    work: Workload, grad_accum: int, hw: Hardware, rates: Rates, ecfg: EngineConfig, layout=None
) -> Candidate:
    layout = layout or layout_of(work.model)
    placement = placement_of(work, ecfg, layout) if ecfg.engine == "zero" else None
    est = estimate(work, ecfg, layout, placement)
    t = step_time(work, ecfg, grad_accum, rates, placement)
    ranks_here = hw.gpus if hw.device == "cuda" else work.world
    gpu_short = est.compute_total - gpu_budget(hw.gpu_mem) if hw.device == "cuda" else 0
    host_short = est.host_total * ranks_here - hw.cpu_mem if hw.cpu_mem else 0
    disk = sum(est.nvme.values()) * ranks_here
    disk_short = 0
    if disk:
        # nvme_free is already net of the spare room the store leaves (engine/nvme.py)
        disk_short = disk - hw.nvme_free if hw.nvme_path else disk
    written = placement.disk_traffic()[1] * ranks_here if placement else 0
    return Candidate(ecfg, est, t, gpu_short, host_short, disk_short, placement, written)


def plan(
    work: Workload,
    grad_accum: int,
    hw: Hardware,
    rates: Rates,
    fixed: Fixed | Mapping[str, Any] | None = None,
) -> list[Candidate]:
    """All candidates, the chosen one first: of the least compact formats with which some plan
    fits without the disk, the fastest plan (ties: the smaller peak), unless that plan offloads
    optimizer state and a more compact rung's plan, in RAM, takes at least SPEED_MARGIN less
    time: then the fastest such plan. The disk comes after the formats: a step that streams its
    state through the disk is several times slower (14.11 B: 56 s/step on the H100, against
    ~10 s for the plans in RAM around that size) and wears the SSD, while AUTO_FORMATS holds
    only formats whose loss cost was measured within the noise. Where no rung fits without the
    disk, the least compact rung that fits with it. Rungs above the first that fits are priced
    only when its fastest plan offloads on a GPU machine (whose host AdamW is faster on compact
    state), without the disk, and only their plans that fit are kept. `fixed`: the engine
    fields the user set (a dict is read as Fixed.of(dict))."""
    fixed = Fixed.of(fixed)
    layout = layout_of(work.model)
    bases = [
        b
        for t in tp_degrees(work, fixed)  # T × (world/T): the stages shard over world/T ranks
        for b in enumerate_plans(work.dp_ranks(t), fixed.with_(tensor_parallel=t))
    ]
    cands: list[Candidate] = []
    seen: set[EngineConfig] = set()
    first: Candidate | None = None  # the fastest plan in RAM of the first rung that has one
    for rung, fmt in enumerate(formats.rungs(fixed, work.precision)):
        for b in bases:
            e = formats.with_formats(b, fmt)
            if e is None:
                continue  # this engine cannot store its state so
            for c in plans_of(work, grad_accum, hw, rates, e, layout, fixed):
                c.ecfg, c.rung = formats.settled(c.ecfg, c.placement), rung
                if not runnable(work, c.ecfg):
                    continue  # train would refuse it (engine/validate.py)
                if first is not None and not in_ram(c):
                    continue  # priced for speed alone: a plan that needs more room adds nothing
                if c.ecfg not in seen:  # a format for an empty tier repeats a lower rung's plan
                    seen.add(c.ecfg)
                    cands.append(c)
        if first is None and any(in_ram(c) for c in cands):
            first = min((c for c in cands if in_ram(c)), key=speed)
            if not offloads(first) or hw.device != "cuda":
                # compact state is faster only in the host tier's update, through the native
                # kernel that GPU machines use (engine/hostkernel.py; CPU runs take torch's path)
                break
            # the rungs above are priced for speed alone, without the disk (a plan that streams
            # its state through it is never chosen over one in RAM)
            hw = dataclasses.replace(hw, nvme_path="", nvme_free=0)

    if not cands:  # every plan the fixed fields leave is one train refuses: say why
        why = (
            validate.refusal(work.model, b, work.precision, work.world, work.device) for b in bases
        )
        raise UserError(next((w for w in why if w), "no plan train runs is left by these flags"))

    def rank(c: Candidate) -> int:
        """The rung, or the first fitting rung's for a plan that wins there by speed."""
        if first is not None and c.rung > first.rung and faster(c, first):
            return first.rung
        return c.rung

    cands.sort(
        key=lambda c: (
            not c.fits,
            uses_disk(c) if c.fits else 0,
            rank(c) if c.fits else 0,
            c.compared_time if c.fits else shortfall(c),  # unfitting: the leanest first
            c.est.compute_total,
            c.ecfg.engine != "zero",
        )
    )
    return cands


# A more compact rung is chosen for speed only where its plan takes at least this share less
# time than the least compact rung's that fits: the step time is a prediction, and bf16 moments
# round m and v each step (within the loss noise at 1.56 B, but not free), so a near tie keeps
# the less compact state.
SPEED_MARGIN = 0.10


def speed(c: Candidate) -> tuple:
    """How plans that fit compare (the sort's tail): step time, then the smaller peak."""
    return (c.compared_time, c.est.compute_total, c.ecfg.engine != "zero")


def faster(c: Candidate, than: Candidate) -> bool:
    """Whether `c` fits in RAM and saves SPEED_MARGIN of `than`'s step time."""
    return in_ram(c) and c.compared_time <= (1 - SPEED_MARGIN) * than.compared_time


def in_ram(c: Candidate) -> bool:
    """Fits on the GPU and in host RAM without the disk tier."""
    return c.fits and not uses_disk(c)


def offloads(c: Candidate) -> bool:
    """Whether some blocks' optimizer state is updated on the host."""
    return c.placement is not None and c.placement.offloaded_blocks > 0


def uses_disk(c: Candidate) -> bool:
    return c.placement is not None and c.placement.nvme_blocks > 0


def plans_of(work, grad_accum, hw, rates, e: EngineConfig, layout, fixed: Fixed) -> list[Candidate]:
    """`e` as it is, and its variants with the fewest blocks offloaded that fit (if any): the
    optimizer state alone, and with the offloaded blocks' weights streamed too. Both are priced
    because neither always wins: streaming moves each offloaded block's weights every pass, but
    frees their GPU copies, so fewer blocks need the slower host update. At 13b on an H100 the
    streamed plan (33 blocks on the host) stepped 5.2-5.3 s compiled, the unstreamed one (40)
    6.3 s
    (results/offload_compile_h100_2026-11-24); priced alone, the first that fits was taken."""
    base = evaluate(work, grad_accum, hw, rates, e, layout)
    out = [base]
    for stream in (False, True):
        off = offloaded_variant(work, grad_accum, hw, rates, e, layout, fixed, base, stream)
        if off is not None and all(off.ecfg != c.ecfg for c in out):
            out.append(off)
    return out


def can_stream(work: Workload, e: EngineConfig, fixed: Fixed) -> bool:
    """Whether the planner may stream the offloaded blocks' weights: not where the user ruled it
    out, and on several ranks only at ZeRO stage 3 (each rank streams its shard; the engine
    refuses stages 1-2)."""
    dp = work.dp_ranks(e.tensor_parallel)
    return fixed.offload_params != "none" and (dp == 1 or e.zero_stage >= 3)


def offloaded_variant(
    work,
    grad_accum,
    hw,
    rates,
    e: EngineConfig,
    layout,
    fixed: Fixed,
    base: Candidate,
    stream: bool = False,
) -> Candidate | None:
    """Fill the GPU first: the plan with the fewest (last) blocks' optimizer state on the host
    that fits the GPU, their weights streamed from host RAM too when `stream` (or when the
    optimizer state alone is not enough, or the user asked for it). None when the engine cannot
    offload, the user ruled offload out, the plan fits without it (unless the user asked for
    offload), or `stream` and the weights cannot be streamed."""
    if e.engine != "zero" or fixed.offload_optimizer == "none" or hw.device != "cuda":
        return None
    forced = fixed.offload_optimizer == "cpu"
    if "offload_blocks" in fixed or (base.fits and not forced):
        return None  # the fraction was given (base already is that plan), or nothing to offload
    if stream and not can_stream(work, e, fixed):
        return None
    if fixed.offload_optimizer == "nvme" or (fixed.offload_optimizer != "cpu" and hw.nvme_path):
        v = spill_variant(work, grad_accum, hw, rates, e, layout, fixed, stream)
        if v is not None:
            return v
    L = work.model.n_layer
    stream = stream or e.offload_params == "cpu"

    def with_k(k: int) -> Candidate:
        cfg = dataclasses.replace(
            e,
            offload_optimizer="cpu",
            offload_blocks=k,
            offload_params="cpu" if stream else "none",
        )
        return evaluate(work, grad_accum, hw, rates, cfg, layout)

    lo, hi = (
        (1 if forced else 0),
        L,
    )  # the fewest offloaded blocks that fit the GPU lies in (lo, hi]
    if with_k(hi).gpu_short > 0 and not stream and can_stream(work, e, fixed):
        stream = True  # the optimizer state alone is not enough: stream the weights too
    if with_k(hi).gpu_short > 0:
        return with_k(hi)  # even all blocks on the host do not fit the GPU: report the leanest
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if with_k(mid).gpu_short <= 0 else (mid, hi)
    return with_k(hi)


def spill_variant(
    work, grad_accum, hw, rates, e: EngineConfig, layout, fixed: Fixed, stream: bool = False
) -> Candidate | None:
    """Three tiers: the fewest (last) blocks offloaded that fit the GPU, and of those the fewest
    (last) on the disk that fit the host RAM. None when host RAM alone holds them (the cpu-only
    variant is then as good and faster) unless the user asked for nvme. As on the host tier, the
    offloaded blocks' weights are streamed from host RAM when their optimizer state alone leaves
    the GPU short (or when `stream`)."""
    L = work.model.n_layer
    want_nvme = fixed.offload_optimizer == "nvme"
    stream = stream or e.offload_params == "cpu"

    def with_kd(k: int, d: int) -> Candidate:
        cfg = dataclasses.replace(
            e,
            offload_optimizer="nvme",
            offload_blocks=k,
            nvme_blocks=d,
            nvme_path=hw.nvme_path or e.nvme_path,
            offload_params="cpu" if stream else "none",
        )
        return evaluate(work, grad_accum, hw, rates, cfg, layout)

    if with_kd(L, L).gpu_short > 0 and not stream and can_stream(work, e, fixed):
        stream = True
    if with_kd(L, L).gpu_short > 0:
        return None  # not even every block on the disk fits the GPU
    lo, hi = 0, L  # the fewest offloaded blocks that fit the GPU lie in (lo, hi]
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if with_kd(mid, mid).gpu_short <= 0 else (mid, hi)
    k = hi
    if with_kd(k, 0).host_short <= 0 and not want_nvme:
        return None  # RAM holds every offloaded block
    lo, hi = (0, k) if with_kd(k, k).host_short <= 0 else (k, k)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if with_kd(k, mid).host_short <= 0 else (mid, hi)
    return with_kd(k, max(hi, 1 if want_nvme else 0))


def why(chosen: Candidate, cands: list[Candidate]) -> str:
    fitting = [c for c in cands if c.fits]
    if chosen.est.compute:
        budget = chosen.est.compute_total - chosen.gpu_short
        room = (
            f"peak {chosen.est.compute_total / GiB:.1f} of {budget / GiB:.1f} GiB per GPU "
            f"(the GPU less a {100 * GPU_SAFETY_MARGIN:.0f}% safety margin)"
        )
    else:
        room = f"{chosen.est.host_total / GiB:.1f} GiB of host RAM per rank"
    if not chosen.fits:  # --force (and capacity trials): the leanest plan, tried anyway
        short = ", ".join(
            f"{what} short by {x / GiB:.1f} GiB"
            for what, x in (
                ("GPU", chosen.gpu_short),
                ("host RAM", chosen.host_short),
                ("disk", chosen.disk_short),
            )
            if x > 0
        )
        return f"no plan is predicted to fit ({short}), the leanest tried anyway; {room}"
    state = state_reason(chosen, fitting)
    if len(fitting) == 1:
        return f"{state}the only plan that fits; {room}"
    near = [c for c in fitting if c.rung > chosen.rung and in_ram(c) and speed(c) < speed(chosen)]
    if near:  # a more compact rung's plan is faster, by less than the margin
        f = min(near, key=speed)
        saved = 1 - f.compared_time / chosen.compared_time
        return (
            f"{state}of {len(fitting)} plans that fit, {f.name} takes {100 * saved:.0f}% less "
            f"time, under the {100 * SPEED_MARGIN:.0f}% margin for more compact state; {room}"
        )
    runner_up = fitting[1]
    gain = runner_up.compared_time / chosen.compared_time - 1
    return (
        f"{state}fastest of {len(fitting)} plans that fit, {100 * gain:.0f}% ahead of "
        f"{runner_up.name}; {room}"
    )


def state_reason(chosen: Candidate, fitting: list[Candidate]) -> str:
    """Why the chosen plan's formats are as compact as they are ("" for the first rung)."""
    lower = [c for c in fitting if c.rung < chosen.rung]
    in_ram_lower = [c for c in lower if in_ram(c)]
    if in_ram_lower and in_ram(chosen):  # chosen for speed over the first rung that fits
        first = min(c.rung for c in in_ram_lower)
        base = min((c for c in in_ram_lower if c.rung == first), key=speed)
        gain = base.compared_time / chosen.compared_time - 1
        what = "fp32" if formats.label(base.formats) == "" else formats.short(base.formats)
        return f"compact state: {100 * gain:.0f}% faster than {what} state; "
    if lower:
        return "compact optimizer state keeps the disk out (less compact fits only with it); "
    if chosen.rung:
        return "no plan fits with less compact optimizer state; "
    return ""


def shortfall(c: Candidate) -> int:
    """Bytes the plan is short of, over every tier that is short (room elsewhere cannot help)."""
    return max(c.gpu_short, 0) + max(c.host_short, 0) + max(c.disk_short, 0)


def leanest(cands: list[Candidate]) -> Candidate:
    return min(cands, key=shortfall)


def largest_layers(
    work: Workload, grad_accum: int, hw: Hardware, rates: Rates, fixed: Fixed
) -> int:
    """The most layers of this width that fit with some plan (0 if none)."""
    lo, hi = 0, max(1, work.model.n_layer)
    while fits_layers(work, grad_accum, hw, rates, fixed, hi):
        lo, hi = hi, hi * 2
        if hi > 4096:
            return lo
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits_layers(work, grad_accum, hw, rates, fixed, mid) else (lo, mid)
    return lo


def fits_layers(work, grad_accum, hw, rates, fixed, layers: int) -> bool:
    w = dataclasses.replace(work, model=work.model.replace(n_layer=layers))
    return any(c.fits for c in plan(w, grad_accum, hw, rates, fixed))


def largest_micro_batch(
    work: Workload, grad_accum: int, hw: Hardware, rates: Rates, fixed: Fixed
) -> int:
    best = 0
    for b in (1, 2, 4, 8, 16, 32, 64):
        if b >= work.micro_batch and best:
            break
        if any(
            c.fits
            for c in plan(dataclasses.replace(work, micro_batch=b), grad_accum, hw, rates, fixed)
        ):
            best = b
    return best


def refusal(
    work: Workload,
    grad_accum: int,
    hw: Hardware,
    rates: Rates,
    cands: list[Candidate],
    fixed: Fixed | Mapping[str, Any] | None,
) -> str:
    fixed = Fixed.of(fixed)
    lean = leanest(cands)
    m = work.model
    need = []
    if lean.gpu_short > 0:
        need.append(
            f"{lean.est.compute_total / GiB:.1f} GiB per GPU (may use {gpu_budget(hw.gpu_mem) / GiB:.1f} "
            f"of {hw.gpu_mem / GiB:.1f}, short by {lean.gpu_short / GiB:.1f})"
        )
    if lean.host_short > 0:
        need.append(
            f"{lean.est.host_total * max(1, hw.gpus) / GiB:.1f} GiB of host RAM (has {hw.cpu_mem / GiB:.1f}, short by {lean.host_short / GiB:.1f})"
        )
    if lean.disk_short > 0:
        need.append(
            f"{sum(lean.est.nvme.values()) / GiB:.1f} GiB on the nvme tier "
            f"(has {hw.nvme_free / GiB:.1f}, short by {lean.disk_short / GiB:.1f})"
        )
    layers = largest_layers(work, grad_accum, hw, rates, fixed)
    alt = []
    if layers:
        size = units.params(m.replace(n_layer=layers).num_params())
        alt.append(
            f"{layers} layers of this width ({size} parameters) at micro-batch {work.micro_batch}"
        )
    mb = largest_micro_batch(work, grad_accum, hw, rates, fixed)
    if mb:
        alt.append(f"this model at micro-batch {mb}")
    # int8 moments are never chosen by themselves (their loss cost), but name them where they
    # would make this very model fit
    if fixed.format("moments") == "auto" and "int8" not in formats.AUTO_FORMATS:
        try:
            fits8 = any(
                c.fits for c in plan(work, grad_accum, hw, rates, fixed.with_(moments="int8"))
            )
        except UserError:  # the fixed fields rule compact moments out (--engine ddp)
            fits8 = False
        if fits8:
            alt.append("this model with --moments int8 (a loss cost: docs/offload.md)")
    what = " or ".join(alt) if alt else "nothing of this width"
    return (
        f"{units.params(m.num_params())} parameters at micro-batch {work.micro_batch} do not fit: the leanest "
        f"plan ({lean.name}) needs {' and '.join(need)}; what fits: {what}"
    )


def choose(
    work: Workload,
    grad_accum: int,
    hw: Hardware,
    rates: Rates,
    fixed: Fixed | Mapping[str, Any] | None = None,
    force: bool = False,
) -> tuple[Candidate, list[Candidate]]:
    """The chosen plan and all candidates; a UserError naming the shortfall if none fits."""
    fixed = Fixed.of(fixed)
    cands = plan(work, grad_accum, hw, rates, fixed)
    if not cands[0].fits and not force:
        raise UserError(
            refusal(work, grad_accum, hw, rates, cands, fixed) + " (--force tries anyway)"
        )
    return cands[0], cands
