"""`--out-of-core`: one device multiplies matrices larger than its memory, tile by tile.

A and B live in page-locked host memory: A row-major, B as contiguous column panels. C is cut
into tiles of tm×tn; a row panel of A (tm×n) is loaded once and reused across its whole row of
C tiles, and B's column panels (n×tn) stream past it. Rows are walked in a serpentine, so the
last two B panels of one row (still in the two B buffers) are the first two of the next:

    host (pinned chunks)      device (two of each buffer: one in use, one being filled)
    A row panel i  ──H2D──>   a[i % 2]  (tm×n) ─┐
    B col panel j  ──H2D──>   b[slot]   (n×tn) ─┴─ GEMM ──> c[t % 2] (tm×tn) ──> C·x, samples
                                                                           └─D2H─> C.npy (--out)

Copies run on their own CUDA streams and are ordered by events, so the copy of the next B
panel (and, during a row, of the next A panel) runs while the current tile's GEMM computes.
C tiles are never gathered in host memory: each is folded into the verifier (C·x and the
sampled entries) on the device and, with --out, written to a .npy memory map. B's panels are
folded into B·x in the first row, and each A panel into A·(B·x) at the end of its row.

Traffic: A once (n²) and B once per row of tiles (n²·n/tm, less two panels a turn), so a large tm (as much of the
device as the A panels can take) cuts traffic; tn only needs to keep the GEMM efficient.
Device memory: 2·tm·n + 2·n·tn + 2·tm·tn entries. Host memory: 2·n² entries.

On a machine without CUDA the same code runs with the CPU as the device: the copies are
synchronous and the streams and events are skipped, so tests exercise the tiling logic.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from fitgpt.dist import DistContext
from fitgpt.errors import UserError
from fitgpt.matmul.blocks import Block, split
from fitgpt.matmul.memory import HostArray, gb
from fitgpt.matmul.npyout import NpyWriter
from fitgpt.matmul.operands import Generated, Source
from fitgpt.matmul.verify import Freivalds, SampledEntries

DEFAULT_TILE_COLS = {"cuda": 8192, "cpu": 512}  # wide enough for a full-rate GEMM


@dataclass(frozen=True)
class TilePlan:
    n: int
    itemsize: int
    tm: int  # the tallest row panel of A / C tiles
    tn: int  # the widest column panel of B / C tiles

    @property
    def rows(self) -> list[tuple[int, int]]:
        return split(self.n, -(-self.n // self.tm))

    @property
    def cols(self) -> list[tuple[int, int]]:
        return split(self.n, -(-self.n // self.tn))

    @property
    def buffers(self) -> tuple[int, int]:
        """Device buffers for A and B panels: two (one in use, one filling) unless one panel."""
        return min(2, len(self.rows)), min(2, len(self.cols))

    @property
    def device_bytes(self) -> int:
        (na, nb), tm, tn, n = self.buffers, self.tm, self.tn, self.n
        return self.itemsize * (na * tm * n + nb * n * tn + 2 * tm * tn)

    @property
    def host_bytes(self) -> int:
        return 2 * self.itemsize * self.n * self.n

    def order(self) -> list[tuple[int, int]]:
        """(row panel, column panel) of every C tile: rows in turn, columns in a serpentine."""
        cols = list(range(len(self.cols)))
        return [(r, c) for r in range(len(self.rows)) for c in (cols if r % 2 == 0 else cols[::-1])]

    def describe(self) -> str:
        return f"{len(self.rows)}×{len(self.cols)} tiles of ≤{self.tm}×{self.tn}"


def choose_tiles(
    n: int, itemsize: int, budget: int, tile_rows: int, tile_cols: int, device: str
) -> TilePlan:
    """The tallest row panels that fit `budget` bytes of device memory (fewer passes over B)."""
    tn = min(n, tile_cols or DEFAULT_TILE_COLS.get(device, 512))
    tm = tile_rows
    while not tile_rows:
        tm = (budget // itemsize - 2 * n * tn) // (2 * (n + tn))
        if tm >= min(n, 128) or tn <= 128 or tile_cols:
            break
        tn //= 2  # very little memory: narrower B panels leave room for taller A panels
    tm = min(max(tm, 1), n)
    # Balanced panels: the tallest / widest of a near-equal split.
    tm = max(b - a for a, b in split(n, -(-n // tm)))
    tn = max(b - a for a, b in split(n, -(-n // tn)))
    plan = TilePlan(n, itemsize, tm, tn)
    if plan.device_bytes > budget:
        raise UserError(
            f"--out-of-core --n {n}: tiles of {tm}×{tn} need {gb(plan.device_bytes)} of device "
            f"memory but {gb(budget)} is available; free the device, lower --tile-rows/"
            "--tile-cols, or raise --device-mem"
        )
    return plan


def _fill_host(
    arr: HostArray, off: int, src: Source, rows: tuple[int, int], cols: tuple[int, int], device
) -> None:
    """Write src's block rows × cols, row-major, into arr at `off`, 256 MB at a time.

    Generated entries are made on the GPU when there is one (16 integer passes an entry are
    slow on a CPU: 80 GB would take minutes) and copied down; .npy blocks are read on the host.
    """
    (r0, r1), (c0, c1) = rows, cols
    w, dtype = c1 - c0, arr.chunks[0].dtype
    on = device if device.type == "cuda" and isinstance(src, Generated) else torch.device("cpu")
    step = max(1, (256 << 20) // (arr.chunks[0].element_size() * max(1, w)))
    tmp = torch.empty(min(r1 - r0, step), w, dtype=dtype, device=on)
    for r in range(r0, r1, step):
        e = min(r1, r + step)
        src.fill(tmp[: e - r], r, c0)
        arr.write(off + (r - r0) * w, tmp[: e - r].reshape(-1))  # from a GPU: D2H, a sync


class OutOfCore:
    """A and B in host memory, and the streamed product on `device`."""

    def __init__(
        self,
        plan: TilePlan,
        a: Source,
        b: Source,
        dtype: torch.dtype,
        device: torch.device,
        log: Callable[[str], None] = print,
    ):
        n = plan.n
        self.plan, self.dtype, self.device = plan, dtype, device
        t0 = time.perf_counter()
        log(f"out-of-core: allocating {gb(plan.host_bytes)} of host memory for A and B")
        # A row-major; B as contiguous column panels (n×w each), so each panel is one region.
        self.host_a = HostArray(n * n, dtype)
        self.host_b = HostArray(n * n, dtype)
        log(f"  pinned: {self.host_a.pinned} ({time.perf_counter() - t0:.1f} s); filling A")
        _fill_host(self.host_a, 0, a, (0, n), (0, n), device)
        log(f"  filling B ({time.perf_counter() - t0:.1f} s)")
        for c0, c1 in plan.cols:
            _fill_host(self.host_b, n * c0, b, (0, n), (c0, c1), device)
        log(f"  A and B ready ({time.perf_counter() - t0:.1f} s)")

    def a_region(self, r0: int, r1: int) -> tuple[HostArray, int, int]:
        """(array, offset, entries) of A's row panel r0:r1."""
        return self.host_a, r0 * self.plan.n, (r1 - r0) * self.plan.n

    def b_region(self, c0: int, c1: int) -> tuple[HostArray, int, int]:
        """(array, offset, entries) of B's column panel c0:c1, stored (n, c1 - c0) row-major."""
        return self.host_b, c0 * self.plan.n, (c1 - c0) * self.plan.n

    def close(self) -> None:
        self.host_a.close()
        self.host_b.close()

    def multiply(
        self, ctx: DistContext, fr: Freivalds, sampled: SampledEntries, writer: NpyWriter | None
    ) -> dict[str, int]:
        """Every C tile, folded into the verifier (and written, with a writer). Returns bytes moved."""
        return _Pipeline(self, ctx, fr, sampled, writer).run()


class _Pipeline:
    """One pass over the tiles: buffers, streams and events live only for its duration."""

    def __init__(
        self,
        ooc: OutOfCore,
        ctx: DistContext,
        fr: Freivalds,
        sampled: SampledEntries,
        writer: NpyWriter | None,
    ):
        p, dev, dt = ooc.plan, ooc.device, ooc.dtype
        self.ooc, self.ctx, self.fr, self.sampled, self.writer = ooc, ctx, fr, sampled, writer
        self.cuda = dev.type == "cuda"
        n, tm, tn = p.n, p.tm, p.tn
        na, nb = p.buffers
        self.abuf = [torch.empty(tm * n, dtype=dt, device=dev) for _ in range(na)]
        self.bbuf = [torch.empty(n * tn, dtype=dt, device=dev) for _ in range(nb)]
        self.cbuf = [torch.empty(tm * tn, dtype=dt, device=dev) for _ in range(2)]
        # Pinned stages for C tiles on their way to the file (torch rounds each up to a power of
        # two: at most twice a tile, and only with --out).
        pin = self.cuda and writer is not None
        self.stage = (
            [torch.empty(tm * tn, dtype=dt, pin_memory=pin) for _ in range(2)] if writer else []
        )
        if self.cuda:
            self.compute = torch.cuda.current_stream(dev)
            self.a_stream, self.b_stream, self.c_stream = (torch.cuda.Stream(dev) for _ in range(3))
        self.a_panel: list[int | None] = [None, None]  # which row panel each A buffer holds
        self.b_panel: list[int | None] = [None, None]  # which column panel each B buffer holds
        self.ready: dict[tuple[str, int], torch.cuda.Event | None] = {}
        self.free: dict[tuple[str, int], torch.cuda.Event | None] = {}
        self.h2d = self.d2h = 0

    # -- events (all None on the CPU, where every copy has finished when it returns) --------
    def _mark(self, stream=None) -> torch.cuda.Event | None:
        if not self.cuda:
            return None
        ev = torch.cuda.Event()
        ev.record(stream or self.compute)
        return ev

    def _wait(self, ev: torch.cuda.Event | None, stream=None) -> None:
        if ev is not None:
            (stream or self.compute).wait_event(ev)

    def _copy(self, key: tuple[str, int], stream, region: tuple[HostArray, int, int]) -> None:
        """Buffer `key` <- a host region, on `stream` once the buffer's last reader is done."""
        arr, off, numel = region
        dst = (self.abuf if key[0] == "a" else self.bbuf)[key[1]][:numel]
        self.h2d += numel * dst.element_size()
        if not self.cuda:
            arr.read(dst, off)
            return
        with torch.cuda.stream(stream):
            self._wait(self.free.get(key), stream)
            arr.read(dst, off, non_blocking=True)
        self.ready[key] = self._mark(stream)

    def _load_a(self, r: int, slot: int) -> None:
        stream = self.a_stream if self.cuda else None
        self._copy(("a", slot), stream, self.ooc.a_region(*self.ooc.plan.rows[r]))
        self.a_panel[slot] = r

    def _ensure_b(self, c: int, keep: int | None) -> int:
        """The B slot holding column panel c, loading it into the slot other than `keep`."""
        if c in self.b_panel:
            return self.b_panel.index(c)
        slot = 1 - keep if keep is not None else 0
        stream = self.b_stream if self.cuda else None
        self._copy(("b", slot), stream, self.ooc.b_region(*self.ooc.plan.cols[c]))
        self.b_panel[slot] = c
        return slot

    # -- the pass -------------------------------------------------------------------------
    def run(self) -> dict[str, int]:
        p, n = self.ooc.plan, self.ooc.plan.n
        order = p.order()
        self._load_a(order[0][0], 0)
        self._ensure_b(order[0][1], None)
        pending: tuple[int, int, int, int, int] | None = None  # a C tile on its way to the host
        for t, (r, c) in enumerate(order):
            (r0, r1), (c0, c1) = p.rows[r], p.cols[c]
            a_slot, b_slot = self.a_panel.index(r), self.b_panel.index(c)
            first_of_row = t == 0 or order[t - 1][0] != r
            last_of_row = t + 1 == len(order) or order[t + 1][0] != r
            # Prefetch: the next tile's B panel, and at a row's start the next row's A panel.
            if t + 1 < len(order):
                self._ensure_b(order[t + 1][1], keep=b_slot)
            if first_of_row and r + 1 < len(p.rows):
                self._load_a(r + 1, 1 - a_slot)
            self._wait(self.ready.get(("a", a_slot)))
            self._wait(self.ready.get(("b", b_slot)))
            a = self.abuf[a_slot][: (r1 - r0) * n].view(r1 - r0, n)
            b = self.bbuf[b_slot][: n * (c1 - c0)].view(n, c1 - c0)
            ct = self.cbuf[t % 2][: (r1 - r0) * (c1 - c0)].view(r1 - r0, c1 - c0)
            self._wait(self.free.get(("c", t % 2)))  # its previous tile has left for the host
            torch.mm(a, b, out=ct)
            if r == order[0][0]:
                self.fr.add_b(Block(b, 0, c0))  # the first row sees every B panel once
            self.fr.add_c(Block(ct, r0, c0))
            self.sampled.add_c(Block(ct, r0, c0))
            self.free[("b", b_slot)] = self._mark()
            if self.writer is not None:
                pending = self._send_c(t, ct, r0, c0, pending)
            if last_of_row:
                if r == order[0][0]:
                    self.fr.finish_b(self.ctx)  # B·x is complete after the first row
                self.fr.add_a(Block(a, r0, 0))
                self.free[("a", a_slot)] = self._mark()
        if self.cuda:
            torch.cuda.synchronize(self.ooc.device)  # host-device sync: the pass is done
        if pending is not None:
            self._write(pending)
        return {"h2d_bytes": self.h2d, "d2h_bytes": self.d2h}

    def _send_c(self, t: int, ct: torch.Tensor, r0: int, c0: int, pending):
        """Copy tile t to a pinned host stage (async); write the previous one to the file."""
        h, w = ct.shape
        host = self.stage[t % 2][: h * w].view(h, w)
        if self.cuda:
            done = self._mark()
            with torch.cuda.stream(self.c_stream):
                self._wait(done, self.c_stream)
                host.copy_(ct, non_blocking=True)
            self.free[("c", t % 2)] = self._mark(self.c_stream)
        else:
            host.copy_(ct)
        self.d2h += h * w * ct.element_size()
        if pending is not None:
            self._write(pending)  # overlaps this tile's GEMM with the disk write of the last
        return (t, h, w, r0, c0)

    def _write(self, pending) -> None:
        t, h, w, r0, c0 = pending
        ev = self.free.get(("c", t % 2))
        if ev is not None:
            ev.synchronize()  # host-device sync: tile t is in the pinned stage
        self.writer.write(r0, c0, self.stage[t % 2][: h * w].view(h, w))
