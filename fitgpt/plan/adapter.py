"""An adapter run's placement, decided once, where a run is settled (train/assemble.py settle).

LoRA (fitgpt/adapters) trains a few matrices on a frozen base. The adapters, their gradients
and Adam moments are small and stay on the GPU, so an adapter run trains on the ddp engine; what
this file plans is the base (plan_base, when the run is placed: train/assemble.py placed): its
format (--base-format, auto: bf16 under bf16 compute, fp32 under fp32) and how many of its
blocks stream from pinned host RAM or from the disk (engine/chunked/frozen.py), and whether it
recomputes: of the placements that fit (plan/adapter_memory.py), the fastest by its step time
(plan/adapter_time.py); a run that fits nowhere is refused in one line naming what would fit
(docs/adapters.md). What needs the chunk engine's tiers for the trained state, or cuts the
model, is refused in one line naming the flag, before anything is planned or built:

  --engine zero, --zero-stage 1-3         sharded state: the ddp engine shards nothing
  --offload-optimizer, --offload-params,  state in host RAM or on disk: the chunk engine's tiers
  --offload-blocks, --nvme-blocks, and    (a LoRA base has its own: --base-host-blocks,
  the two --*-fraction shares             --base-disk-blocks with --nvme-path)
  --master split, compact --moments,      the chunk engine's optimizer formats
  --device-moments
  --compile model                         the chunk engine's whole-model graph
  --tensor-parallel, --context-parallel   adapters are not cut or hooked for them yet

The adapter's own checks: its fields in AdapterConfig.__post_init__, its target names against
the family here (adapters/targets.py), and a base to adapt (--init-from, or on a resume the
source its checkpoint names).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from fitgpt.adapters import AdapterConfig, lora_targets
from fitgpt.engine.config import EngineConfig
from fitgpt.engine.formats.frozen_base import base_format
from fitgpt.engine.transforms.compile import compile_scope
from fitgpt.errors import UserError
from fitgpt.model.families import family_of
from fitgpt.plan import rates
from fitgpt.plan.adapter_memory import BasePlan, price_base
from fitgpt.plan.adapter_time import adapter_step_time
from fitgpt.plan.fixed import Fixed
from fitgpt.plan.hardware import Hardware
from fitgpt.plan.memory import GiB, gpu_budget
from fitgpt.plan.rates import Rates
from fitgpt.plan.validate import flag_text

WHY = (
    "a LoRA run (--lora-rank) trains its adapters on the ddp engine and places its frozen base "
    "itself (--base-format, --base-host-blocks)"
)
# engine field -> the value that asks nothing of the chunk engine (none typed, or off)
PLAIN = {
    "zero_stage": 0,
    "offload_optimizer": "none",
    "offload_params": "none",
    "offload_blocks": None,
    "nvme_blocks": None,
    "master": ("auto", "fp32"),
    "moments": ("auto", "fp32"),
    "device_moments": ("auto", "fp32"),
    "tensor_parallel": 1,
    "context_parallel": 1,
}


def adapter_refusal(e: EngineConfig, typed: Mapping[str, Any]) -> str | None:
    """The one line refusing an engine setting an adapter run cannot have, or None. `e`: the
    engine config as asked (with --plan auto, its fixed fields applied); `typed`: the engine
    flags typed (the shares --offload-fraction and --nvme-fraction among them)."""
    if typed.get("engine") == "zero":
        return f"--engine zero: {WHY}; drop it"
    for name in ("offload_fraction", "nvme_fraction"):  # --nvme-path: the base's disk tier
        if typed.get(name) not in (None, ""):
            return f"{flag_text(name, typed[name])}: {WHY}; drop it"
    for name, plain in PLAIN.items():
        v = getattr(e, name)
        if v == plain or (isinstance(plain, tuple) and v in plain):
            continue
        if name in ("tensor_parallel", "context_parallel"):
            return (
                f"{flag_text(name, v if v else 'auto')}: LoRA adapters are not cut for tensor "
                "or context parallelism yet; drop it (data parallelism over the GPUs holds the "
                "whole base on each)"
            )
        return f"{flag_text(name, v)}: {WHY}; drop it"
    if e.compile == "model":
        return "--compile model: the whole-model graph is the chunk engine's; use --compile blocks"
    return None


def adapter_placement(run, fixed: Fixed | None, typed: Mapping[str, Any], has_base: bool):
    """(run, fixed, notes) for an adapter run: the ddp engine with the fields asked, unplanned
    (fixed None); a run without adapters as it is. Refuses, in one line, a setting
    adapter_refusal names, a target its family has not, and an adapter without a base."""
    a = run.adapter
    if not a.active:
        return run, fixed, ()
    lora_targets(run.model, a)  # each name refused here if the family has no such linear
    e = fixed.applied(run.engine) if fixed is not None and fixed.names else run.engine
    why = adapter_refusal(e, typed)
    if why:
        raise UserError(why)
    run = dataclasses.replace(run, engine=dataclasses.replace(e, engine="ddp"))
    # --plan auto without --checkpointing: the base's planner may recompute where it must
    free = fixed is not None and "checkpointing" not in fixed.names
    # --keep-activations not given (under --plan off too, like the base's tiers): under full,
    # the base's planner keeps the most blocks' activations that fit
    keep = "keep_activations" not in typed and (fixed is None or "keep_activations" not in fixed)
    a = dataclasses.replace(a, checkpointing_planned=free, keep_planned=keep)
    run = dataclasses.replace(run, adapter=a)
    notes = () if has_base else (RANDOM_BASE,)
    return run, None, notes


RANDOM_BASE = (
    "LoRA on a randomly initialised base (no --init-from): the model's preset built straight "
    "into its tiers, for measuring a LoRA run's speed and memory; nothing pretrained is adapted"
)


def place_base(run, ctx, log=print):
    """`run` with its base's format and tiers settled for this machine (plan_base), the plan
    said on rank 0; one line refusing what does not fit, before anything is allocated. Rank 0
    decides and broadcasts (dist/context.py decided_on_rank0, as plan_engine), so every rank
    shards or streams the same blocks even where their free memory differs."""
    from fitgpt.dist.context import decided_on_rank0
    from fitgpt.plan import hardware

    def decide() -> dict:
        placed, line = plan_base(run, hardware.for_run(run.engine, ctx.world, ctx.device.type))
        log(line)
        e = placed.engine
        return {**dataclasses.asdict(placed.adapter), "ckpt": e.checkpointing,
                "keep": e.keep_activations, "compile": e.compile}  # fmt: skip

    adapter = decided_on_rank0(ctx, decide)
    engine = dataclasses.replace(
        run.engine,
        checkpointing=adapter.pop("ckpt"),
        keep_activations=adapter.pop("keep"),
        compile=adapter.pop("compile"),
    )
    return dataclasses.replace(run, adapter=AdapterConfig(**adapter), engine=engine)


# what to try, in order, when a run does not fit as asked: the leaner formats, then recompute
LEANER = ("bf16", "int8", "nf4")


def timed_base(p: BasePlan, run, work, r: Rates) -> BasePlan:
    """`p` with its predicted step time (plan/adapter_time.py) at `run`'s batch and adapters."""
    t = adapter_step_time(p, work, run.adapter, run.train.grad_accum, r)
    return dataclasses.replace(p, time=t)


def plan_base(run, hw: Hardware, r: Rates | None = None) -> tuple[Any, str]:
    """(run, line): the adapter's base format, tiers and recompute settled for `hw`: of the
    placements that fit, the fastest by the step-time model at rates `r` (this machine's,
    plan/rates.py, unless given), ties to the fewer blocks streamed; or one line refusing a run
    that fits nowhere, naming what would. On the CPU everything is host memory: nothing is
    streamed unless asked."""
    from fitgpt.plan.apply import workload_of  # plan/apply.py imports the planner

    a = run.adapter
    work = workload_of(run, hw.gpus, hw.device)
    r = r or rates.for_run(hw.gpu_name, run.engine)
    fmt = base_format(a, work.precision)
    ckpt = run.engine.checkpointing
    n_blocks = run.model.n_layer
    h, d = a.base_host_blocks, a.base_disk_blocks
    if h is not None and h > n_blocks:
        raise UserError(f"--base-host-blocks {h}: the model has {n_blocks} blocks; use 0 to "
                        f"{n_blocks}")  # fmt: skip
    if d and d > (n_blocks if h is None else h):
        raise UserError(f"--base-disk-blocks {d}: more than the blocks off the GPU "
                        f"(--base-host-blocks {h}); the disk ones are among them")  # fmt: skip
    if a.base_disk_blocks and not hw.nvme_path:
        raise UserError(
            f"--base-disk-blocks {a.base_disk_blocks}: the disk blocks' files need "
            "--nvme-path DIR on a disk with room for them"
        )
    if a.base_host_blocks is not None:
        tries = [a.base_host_blocks]
    else:
        tries = [0] if hw.device != "cuda" else range(n_blocks + 1)
    # whole on every rank (no gathers) or sharded over the ranks, as asked or both
    cuts = [hw.gpus if a.base_sharded else 1] if a.base_sharded is not None else [1]
    if a.base_sharded is None and hw.gpus > 1 and hw.device == "cuda":
        cuts.append(hw.gpus)
    # recompute as asked, or (--checkpointing not given) off and full both, weighed by time;
    # where neither fits, the block inputs in pinned host RAM (cpu): the same recompute, a
    # block input's PCIe both ways a block (adapter_time.py does not price it, so it is never
    # preferred to a recompute that fits)
    ckpts = dict.fromkeys((ckpt, "full") if a.checkpointing_planned else (ckpt,))
    if a.checkpointing_planned and hw.device == "cuda":
        ckpts["cpu"] = None
    # --keep-activations as given, or (not given) under full the most blocks kept that fit
    keep_given = None if a.keep_planned else run.engine.keep_activations
    # At one recompute, cut and kept count, a block more streamed (or read from the disk rather
    # than host RAM) never makes a step faster (its copy is exposed or hidden, never negative),
    # so the fewest blocks that fit is that triple's fastest. Under full with the kept count
    # planned there is a trade: a block more streamed frees GPU memory for more blocks kept,
    # each sparing a block's recompute; every host count from the first that fits is priced
    # with its most blocks kept (bisected: memory grows with K), until all are kept.
    found: dict[tuple[str, int], BasePlan] = {}
    for c in ckpts:
        if c == "cpu" and found:
            break
        search = c == "full" and keep_given is None
        keep0 = keep_given if c == "full" and keep_given is not None else 0
        for k in cuts:
            for h in tries:
                p = _fitting(work, a, fmt, h, c, k, keep0, hw)
                if p is None:
                    continue
                if search:
                    p = _most_kept(work, a, fmt, p, hw)
                p = timed_base(p, run, work, r)
                if (c, k) not in found or p.time["total"] < found[c, k].time["total"]:
                    found[c, k] = p
                if not search or p.keep == n_blocks:
                    break
    if not found:  # said at the last placement tried: every block streamed, the last recompute
        last = list(ckpts)[-1]
        keep0 = keep_given if last == "full" and keep_given else 0
        tried = price_base(work, a, fmt, tries[-1], last, shards=cuts[-1], keep=keep0)
        raise UserError(_refusal(work, a, fmt, ckpt, tried, hw))
    best = min(found.values(), key=lambda q: (q.time["total"], q.host_blocks, q.disk_blocks))
    best = dataclasses.replace(best, compile=_compile_scope(run, work, best))
    if best.compile != "off":  # priced compiled; the placements were weighed eager
        best = timed_base(best, run, work, r)
    return _settled(run, best), "LoRA: " + best.line()


def _compile_scope(run, work, p: BasePlan) -> str:
    """--compile for the placement `p`: the one rule (engine/transforms/compile.py
    compile_scope), its run's length this plan's eager step times the run's steps (the planned
    full fine-tune's is its own step's: candidate.py settle_compile), the ddp engine's regions."""
    return compile_scope(
        run.engine.compile, "ddp", work.device, run.model.n_embd, work.world, True,
        p.checkpointing, run.train.steps * p.time["total"],
        family_of(run.model).compiled_checkpointed,
    )  # fmt: skip


def _fitting(work, a, fmt: str, h: int, c: str, k: int, keep: int, hw: Hardware):
    """The placement of `h` host blocks, recompute `c`, cut `k`, `keep` blocks kept that fits
    `hw` with the fewest of its host blocks on the disk, or None."""
    p = price_base(work, a, fmt, h, c, shards=k, keep=keep)
    if not p.gpu_fits(hw):
        return None
    disks = [a.base_disk_blocks] if a.base_disk_blocks is not None else [0]
    if a.base_disk_blocks is None and hw.nvme_path:  # the disk when host RAM is short
        disks = range(h + 1)
    for d in disks:
        if d > h:  # the disk blocks are among the host ones
            continue
        p = price_base(work, a, fmt, h, c, d, k, keep)
        if p.fits(hw):
            return p
    return None


def _most_kept(work, a, fmt: str, p: BasePlan, hw: Hardware) -> BasePlan:
    """`p` (checkpointing full, fits `hw`) with the most blocks kept that still fits: memory
    grows with the kept count (plan/memory.py activation_bytes), so a bisection."""

    def at(keep: int) -> BasePlan:
        return price_base(work, a, fmt, p.host_blocks, "full", p.disk_blocks, p.shards, keep)

    lo, hi = p.keep, p.blocks + 1  # at(lo) fits; hi: past the last count
    best = p
    while hi - lo > 1:
        mid = (lo + hi) // 2
        q = at(mid)
        if q.fits(hw):
            lo, best = mid, q
        else:
            hi = mid
    return best


def _settled(run, p: BasePlan):
    """`run` with the base placed as `p` says: its format and tiers, and the engine's
    recompute, kept blocks and compile scope."""
    a = dataclasses.replace(
        run.adapter,
        base_format=p.fmt,
        base_host_blocks=p.host_blocks,
        base_disk_blocks=p.disk_blocks,
        base_sharded=p.shards > 1,
    )
    engine = dataclasses.replace(
        run.engine, checkpointing=p.checkpointing, keep_activations=p.keep, compile=p.compile
    )
    return dataclasses.replace(run, adapter=a, engine=engine)


def _refusal(work, a, fmt, ckpt, tried: BasePlan, hw: Hardware) -> str:
    """One line: what the run needs at its leanest as asked, and the first leaner setting that
    fits (a smaller format, every block streamed; then --checkpointing full)."""
    host = f"{tried.host_bytes / GiB:.1f} GiB host (of {hw.cpu_mem / GiB:.1f})"
    need = host  # a CPU run holds everything in host memory
    if hw.device == "cuda":
        gpu = gpu_budget(hw.gpu_mem) / GiB
        need = f"{tried.est.compute_total / GiB:.1f} GiB a GPU (of {gpu:.1f} usable) and {host}"
    fix = "a smaller --micro-batch or --seq-len, or more GPUs' memory"
    order = LEANER[LEANER.index(fmt) :] if fmt in LEANER else (fmt, *LEANER)
    recompute = (ckpt, "full", "cpu") if hw.device == "cuda" else (ckpt, "full")
    options = [(f, c) for c in dict.fromkeys(recompute) for f in order]
    cuts = dict.fromkeys((1, hw.gpus if hw.device == "cuda" else 1))
    for f, c in options:
        if (f, c) == (fmt, ckpt) and len(cuts) == 1:
            continue
        plan = next(
            (
                (h, k)
                for k in cuts
                for h in range(tried.blocks + 1)
                if price_base(work, a, f, h, c, shards=k).fits(hw)
            ),
            None,
        )
        if plan is not None:
            h, k = plan
            flags = [f"--base-format {f}"] if f != fmt else []
            flags += [f"--checkpointing {c}"] if c != ckpt else []
            flags += ["--base-sharded"] if k > 1 else []
            flags = flags or [f"--base-host-blocks {h}"]
            fix = f"{' '.join(flags)} fits ({h} blocks in host RAM)"
            break
    else:
        fix = _shorter(work, a, fmt, order[-1], recompute, cuts, hw) or fix
    return (
        f"--lora-rank {a.lora_rank}: {work.model.num_params() / 1e9:.2f} B parameters with "
        f"the base in {fmt}, {tried.host_blocks} of {tried.blocks} blocks in host RAM and "
        f"--checkpointing {tried.checkpointing} need {need}; {fix}"
    )


def _shorter(work, a, asked: str, fmt: str, recompute, cuts, hw: Hardware) -> str | None:
    """Where no leaner setting fits: the flags of the longest --seq-len (a multiple of the
    planner's search step, planner.py seq_quantum) that fits in `fmt`, the leanest format from
    the one `asked`, under some recompute,
    streaming and cut, at the run's micro-batch, else at micro-batch 1; None if not even its
    shortest does. A bisection, ~log2(S/1024) lengths of up to 3 x 81 placements at 70 B
    (~1 ms each): priced only on the way to a refusal."""
    from fitgpt.plan.planner import seq_quantum

    n = work.model.n_layer

    def fits(w) -> tuple[int, str] | None:
        for c in dict.fromkeys(recompute):
            for k in cuts:
                for h in range(n + 1):
                    if price_base(w, a, fmt, h, c, shards=k).fits(hw):
                        return h, c
        return None

    S = work.model.seq_len
    q = seq_quantum(S)
    for mb in dict.fromkeys((work.micro_batch, 1)):
        at = dataclasses.replace(work, micro_batch=mb)
        lo, hi, got = 0, (S - 1) // q + 1, None  # in quanta: lo fits (0: none yet), hi does not
        while hi - lo > 1:
            mid = (lo + hi) // 2
            w = dataclasses.replace(at, model=work.model.replace(seq_len=mid * q))
            placed = fits(w)
            lo, hi, got = (mid, hi, placed) if placed else (lo, mid, got)
        if lo:
            h, c = got
            flags = [f"--micro-batch {mb}"] if mb != work.micro_batch else []
            flags += [f"--seq-len {lo * q}"] + ([f"--base-format {fmt}"] if fmt != asked else [])
            flags += [f"--checkpointing {c}"]
            return f"{' '.join(flags)} fits ({h} blocks in host RAM)"
    return None


def largest_lora(run_at, hw: Hardware, limit: int = 4096) -> tuple[int, str] | None:
    """(layers, plan line) of the largest model `run_at(layers)` (a RunConfig with its adapter)
    whose LoRA run plan_base fits on `hw`, streaming from host RAM as it must; None if one layer
    does not fit. Fits are monotone in the layers (each adds a block's bytes on some tier)."""

    def fits(n: int) -> str | None:
        try:
            return plan_base(run_at(n), hw)[1]
        except UserError:
            return None

    if fits(1) is None:
        return None
    lo, hi = 1, 2
    while hi <= limit and fits(hi) is not None:
        lo, hi = hi, hi * 2
    while hi - lo > 1:  # fits(lo), not fits(hi)
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) is not None else (lo, mid)
    return lo, fits(lo)
