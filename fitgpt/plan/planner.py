"""The planner: enumerate plans, predict memory and speed, keep those that fit, choose the fastest.

A plan is an EngineConfig (engine, ZeRO stage, activation checkpointing, offload placement, the
optimizer state's storage formats). Fit means: the allocator peak plus context and a fragmentation
margin within each GPU, the host bytes of every rank on this machine within usable RAM, and the
disk tier within the disk's free space. The formats climb a ladder (plan/formats.py): fp32 state
whenever some plan fits with it, else the least compact rung with which one does; of the plans that
fit at that rung, the fastest. Where that plan offloads optimizer state on a GPU machine, a more
compact rung (formats in AUTO_FORMATS only) is chosen when its fastest plan takes at least 10% less
time (any less, where it only splits the master: faster()): the host AdamW steps bf16 moments in
0.43 of fp32 state's time, and the room they free keeps more blocks on the GPU. That costs no
accuracy the planner does not already accept for room: a split master leaves the forward's bf16
weights unchanged, and bf16 moments kept the loss within the seed noise (1.56 B, 1,000 steps). A
request that fits nowhere is refused before anything is allocated, naming the shortfall and what
would fit instead.

The plans, their offloaded variants and, under checkpointing full, the most blocks each keeps
unrecomputed that still fit come from plan/enumeration.py, each priced as a Candidate
(plan/candidate.py, with the comparisons the sort below uses); this file climbs the ladder,
sorts, says why the chosen plan won (`why`) and words the refusal (`refusal`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from fitgpt import units
from fitgpt.engine.config import EngineConfig
from fitgpt.errors import UserError
from fitgpt.plan import formats, validate
from fitgpt.plan.candidate import (
    Candidate,
    in_ram,
    leanest,
    offloads,
    priced_once,
    shortfall,
    speed,
    uses_disk,
)
from fitgpt.plan.enumeration import (
    enumerate_plans,
    ep_degrees,
    plans_of,
    runnable,
    tp_degrees,
)
from fitgpt.plan.fixed import Fixed
from fitgpt.plan.hardware import Hardware
from fitgpt.plan.memory import GPU_SAFETY_MARGIN, GiB, Workload, gpu_budget, layout_of
from fitgpt.plan.rates import Rates

# A more compact rung is chosen for speed only where its plan takes at least this share less
# time than the least compact rung's that fits: the step time is a prediction, and bf16 moments
# round m and v each step (within the loss noise at 1.56 B, but not free), so a near tie keeps
# the less compact state. A rung that changes only the master to split (formats.lossless: the
# same bf16 weights, the master to the bit but for one ulp at rare ties) costs no accuracy, so
# any time it saves counts: Qwen3-30B-A3B on 4 H200s kept fp32 masters for a plan priced 5%
# slower than the split one (results/moe_x4_h200_2026-11-28).
SPEED_MARGIN = 0.10


def faster(c: Candidate, than: Candidate) -> bool:
    """Whether `c` fits in RAM and saves SPEED_MARGIN of `than`'s step time (any time, where
    its formats are lossless)."""
    if formats.lossless(c.formats, than.formats):
        return in_ram(c) and c.compared_time < than.compared_time
    return in_ram(c) and c.compared_time <= (1 - SPEED_MARGIN) * than.compared_time


def plan(
    work: Workload,
    grad_accum: int,
    hw: Hardware,
    rates: Rates,
    fixed: Fixed | Mapping[str, Any] | None = None,
) -> list[Candidate]:
    """All candidates, the chosen one first: of the least compact formats with which some plan fits
    without the disk, the fastest plan (ties: the smaller peak), unless that plan offloads
    optimizer state and a more compact rung's plan, in RAM, takes at least SPEED_MARGIN less time
    (any less where it only splits the master: faster()): then the fastest such plan. The disk
    comes after the formats: a step that streams its state through the disk is several times slower
    (14.11 B: 56 s/step on the H100, against ~10 s for the plans in RAM around that size) and wears
    the SSD, while AUTO_FORMATS holds only formats whose loss cost was measured within the noise.
    Where no rung fits without the disk, the least compact rung that fits with it. Rungs above the
    first that fits are priced only when its fastest plan offloads on a GPU machine (whose host
    AdamW is faster on compact state), without the disk, and only their plans that fit are kept.
    `fixed`: the engine fields the user set (a dict is read as Fixed.of(dict))."""
    fixed = Fixed.of(fixed)
    with priced_once():
        cands = plan_among(work, grad_accum, hw, rates, fixed, host_activations=False)
        none_fits = not any(c.fits for c in cands)
        if work.device == "cuda" and none_fits and "checkpointing" not in fixed:
            # the block inputs in pinned host RAM (--checkpointing cpu) only where nothing fits
            # without: the step model does not price its copies' share of the PCIe link with the
            # offloaded optimizer's and the streamed weights' traffic
            # (engine/transforms/activation.py)
            cands = plan_among(work, grad_accum, hw, rates, fixed, host_activations=True)
    return cands


def plan_among(
    work: Workload,
    grad_accum: int,
    hw: Hardware,
    rates: Rates,
    fixed: Fixed,
    host_activations: bool,
) -> list[Candidate]:
    """plan() over the engine configs enumerate_plans gives (`host_activations`: with
    --checkpointing cpu among them)."""
    layout = layout_of(work.model)
    bases = [
        b
        for t in tp_degrees(work, fixed)  # T × (world/T): the stages shard over world/T ranks
        for p in ep_degrees(work, fixed, t)  # P: the experts' chunks shard over world/P ranks
        for b in enumerate_plans(
            work.dp_ranks(t),
            fixed.with_(tensor_parallel=t, expert_parallel=p),
            host_activations,
            work.nodes,
        )
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
                    continue  # train would refuse it (plan/validate.py)
                if first is not None and not in_ram(c):
                    continue  # priced for speed alone: a plan that needs more room adds nothing
                if c.ecfg not in seen:  # a format for an empty tier repeats a lower rung's plan
                    seen.add(c.ecfg)
                    cands.append(c)
        if first is None and any(in_ram(c) for c in cands):
            first = min((c for c in cands if in_ram(c)), key=speed)
            if not offloads(first) or hw.device != "cuda":
                # compact state is faster only in the host tier's update, through the native
                # kernel that GPU machines use (engine/formats/hostkernel.py; CPU runs take torch's
                # path)
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
            *(
                speed(c)
                if c.fits
                else (shortfall(c), False, c.est.compute_total, c.ecfg.engine != "zero")
            ),
        )
    )
    return cands


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


def for_fit(fixed: Fixed | Mapping[str, Any] | None) -> Fixed:
    """`fixed` for a search that asks only whether some plan fits. Fit is decided at the kept
    count given, or 0 (enumeration.py most_kept adds blocks kept after, for speed), so a count
    the user did not give is fixed at 0 there: the same answer, without a bisection of the
    count for every plan that fits."""
    fixed = Fixed.of(fixed)
    return fixed if "keep_activations" in fixed else fixed.with_(keep_activations=0)


def fits_layers(work, grad_accum, hw, rates, fixed, layers: int) -> bool:
    w = dataclasses.replace(work, model=work.model.replace(n_layer=layers))
    return any(c.fits for c in plan(w, grad_accum, hw, rates, for_fit(fixed).within(layers)))


# Sequence lengths are searched in multiples of this (a flash kernel's tile divides it, and
# the packed loader's rows and the capacity search use the same step); shorter sequences in
# eighths of themselves.
SEQ_QUANTUM = 1024


def seq_quantum(seq_len: int) -> int:
    """The step of a sequence-length search below `seq_len`."""
    return SEQ_QUANTUM if seq_len >= 2 * SEQ_QUANTUM else max(1, seq_len // 8)


def fits_seq(work: Workload, grad_accum: int, hw, rates, fixed, seq_len: int) -> bool:
    w = dataclasses.replace(work, model=work.model.replace(seq_len=seq_len))
    return any(c.fits for c in plan(w, grad_accum, hw, rates, for_fit(fixed)))


def largest_seq_len(
    work: Workload,
    grad_accum: int,
    hw: Hardware,
    rates: Rates,
    fixed: Fixed,
    below: int = 0,
    quantum: int = 0,
) -> int:
    """The longest sequence, a multiple of `quantum` (default: seq_quantum's), shorter than
    `below` (default: the work's) with which this model fits at the work's micro-batch under
    some plan (0 if none): a bisection, ~log2(S/1024) plans (7 at 128k tokens)."""
    S = below or work.model.seq_len
    q = quantum or seq_quantum(S)
    lo, hi = 0, (S - 1) // q + 1  # in quanta: lo fits (0: nothing yet), hi does not
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits_seq(work, grad_accum, hw, rates, fixed, mid * q) else (lo, mid)
    return lo * q


def longest_that_fits(
    work: Workload, grad_accum: int, hw: Hardware, rates: Rates, fixed: Fixed
) -> list[tuple[int, int]]:
    """[(sequence length, micro-batch)] of the longest shorter sequences that fit this model,
    at the work's micro-batch and at micro-batch 1 (longer: a long context trains one sequence
    at a time); those that fit at all."""
    out = []
    for mb in dict.fromkeys((work.micro_batch, 1)):
        w = dataclasses.replace(work, micro_batch=mb)
        seq = largest_seq_len(w, grad_accum, hw, rates, fixed, below=work.model.seq_len)
        if seq and all(seq > s for s, _ in out):
            out.append((seq, mb))
    return out


def largest_micro_batch(
    work: Workload, grad_accum: int, hw: Hardware, rates: Rates, fixed: Fixed
) -> int:
    best, fixed = 0, for_fit(fixed)
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
    with priced_once():  # the alternatives below plan this model and its neighbours again
        return _refusal(work, grad_accum, hw, rates, cands, Fixed.of(fixed))


def _refusal(
    work: Workload,
    grad_accum: int,
    hw: Hardware,
    rates: Rates,
    cands: list[Candidate],
    fixed: Fixed,
) -> str:
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
            f"{lean.disk / GiB:.1f} GiB on the nvme tier "
            f"(has {hw.nvme_free / GiB:.1f}, short by {lean.disk_short / GiB:.1f})"
        )
    layers = largest_layers(work, grad_accum, hw, rates, fixed)
    alt = []
    if layers:
        size = units.params(m.replace(n_layer=layers).num_params())
        cut = fixed.within(layers).as_dict()  # a fixed block count above the depth: every block
        flags = "".join(
            f" with --{k.replace('_', '-')} {cut[k]}"
            for k in ("offload_blocks", "nvme_blocks")
            if k in cut and cut[k] != fixed.as_dict()[k]
        )
        alt.append(
            f"{layers} layers of this width ({size} parameters) at micro-batch "
            f"{work.micro_batch}{flags}"
        )
    mb = largest_micro_batch(work, grad_accum, hw, rates, fixed)
    if mb:
        alt.append(f"this model at micro-batch {mb}")
    else:  # not even one sequence of this length: the longest that fits
        for seq, seq_mb in longest_that_fits(work, grad_accum, hw, rates, fixed):
            alt.append(f"seq {seq} at micro-batch {seq_mb}")
    # int8 moments are never chosen by themselves (their loss cost), but name them where they
    # would make this very model fit
    if fixed.format("moments") == "auto" and "int8" not in formats.AUTO_FORMATS:
        try:
            int8 = for_fit(fixed).with_(moments="int8")
            fits8 = any(c.fits for c in plan(work, grad_accum, hw, rates, int8))
        except UserError:  # the fixed fields rule compact moments out (--engine ddp)
            fits8 = False
        if fits8:
            alt.append("this model with --moments int8 (a loss cost: docs/offload.md)")
    disk = disk_needed(work, grad_accum, hw, rates, fixed)
    if disk:
        alt.append(
            f"this model with ~{disk / GiB:.0f} GiB of optimizer state on a disk (fitgpt train "
            f"--nvme-path DIR, fitgpt plan --nvme DIR; every step reads and writes it)"
        )
    what = " or ".join(alt) if alt else "nothing of this width"
    return (
        f"{units.params(m.num_params())} parameters at micro-batch {work.micro_batch} do not fit: the leanest "
        f"plan ({lean.name}) needs {' and '.join(need)}; what fits: {what}"
    )


def disk_needed(work: Workload, grad_accum: int, hw: Hardware, rates: Rates, fixed: Fixed) -> int:
    """The least disk (every rank's files) with which this model would fit where the user gave
    no disk tier, for the refusal to name; 0 where a disk was given, the user keeps the state
    elsewhere, or no disk would do. Past GPU plus RAM the disk is the one way further (the
    ceiling of a box: docs/planner.md). With a disk of that size the planner takes the least
    compact rung that fits in it, which is the plan priced here or one needing no more."""
    if hw.nvme_path or hw.device != "cuda" or fixed.offload_optimizer not in (None, "nvme"):
        return 0
    boundless = dataclasses.replace(hw, nvme_path="(planned)", nvme_free=1 << 62)
    try:
        cands = plan(work, grad_accum, boundless, rates, for_fit(fixed))
    except UserError:
        return 0
    return min((c.disk for c in cands if c.fits), default=0)


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
    with priced_once():  # a refusal prices this plan's work again
        cands = plan(work, grad_accum, hw, rates, fixed)
        if not cands[0].fits and not force:
            raise UserError(
                refusal(work, grad_accum, hw, rates, cands, fixed) + " (--force tries anyway)"
            )
    return cands[0], cands
