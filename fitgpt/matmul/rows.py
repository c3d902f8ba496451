"""The `rows` layout: A and C split by rows, B split by columns and broadcast panel by panel.

With P ranks, rank r owns row block r of A and C and column block r of B. The columns of B
are cut into panels of at most `panel` columns; step k broadcasts panel k from its owner and
every rank computes its piece of C's column panel k:

            B: | panel 0 | panel 1 | ... |      (columns of B, owned block by block)
                    |  broadcast, next one in flight while this one is multiplied
                    v
    rank r:  C[rows_r, panel k] = A[rows_r, :] · B[:, panel k]

The broadcast of panel k+1 is issued before the product of panel k and waited on only after
it, so communication hides behind the GEMM (panel k+1's buffer was last read by panel k-1).

Memory per rank (s bytes an entry, m = n/P rows, w = panel width):
    A rows m·n + C rows m·n + own B columns n·m + 2 receive buffers 2·n·w
against the seed's version, A rows + C rows + ALL of B (n·n) on every device. For n = 50000
fp32 (auto panels): 16.4 GB instead of 20 GB on 2 GPUs, 8.8 instead of 15 on 4, 4.4 instead of
12.5 on 8. The seed could never go below 10 GB a device (all of B); this scales as 3n²/P.
Traffic: every rank receives the n·(n - m) entries of B it does not own, once.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from fitgpt.dist import DistContext
from fitgpt.matmul.blocks import Block, panels, split
from fitgpt.matmul.operands import Source, block


@dataclass(frozen=True)
class RowsPlan:
    """Who owns what, and the bytes it costs, before anything is allocated."""

    n: int
    world: int
    rank: int
    itemsize: int
    panel: int

    @property
    def rows(self) -> tuple[int, int]:
        return split(self.n, self.world)[self.rank]

    @property
    def steps(self) -> list[tuple[int, int, int]]:
        """(owner rank, first column, end column) of each broadcast panel of B, in order."""
        return [
            (owner, c0, c1)
            for owner, (s, e) in enumerate(split(self.n, self.world))
            for c0, c1 in panels(s, e, self.panel)
        ]

    @property
    def held_bytes(self) -> int:
        n, (r0, r1) = self.n, self.rows
        own_cols = split(n, self.world)[self.rank]
        buffers = 2 * n * max((c1 - c0 for _, c0, c1 in self.steps), default=0)
        return self.itemsize * (
            2 * (r1 - r0) * n + n * (own_cols[1] - own_cols[0]) + (buffers if self.world > 1 else 0)
        )

    @property
    def comm_bytes(self) -> int:
        own = split(self.n, self.world)[self.rank]
        return self.itemsize * self.n * (self.n - (own[1] - own[0]))


class RowsProduct:
    """Rank `ctx.rank`'s blocks of A, B and C, and the panel-broadcast product."""

    def __init__(self, ctx: DistContext, plan: RowsPlan, a: Source, b: Source, dtype: torch.dtype):
        n, dev = plan.n, ctx.device
        self.ctx, self.plan = ctx, plan
        self.steps = plan.steps
        r0, r1 = plan.rows
        self.a = block(a, (r0, r1), (0, n), dtype, dev)  # (m, n)
        # Own panels of B, each contiguous (n, w) so it can be broadcast in place.
        self.own = {
            k: block(b, (0, n), (c0, c1), dtype, dev)
            for k, (owner, c0, c1) in enumerate(self.steps)
            if owner == ctx.rank
        }
        self.c = torch.empty(r1 - r0, n, dtype=dtype, device=dev)  # (m, n)
        width = max((c1 - c0 for _, c0, c1 in self.steps), default=0)
        # Two flat receive buffers (n·w each), viewed per panel: panel k lands in buffer k % 2.
        self.buffers = (
            [torch.empty(n * width, dtype=dtype, device=dev) for _ in range(2)]
            if ctx.distributed
            else []
        )

    def warm(self) -> None:
        """Pay first-call costs (cuBLAS handles, NCCL connections) outside the timed product."""
        x = torch.zeros(4, 4, dtype=self.a.dtype, device=self.a.device)
        torch.mm(x, x)
        if self.ctx.distributed:
            dist.broadcast(x, src=0, group=self.ctx.group)

    def _start(self, k: int) -> tuple[torch.Tensor, dist.Work | None]:
        """Panel k of B on this rank: its own, or a buffer a broadcast is filling (async)."""
        owner, c0, c1 = self.steps[k]
        if k in self.own:
            panel = self.own[k]
        else:
            panel = self.buffers[k % 2][: self.plan.n * (c1 - c0)].view(self.plan.n, c1 - c0)
        if not self.ctx.distributed:
            return panel, None
        return panel, dist.broadcast(panel, src=owner, group=self.ctx.group, async_op=True)

    def multiply(self) -> None:
        """C[rows_r, :] = A[rows_r, :] · B, one column panel at a time."""
        if not self.steps:
            return
        upcoming = self._start(0)
        for k, (_, c0, c1) in enumerate(self.steps):
            panel, work = upcoming
            if k + 1 < len(self.steps):
                upcoming = self._start(k + 1)  # next panel's transfer overlaps this GEMM
            if work is not None:
                work.wait()  # on a GPU: the compute stream waits for NCCL, the host does not
            # C's column panel is a strided view (stride n): cuBLAS writes it in place.
            torch.mm(self.a, panel, out=self.c[:, c0:c1])

    @property
    def a_blocks(self) -> list[Block]:
        return [Block(self.a, self.plan.rows[0], 0)]

    @property
    def b_blocks(self) -> list[Block]:
        return [Block(p, 0, self.steps[k][1]) for k, p in self.own.items()]

    @property
    def c_blocks(self) -> list[Block]:
        return [Block(self.c, self.plan.rows[0], 0)]
