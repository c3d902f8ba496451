"""The `2d` layout: SUMMA on a q×q process grid (van de Geijn & Watts, 1997).

Rank r sits at grid row i = r // q, column j = r % q and owns blocks A_ij, B_ij and C_ij of
a q×q blocking of the matrices (near-equal blocks, so n need not be divisible by q). The
inner dimension is walked in panels of at most `panel` indices; for the panel K inside
inner block k:

              grid column k                         grid row k
    A[I_i, K] ---------------> all of grid row i    B[K, J_j] ---------------> all of column j
     (owner (i, k))             (row group)          (owner (k, j))             (column group)

    every rank:  C_ij += A[I_i, K] · B[K, J_j]

Both broadcasts of the next panel are issued before this panel's product and waited on
after it, so communication overlaps the GEMM. Memory per rank (m = n/q): A_ij, B_ij and C_ij
(3·m², C kept in fp32) plus two buffers for each operand's panels (4·m·w); a rank receives
(n - m)·m entries of A and as many of B, 2·(n²/q)·(1 - 1/q) in all, against n²·(1 - 1/P) for
the rows layout: the gap widens with P, which is why SUMMA scales to many GPUs.

P must be a perfect square (1, 4, 9, 16...): a q×q grid keeps both broadcast directions
balanced. For other counts (2, 8) the rows layout is the right tool; we refuse rather than
leave ranks idle on the largest square grid.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist

from fitgpt.dist import DistContext
from fitgpt.errors import UserError
from fitgpt.matmul.blocks import Block, panels, split
from fitgpt.matmul.operands import Source, block


def grid_side(world: int) -> int:
    """q for a q×q grid of `world` ranks; a one-line UserError when there is none."""
    q = math.isqrt(world)
    if q * q != world:
        below, above = q * q, (q + 1) ** 2
        raise UserError(
            f"--layout 2d: {world} ranks do not form a square grid; use --layout rows, "
            f"or run {below} or {above} ranks"
        )
    return q


@dataclass(frozen=True)
class SummaPlan:
    n: int
    world: int
    rank: int
    itemsize: int
    panel: int

    def __post_init__(self) -> None:
        grid_side(self.world)  # refuse a non-square world before anything is allocated

    @property
    def q(self) -> int:
        return grid_side(self.world)

    @property
    def coords(self) -> tuple[int, int]:
        return divmod(self.rank, self.q)

    @property
    def rows(self) -> tuple[int, int]:
        return split(self.n, self.q)[self.coords[0]]

    @property
    def cols(self) -> tuple[int, int]:
        return split(self.n, self.q)[self.coords[1]]

    @property
    def steps(self) -> list[tuple[int, int, int]]:
        """(inner block k, first inner index, end) of each panel, in order."""
        return [
            (k, k0, k1)
            for k, (s, e) in enumerate(split(self.n, self.q))
            for k0, k1 in panels(s, e, self.panel)
        ]

    @property
    def held_bytes(self) -> int:
        (r0, r1), (c0, c1) = self.rows, self.cols
        m, w = r1 - r0, c1 - c0
        width = max((k1 - k0 for _, k0, k1 in self.steps), default=0)
        s = self.itemsize
        held = s * (m * w + m * w) + 4 * m * w  # A_ij, B_ij (square blocks), C_ij in fp32
        if s < 4:
            held += s * m * w  # bf16: each panel product is rounded in a buffer, then added
        if self.world > 1:
            held += 2 * s * (m * width + width * w)
        return held

    @property
    def comm_bytes(self) -> int:
        (r0, r1), (c0, c1) = self.rows, self.cols
        i, j = self.coords
        got = 0
        for k, k0, k1 in self.steps:
            got += (k1 - k0) * (r1 - r0) if k != j else 0  # A panel from (i, k)
            got += (k1 - k0) * (c1 - c0) if k != i else 0  # B panel from (k, j)
        return self.itemsize * got


def _grid_groups(
    ctx: DistContext, q: int
) -> tuple[dist.ProcessGroup | None, dist.ProcessGroup | None]:
    """This rank's grid-row and grid-column groups. Every rank creates every group, in the same
    order, as torch.distributed requires."""
    if not ctx.distributed:
        return None, None
    i, j = divmod(ctx.rank, q)
    row = col = None
    for g in range(q):
        group = dist.new_group([g * q + c for c in range(q)])
        row = group if g == i else row
    for g in range(q):
        group = dist.new_group([r * q + g for r in range(q)])
        col = group if g == j else col
    return row, col


class SummaProduct:
    """Rank `ctx.rank`'s blocks A_ij, B_ij, C_ij and the SUMMA product."""

    def __init__(self, ctx: DistContext, plan: SummaPlan, a: Source, b: Source, dtype: torch.dtype):
        dev, q = ctx.device, plan.q
        self.ctx, self.plan, self.q = ctx, plan, q
        self.i, self.j = plan.coords
        self.steps = plan.steps
        (r0, r1), (c0, c1) = plan.rows, plan.cols
        self.row_group, self.col_group = _grid_groups(ctx, q)
        # A_ij kept as its own contiguous column panels (each broadcast in place);
        # B_ij as one block whose row panels are contiguous slices already.
        self.a_own = {
            s: block(a, (r0, r1), (k0, k1), dtype, dev)
            for s, (k, k0, k1) in enumerate(self.steps)
            if k == self.j
        }
        self.b = block(b, (r0, r1), (c0, c1), dtype, dev)  # inner block i = row block i
        self.b_off = r0
        # C accumulates over the panels in fp32: a bf16 C would be rounded once per panel.
        self.c = torch.empty(r1 - r0, c1 - c0, dtype=torch.float32, device=dev)
        self.tmp = torch.empty_like(self.c, dtype=dtype) if dtype != torch.float32 else None
        width = max((k1 - k0 for _, k0, k1 in self.steps), default=0)
        m, w = r1 - r0, c1 - c0
        self.abuf = (
            [torch.empty(m * width, dtype=dtype, device=dev) for _ in range(2)]
            if ctx.distributed
            else []
        )
        self.bbuf = (
            [torch.empty(width * w, dtype=dtype, device=dev) for _ in range(2)]
            if ctx.distributed
            else []
        )

    def warm(self) -> None:
        """Pay first-call costs (cuBLAS handles, NCCL communicators of the grid groups) now."""
        x = torch.zeros(4, 4, dtype=self.b.dtype, device=self.b.device)
        torch.mm(x, x)
        if self.ctx.distributed:
            dist.broadcast(x, src=self.i * self.q, group=self.row_group)
            dist.broadcast(x, src=self.j, group=self.col_group)

    def _start(self, s: int) -> tuple[torch.Tensor, torch.Tensor, list]:
        """Panels A[I_i, K] and B[K, J_j] of step s, their broadcasts in flight (async)."""
        k, k0, k1 = self.steps[s]
        m, w, kw = self.c.shape[0], self.c.shape[1], k1 - k0
        a = self.a_own[s] if k == self.j else self.abuf[s % 2][: m * kw].view(m, kw)
        if k == self.i:
            b = self.b[k0 - self.b_off : k1 - self.b_off]
        else:
            b = self.bbuf[s % 2][: kw * w].view(kw, w)
        if not self.ctx.distributed:
            return a, b, []
        works = [
            dist.broadcast(a, src=self.i * self.q + k, group=self.row_group, async_op=True),
            dist.broadcast(b, src=k * self.q + self.j, group=self.col_group, async_op=True),
        ]
        return a, b, works

    def multiply(self) -> None:
        """C_ij = Σ_K A[I_i, K] · B[K, J_j] over all inner panels K."""
        if not self.steps:
            self.c.zero_()
            return
        upcoming = self._start(0)
        for s in range(len(self.steps)):
            a, b, works = upcoming
            if s + 1 < len(self.steps):
                upcoming = self._start(s + 1)  # next panels' broadcasts overlap this GEMM
            for work in works:
                work.wait()  # on a GPU: a stream wait, no host sync
            if self.tmp is None:
                if s == 0:
                    torch.mm(a, b, out=self.c)
                else:
                    self.c.addmm_(a, b)
            else:
                torch.mm(a, b, out=self.tmp)  # bf16 GEMM, fp32 accumulation inside
                if s == 0:
                    self.c.copy_(self.tmp)
                else:
                    self.c.add_(self.tmp)

    @property
    def a_blocks(self) -> list[Block]:
        return [Block(p, self.plan.rows[0], self.steps[s][1]) for s, p in self.a_own.items()]

    @property
    def b_blocks(self) -> list[Block]:
        return [Block(self.b, self.b_off, self.plan.cols[0])]

    @property
    def c_blocks(self) -> list[Block]:
        return [Block(self.c, self.plan.rows[0], self.plan.cols[0])]
