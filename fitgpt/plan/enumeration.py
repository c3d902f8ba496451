"""The plans the planner prices: every EngineConfig the engines run, restricted to what the user
fixed (`enumerate_plans`, at each tensor-parallel degree `tp_degrees` gives), and for each the
variants that fill the GPU first: the fewest (last) blocks whose optimizer state moves to host
RAM, with or without their weights streamed from it, and with a disk given, the fewest of those
whose state moves on to the disk (`plans_of`): each a binary search over block counts; and
for each of those that fits under checkpointing full, the most last blocks that keep their
activations (`most_kept`, --keep-activations), when the user did not give that count.
"""

from __future__ import annotations

import dataclasses

from fitgpt.engine.config import EngineConfig
from fitgpt.errors import UserError
from fitgpt.model import family_of
from fitgpt.parallel.experts import expert_parallel_refusal
from fitgpt.parallel.shard import tensor_parallel_refusal, tp_divisors
from fitgpt.plan import validate
from fitgpt.plan.candidate import Candidate, evaluate
from fitgpt.plan.fixed import Fixed
from fitgpt.plan.memory import Workload, placement_of


def tp_degrees(work: Workload, fixed: Fixed) -> list[int]:
    """The tensor-parallel degrees to price: the one the user gave (default 1), or with auto
    (0) every T that divides the ranks and the model family's sizes (GPT-2: heads, 4·hidden,
    vocabulary; and the sequence, with --sequence-parallel: parallel/shard.py tp_divisors, the
    rule train checks)."""
    t = fixed.tensor_parallel
    if t != 0:
        why = tensor_parallel_refusal(t, work.model, work.world, fixed.sequence_parallel)
        if why:  # callers validate first (plan/validate.py); a T that cannot split is no plan
            raise UserError(why)
        return [t]
    return tp_divisors(work.model, work.world, fixed.sequence_parallel)


def ep_degrees(work: Workload, fixed: Fixed, tp: int) -> list[int]:
    """The expert-parallel degrees to price at T = tp: the one the user gave, or with auto
    (0, and when not given: Fixed.expert_parallel) 1 and every P that divides the ranks and the experts
    (parallel/experts.py expert_parallel_refusal, the rule train checks)."""
    p = fixed.expert_parallel
    if p != 0:
        return [p]
    cands = range(2, work.world + 1) if tp == 1 and fixed.context_parallel == 1 else []
    return [1] + [p for p in cands if not expert_parallel_refusal(p, work.model, work.world)]


def enumerate_plans(
    world: int, fixed: Fixed, host_activations: bool = False, nodes: int = 1
) -> list[EngineConfig]:
    """Every plan the engines can run, restricted to the fields the user fixed (a plan those
    fields rule out, such as ddp with an offload flag, is left out). `host_activations` (a
    GPU run): also --checkpointing cpu, the block inputs in pinned host RAM, which is what lets
    long sequences fit (Llama 3 8B at 128k tokens: 32 GiB of block inputs); on a CPU run it
    would keep them where they are, the same plan as full. On several `nodes`, each sharded
    stage also sharded within a node (--shard-within node, HSDP)."""
    stages = [0, 1, 2, 3] if world > 1 else [0]
    kinds = ("off", "full", "cpu") if host_activations else ("off", "full")
    # (given on one node it is the plain sharding: the planner prices what was asked)
    within = ("world", "node") if nodes > 1 or fixed.shard_within == "node" else ("world",)
    plans = [EngineConfig(engine="ddp", checkpointing=ck) for ck in kinds]
    plans += [
        EngineConfig(engine="zero", zero_stage=s, checkpointing=ck, shard_within=w)
        for w in within
        for s in stages
        for ck in kinds
        if w == "world" or s > 0
    ]
    if "offload_optimizer" not in fixed:
        # block counts imply their tier (plan/validate.py: implied_tier), and streamed
        # weights imply the host tier: a count the planner then ignored would change nothing
        tier = validate.implied_tier(fixed)
        if tier == "none" and fixed.offload_params not in (None, "none"):
            tier = "cpu"
        if tier == "none" and fixed.offload_experts:
            tier = "cpu"  # the experts alone offloaded imply the host tier as well
        if tier != "none":
            fixed = fixed.with_(offload_optimizer=tier)
    out = []
    for p in plans:
        if not fixed.agrees(p, ("engine", "zero_stage", "checkpointing", "shard_within")):
            continue
        try:
            out.append(fixed.applied(p))
        except UserError:
            continue  # the fixed fields rule this engine out
    if not out and fixed.names:
        out = [fixed.applied(EngineConfig())]  # its error
    return out


def runnable(work: Workload, e: EngineConfig) -> bool:
    """Whether train would run plan `e` for this work (plan/validate.py: the one validation
    of a run's settings): a plan it would refuse is never a candidate."""
    why = validate.refusal(work.model, e, work.precision, work.world, work.device, planning=True)
    return why is None


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
    kinds = [e.offload_experts]
    if "offload_experts" not in fixed and family_of(work.model).has_experts:
        # a mixture of experts: also the offloaded blocks' experts alone on the host (their
        # own chunks), attention and router resident (engine/chunked/placement.py)
        kinds.append(True)
    for experts in kinds:
        for stream in (False, True):
            off = offloaded_variant(
                work, grad_accum, hw, rates, e, layout, fixed, base, stream, experts
            )
            if off is not None and all(off.ecfg != c.ecfg for c in out):
                out.append(off)
    if "keep_activations" in fixed:  # given (or fixed at 0 by a search for fit alone)
        return out
    return [most_kept(work, grad_accum, hw, rates, c, layout) for c in out]


def most_kept(work, grad_accum, hw, rates, c: Candidate, layout) -> Candidate:
    """`c` with the most of its last blocks keeping their activations that still fits, if it
    fits under checkpointing full (else `c`). Fit is decided before, at the count `c` has (0
    unless given): the count only spends room left over, for speed, so every search for what
    fits (planner.py fits_seq, largest_layers) finds what it found without it. The memory
    estimate never falls as the count grows (memory.py activation_bytes) and the step time never
    rises (every exposed term is what a share under 1 of the compute leaves uncovered,
    throughput.py step_time), so a bisection on fit finds the fastest. Each count is priced as
    any plan is (evaluate), at `c`'s resolved --compile scope: re-weighing the compile at each
    count could change the scope, and the memory with it, mid-bisection. Up to n-1: n kept is
    checkpointing off with one block input more, and off is priced as itself. ~log2(n)
    plans: 6 at 48 blocks."""
    e = c.ecfg
    if e.checkpointing != "full" or not c.fits:
        return c

    def at(keep: int) -> Candidate:
        cfg = dataclasses.replace(e, keep_activations=keep)
        return evaluate(work, grad_accum, hw, rates, cfg, layout)

    lo, hi, best = e.keep_activations, work.model.n_layer, c  # at(lo) fits; hi: off's
    while hi - lo > 1:
        mid = (lo + hi) // 2
        q = at(mid)
        lo, hi, best = (mid, hi, q) if q.fits else (lo, mid, best)
    return best


def can_stream(work: Workload, e: EngineConfig, fixed: Fixed, layout=None) -> bool:
    """Whether the planner may stream the offloaded blocks' weights: not where the user ruled it
    out, and on several ranks only where `e`'s placement gathers the blocks' weights from 1/W
    shards anyway (each rank streams its shard; engine/chunked/placement.py stream_refusal refuses
    streaming weights that every rank holds whole)."""
    if fixed.offload_params == "none":
        return False
    p = placement_of(work, e, layout)
    return p.world == 1 or p.gathers_weights


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
    experts: bool = False,
) -> Candidate | None:
    """Fill the GPU first: the plan with the fewest (last) blocks' optimizer state on the host
    that fits the GPU, their weights streamed from host RAM too when `stream` (or when the
    optimizer state alone is not enough, or the user asked for it); with `experts`, only the
    offloaded blocks' experts (a mixture of experts' own chunks). None when the engine cannot
    offload, the user ruled offload out, the plan fits without it (unless the user asked for
    offload), or `stream` and the weights cannot be streamed."""
    if e.engine != "zero" or fixed.offload_optimizer == "none" or hw.device != "cuda":
        return None
    forced = fixed.offload_optimizer == "cpu"
    if "offload_blocks" in fixed or (base.fits and not forced):
        return None  # the fraction was given (base already is that plan), or nothing to offload
    if stream and not can_stream(work, e, fixed, layout):
        return None
    if fixed.offload_optimizer == "nvme" or (fixed.offload_optimizer != "cpu" and hw.nvme_path):
        v = spill_variant(work, grad_accum, hw, rates, e, layout, fixed, stream, experts)
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
            offload_experts=experts,
        )
        return evaluate(work, grad_accum, hw, rates, cfg, layout)

    lo, hi = (
        (1 if forced else 0),
        L,
    )  # the fewest offloaded blocks that fit the GPU lies in (lo, hi]
    if with_k(hi).gpu_short > 0 and not stream and can_stream(work, e, fixed, layout):
        stream = True  # the optimizer state alone is not enough: stream the weights too
    if with_k(hi).gpu_short > 0:
        return with_k(hi)  # even all blocks on the host do not fit the GPU: report the leanest
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if with_k(mid).gpu_short <= 0 else (mid, hi)
    return with_k(hi)


def spill_variant(
    work,
    grad_accum,
    hw,
    rates,
    e: EngineConfig,
    layout,
    fixed: Fixed,
    stream: bool = False,
    experts: bool = False,
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
            offload_experts=experts,
        )
        return evaluate(work, grad_accum, hw, rates, cfg, layout)

    if with_kd(L, L).gpu_short > 0 and not stream and can_stream(work, e, fixed, layout):
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
