"""One matmul run, top to bottom: check memory -> reference rate -> make A, B -> multiply (timed)
-> verify -> write C -> figures. The CLI and the GPU benchmark both call `run_matmul`.

Every rank calls it; collectives inside keep the ranks in step, and every rank returns the
same figures (maxima or sums over ranks where they differ).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

import torch
import torch.distributed as dist

from fitgpt.dist import DistContext
from fitgpt.errors import UserError
from fitgpt.matmul.config import MatmulConfig, matmul_precision
from fitgpt.matmul.memory import device_available, gb, host_available, local_ranks
from fitgpt.matmul.npyout import NpyWriter
from fitgpt.matmul.operands import check_vector, operands
from fitgpt.matmul.out_of_core import OutOfCore, choose_tiles
from fitgpt.matmul.reference import gemm_tflops, ref_size
from fitgpt.matmul.rows import RowsPlan, RowsProduct
from fitgpt.matmul.summa import SummaPlan, SummaProduct
from fitgpt.matmul.verify import TOLERANCE, Freivalds, SampledEntries, Verdict, verify_blocks
from fitgpt.units import tflops

MAX_AUTO_PANEL = 4096  # wide enough for a full-rate GEMM, small next to a 50000-wide block


@dataclass
class MatmulResult:
    layout: str  # rows, 2d, out-of-core
    n: int
    dtype: str
    world: int
    device: str
    shape: str  # the grid or the tiles
    setup_s: float  # making A and B (generation or reading), not in time_s
    setup_reused: bool
    time_s: float  # median of the timed products
    times_s: list[float]
    tflops: float
    ref_n: int
    ref_tflops: float | None  # one device's torch.mm rate at ref_n
    frac_of_ref: float | None  # tflops / (world · ref_tflops)
    held_bytes: int  # bytes the algorithm holds on one device at its peak (max over ranks)
    seed_bytes: int | None  # the seed's layout (A, C by rows, all of B everywhere), per device
    peak_bytes: int | None  # torch.cuda.max_memory_allocated, max over ranks (GPU only)
    comm_bytes: int  # bytes one rank receives per product (max over ranks)
    comm_bytes_total: int  # summed over ranks
    h2d_bytes: int | None = None  # out-of-core traffic per product
    d2h_bytes: int | None = None
    host_bytes: int | None = None  # out-of-core host memory for A and B
    verify: dict = field(default_factory=dict)
    verify_s: float = 0.0
    out: str | None = None

    @property
    def passed(self) -> bool:
        return bool(self.verify.get("passed"))

    def record(self) -> dict:
        return {**asdict(self), "torch": torch.__version__}


def auto_panel(n: int, world: int) -> int:
    """Broadcast panel width: a quarter of a rank's block, at most MAX_AUTO_PANEL columns."""
    return max(1, min(MAX_AUTO_PANEL, -(-n // (4 * world))))


def _sync(ctx: DistContext) -> None:
    if ctx.device.type == "cuda":
        torch.cuda.synchronize(ctx.device)  # host-device sync: timing boundary
    ctx.barrier()


def _reduce(ctx: DistContext, values: list[float], op=dist.ReduceOp.MAX) -> list[float]:
    t = torch.tensor(values, dtype=torch.float64, device=ctx.device)
    if ctx.distributed:
        dist.all_reduce(t, op=op, group=ctx.group)
    return t.tolist()  # host-device sync (a few numbers)


def _device_name(ctx: DistContext) -> str:
    if ctx.device.type == "cuda":
        return torch.cuda.get_device_name(ctx.device)
    return "cpu"


def _reference(cfg: MatmulConfig, ctx: DistContext, log) -> tuple[int, float | None]:
    """Rank 0 times one device's GEMM while the others wait (before the big allocations)."""
    n_ref = ref_size(cfg.ref_n, ctx.device)
    rate = 0.0
    if n_ref > 0 and ctx.is_main:
        rate = gemm_tflops(n_ref, cfg.dtype, ctx.device)
        log(f"one-device torch.mm reference at n={n_ref}, {cfg.dtype}: {tflops(rate)}")
    (rate,) = _reduce(ctx, [rate])  # every rank gets rank 0's figure
    return n_ref, rate or None


def run_matmul(
    cfg: MatmulConfig,
    ctx: DistContext,
    cache: dict | None = None,
    log: Callable[[str], None] | None = None,
) -> MatmulResult:
    """Multiply, time, verify, optionally write C. `cache` keeps A and B (and C) between runs
    that share them (fp32 then tf32 of the same n), so a benchmark generates them once."""
    say = log if log is not None else (print if ctx.is_main else (lambda _msg: None))
    with matmul_precision(cfg.dtype):
        if cfg.out_of_core:
            return _run_out_of_core(cfg, ctx, cache, say)
        return _run_in_core(cfg, ctx, cache, say)


def _run_in_core(cfg: MatmulConfig, ctx: DistContext, cache: dict | None, say) -> MatmulResult:
    n, world = cfg.n, ctx.world
    panel = cfg.panel or auto_panel(n, world)
    plan_cls, product_cls = (
        (RowsPlan, RowsProduct) if cfg.layout == "rows" else (SummaPlan, SummaProduct)
    )
    plan = plan_cls(n, world, ctx.rank, cfg.itemsize, panel)  # 2d on a non-square world: refused
    key = ("in-core", cfg.layout, n, cfg.seed, cfg.storage, panel, cfg.a_path, cfg.b_path, world)
    reused = cache is not None and key in cache
    if not reused:
        _require_device_fits(cfg, ctx, plan_cls, panel)
    n_ref, ref = _reference(cfg, ctx, say)
    sources = operands(cfg)
    if ctx.device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(ctx.device)
    t0 = time.perf_counter()
    if reused:
        product = cache[key]
    else:
        say(f"making A and B: {cfg.layout} layout, {world} rank(s), {n}×{n} {cfg.dtype}")
        product = product_cls(ctx, plan, *sources, cfg.storage)
        if cache is not None:
            cache.clear()  # one set of operands at a time: device memory is the limit
            cache[key] = product
    product.warm()
    _sync(ctx)
    setup_s = 0.0 if reused else time.perf_counter() - t0
    times = []
    for rep in range(cfg.repeat):
        _sync(ctx)
        t0 = time.perf_counter()
        product.multiply()
        _sync(ctx)
        times.append(time.perf_counter() - t0)
        say(f"product {rep + 1}/{cfg.repeat}: {times[-1]:.3f} s")
    t0 = time.perf_counter()
    verdict = verify_blocks(
        ctx,
        cfg.dtype,
        cfg.seed,
        n,
        sources,
        product.a_blocks,
        product.b_blocks,
        product.c_blocks,
        cfg.samples,
    )
    verify_s = time.perf_counter() - t0
    if cfg.out:
        _write_blocks(ctx, cfg.out, n, product.c_blocks)
    peak = torch.cuda.max_memory_allocated(ctx.device) if ctx.device.type == "cuda" else 0
    held, peak, comm = _reduce(ctx, [plan.held_bytes, peak, plan.comm_bytes])
    (comm_total,) = _reduce(ctx, [plan.comm_bytes], dist.ReduceOp.SUM)
    median = statistics.median(times)
    tflops = cfg.flops / median / 1e12
    shape = f"{plan.q}×{plan.q} grid" if cfg.layout == "2d" else f"{world}×1 row blocks"
    return MatmulResult(
        layout=cfg.layout,
        n=n,
        dtype=cfg.dtype,
        world=world,
        device=_device_name(ctx),
        shape=f"{shape}, panels of ≤{panel}",
        setup_s=setup_s,
        setup_reused=reused,
        time_s=median,
        times_s=times,
        tflops=tflops,
        ref_n=n_ref,
        ref_tflops=ref,
        frac_of_ref=tflops / (world * ref) if ref else None,
        held_bytes=int(held),
        seed_bytes=cfg.itemsize * (2 * -(-n // world) * n + n * n),
        peak_bytes=int(peak) if ctx.device.type == "cuda" else None,
        comm_bytes=int(comm),
        comm_bytes_total=int(comm_total),
        verify=verdict.record(),
        verify_s=verify_s,
        out=cfg.out,
    )


def _require_device_fits(cfg: MatmulConfig, ctx: DistContext, plan_cls, panel: int) -> None:
    """Refuse, on every rank alike, before allocating blocks that cannot fit."""
    plan = plan_cls(cfg.n, ctx.world, ctx.rank, cfg.itemsize, panel)
    avail = device_available(ctx.device, cfg.device_mem, local_ranks())
    need, neg_avail = _reduce(ctx, [plan.held_bytes, -avail])
    if need <= -neg_avail:
        return
    avail = int(-neg_avail)
    lo, hi = 0, cfg.n  # largest n whose rank-0 blocks fit, by bisection
    while lo < hi:
        mid = (lo + hi + 1) // 2
        fits = (
            plan_cls(
                mid, ctx.world, 0, cfg.itemsize, cfg.panel or auto_panel(mid, ctx.world)
            ).held_bytes
            <= avail
        )
        lo, hi = (mid, hi) if fits else (lo, mid - 1)
    raise UserError(
        f"--layout {cfg.layout} --n {cfg.n} {cfg.dtype} on {ctx.world} rank(s) needs {gb(need)} per "
        f"device but {ctx.device} has {gb(avail)} available; n <= {lo} fits: lower --n, add GPUs, "
        "or use --out-of-core"
    )


def _write_blocks(ctx: DistContext, path: str, n: int, blocks) -> None:
    writer = NpyWriter(ctx, path, n)
    try:
        for blk in blocks:
            writer.write(blk.r0, blk.c0, blk.data)
    except BaseException:
        writer.abort()
        raise
    writer.close()


def _run_out_of_core(cfg: MatmulConfig, ctx: DistContext, cache: dict | None, say) -> MatmulResult:
    n, dev = cfg.n, ctx.device
    if ctx.world != 1:
        raise UserError(
            f"--out-of-core: runs on one device but this job has {ctx.world} ranks; "
            "drop --gpus and torchrun"
        )
    # A and B on the host depend on the width of B's column panels only: a cached pair is
    # reused with its panel width, and the row panels are sized afresh from free memory.
    key = ("out-of-core", n, cfg.seed, cfg.storage, cfg.a_path, cfg.b_path)
    cached = cache.get(key) if cache is not None else None
    budget = device_available(dev, cfg.device_mem)
    tile_cols = cfg.tile_cols or (cached.plan.tn if cached is not None else 0)
    tiles = choose_tiles(n, cfg.itemsize, budget, cfg.tile_rows, tile_cols, dev.type)
    reused = cached is not None and cached.plan.cols == tiles.cols
    if not reused:
        need = tiles.host_bytes + (2 * tiles.tm * tiles.tn * cfg.itemsize if cfg.out else 0)
        have = host_available(cfg.host_mem)
        if need > have:
            raise UserError(
                f"--out-of-core --n {n} {cfg.dtype}: A and B need {gb(need)} of host memory but "
                f"{gb(have)} is available (short by {gb(need - have)}); lower --n, use --dtype bf16 "
                "(half the bytes), or set --host-mem if MemAvailable is wrong"
            )
    n_ref, ref = _reference(cfg, ctx, say)
    sources = operands(cfg)
    if dev.type == "cuda":
        torch.cuda.reset_peak_memory_stats(dev)
    t0 = time.perf_counter()
    if reused:
        ooc = cached
        ooc.plan = tiles
    else:
        if cache is not None:
            for old in cache.values():
                if isinstance(old, OutOfCore):
                    old.close()
            cache.clear()
        ooc = OutOfCore(tiles, *sources, cfg.storage, dev, say)
        if cache is not None:
            cache[key] = ooc
    setup_s = 0.0 if reused else time.perf_counter() - t0
    say(f"streaming {tiles.describe()} through {dev} ({gb(tiles.device_bytes)} of device buffers)")
    times, moved = [], {}
    try:
        for rep in range(cfg.repeat):
            last = rep + 1 == cfg.repeat
            fr = Freivalds(check_vector(cfg.seed, n, dev))
            sampled = SampledEntries(n, cfg.samples, cfg.seed, dev)
            writer = NpyWriter(ctx, cfg.out, n) if cfg.out and last else None
            try:
                _sync(ctx)
                t0 = time.perf_counter()
                moved = ooc.multiply(ctx, fr, sampled, writer)  # ends with a device sync
                times.append(time.perf_counter() - t0)
            except BaseException:
                if writer is not None:
                    writer.abort()
                raise
            say(f"product {rep + 1}/{cfg.repeat}: {times[-1]:.3f} s (verification folded in)")
            t0 = time.perf_counter()
            verdict = Verdict(
                fr.error(ctx), sampled.error(ctx, *sources), cfg.samples, TOLERANCE[cfg.dtype]
            )
            verify_s = time.perf_counter() - t0
            if writer is not None:
                writer.close()
    finally:
        if cache is None:
            ooc.close()
    median = statistics.median(times)
    tflops = cfg.flops / median / 1e12
    peak = torch.cuda.max_memory_allocated(dev) if dev.type == "cuda" else None
    return MatmulResult(
        layout="out-of-core",
        n=n,
        dtype=cfg.dtype,
        world=1,
        device=_device_name(ctx),
        shape=tiles.describe(),
        setup_s=setup_s,
        setup_reused=reused,
        time_s=median,
        times_s=times,
        tflops=tflops,
        ref_n=n_ref,
        ref_tflops=ref,
        frac_of_ref=tflops / ref if ref else None,
        held_bytes=tiles.device_bytes,
        seed_bytes=None,
        peak_bytes=peak,
        comm_bytes=0,
        comm_bytes_total=0,
        h2d_bytes=moved.get("h2d_bytes"),
        d2h_bytes=moved.get("d2h_bytes"),
        host_bytes=tiles.host_bytes,
        verify=verdict.record(),
        verify_s=verify_s,
        out=cfg.out,
    )
