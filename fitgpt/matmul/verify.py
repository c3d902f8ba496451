"""Is C = A·B? Freivalds' check and sampled exact entries, without any matrix on one device.

Freivalds: for a random x, A·(B·x) must equal C·x. Each rank adds what its own blocks give,
all in float64, and the partial vectors are summed across ranks:

    Bx  = Σ_blocks  B[R, K]·x[K]      -> all-reduce (n floats)
    ABx = Σ_blocks  A[R, K]·Bx[K]     \\
    Cx  = Σ_blocks  C[R, K]·x[K]      /  -> all-reduce (2n floats)
    error = ||ABx - Cx|| / ||ABx||

It costs three matrix-vector products (O(n²), ~1e-5 of the O(n³) product) and checks the
product of the operands exactly as stored, so it measures the GEMM's own rounding. A wrong
entry C[i, j] moves (Cx)[i] by its error times |x[j]| >= 1/2, so one bad block fails it.

Sampled entries: C[i, j] at `samples` random positions against Σ_k A[i, k]·B[k, j] computed
in float64 from a row of A and a column of B regenerated from the source (or re-read from
the .npy), so it also catches operands that were generated, loaded or stored wrongly.

Tolerances (relative error, both checks): the error of a length-n dot product with unit
roundoff u is about sqrt(n)·u in relative terms for fp32 accumulation, while rounding the
inputs (tf32, bf16) adds about u_in independently of n:
  fp32  u = 6e-8, sqrt(1e6)·u = 6e-5  -> 1e-4 holds up to n = 10^6
  tf32  u_in = 2^-11 = 4.9e-4         -> 1e-2
  bf16  u_in = 2^-8  = 3.9e-3 (and C rounded to bf16) -> 3e-2
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import numpy as np
import torch
import torch.distributed as dist

from fitgpt.dist import DistContext
from fitgpt.matmul.blocks import Block
from fitgpt.matmul.operands import Source, check_vector, row_col_dot

TOLERANCE = {"fp32": 1e-4, "tf32": 1e-2, "bf16": 3e-2}
# float64 temporaries of the matrix-vector products are cut to this size.
VERIFY_CHUNK_BYTES = 256 << 20


def mv64(m: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """m (h, w) of any float dtype times v (w,) float64, in float64, row chunk by row chunk."""
    out = torch.empty(m.shape[0], dtype=torch.float64, device=m.device)
    step = max(1, VERIFY_CHUNK_BYTES // (8 * max(1, m.shape[1])))
    for r in range(0, m.shape[0], step):
        torch.mv(m[r : r + step].to(torch.float64), v, out=out[r : r + step])
    return out


def _sum(ctx: DistContext, t: torch.Tensor) -> torch.Tensor:
    if ctx.distributed:
        dist.all_reduce(t, group=ctx.group)
    return t


class Freivalds:
    """Accumulates B·x, then A·(B·x) and C·x, from whatever blocks this rank holds."""

    def __init__(self, x: torch.Tensor):
        n, dev = x.shape[0], x.device
        self.x = x
        self.bx = torch.zeros(n, dtype=torch.float64, device=dev)
        self.abx_cx = torch.zeros(2, n, dtype=torch.float64, device=dev)
        self.bx_done = False

    def add_b(self, blk: Block) -> None:
        (r0, r1), (c0, c1) = blk.rows, blk.cols
        self.bx[r0:r1] += mv64(blk.data, self.x[c0:c1])

    def finish_b(self, ctx: DistContext) -> None:
        """Sum B·x over ranks; every add_a comes after this."""
        _sum(ctx, self.bx)
        self.bx_done = True

    def add_a(self, blk: Block) -> None:
        assert self.bx_done, "A·(B·x) needs all of B·x: call finish_b first"
        (r0, r1), (c0, c1) = blk.rows, blk.cols
        self.abx_cx[0, r0:r1] += mv64(blk.data, self.bx[c0:c1])

    def add_c(self, blk: Block) -> None:
        (r0, r1), (c0, c1) = blk.rows, blk.cols
        self.abx_cx[1, r0:r1] += mv64(blk.data, self.x[c0:c1])

    def error(self, ctx: DistContext) -> float:
        abx, cx = _sum(ctx, self.abx_cx)
        ref = torch.linalg.vector_norm(abx)
        return float(torch.linalg.vector_norm(abx - cx) / ref)  # host-device sync


class SampledEntries:
    """`count` positions of C chosen from the seed; each rank records the ones it holds."""

    def __init__(self, n: int, count: int, seed: int, device: torch.device):
        rng = np.random.default_rng([seed, 0x5A3])
        self.i = rng.integers(0, n, size=count)
        self.j = rng.integers(0, n, size=count)
        self.owned = np.zeros(count, dtype=bool)
        self.values = torch.zeros(count, dtype=torch.float64, device=device)
        # The positions on the device too: one small host-device copy (a sync) now, none later.
        self.i_dev = torch.from_numpy(self.i).to(device)
        self.j_dev = torch.from_numpy(self.j).to(device)

    def add_c(self, blk: Block) -> None:
        """Record the samples inside this block: fixed-size device ops, no host-device sync."""
        (r0, r1), (c0, c1) = blk.rows, blk.cols
        inside = (self.i >= r0) & (self.i < r1) & (self.j >= c0) & (self.j < c1)
        if not inside.any():
            return
        i, j = self.i_dev, self.j_dev
        on_dev = (i >= r0) & (i < r1) & (j >= c0) & (j < c1)
        got = blk.data[(i - r0).clamp(0, r1 - r0 - 1), (j - c0).clamp(0, c1 - c0 - 1)]
        self.values = torch.where(on_dev, got.to(torch.float64), self.values)
        self.owned |= inside

    def error(self, ctx: DistContext, a: Source, b: Source) -> float:
        """Relative error of the sampled entries against float64 dot products of the sources."""
        refs = torch.zeros_like(self.values)
        for k in np.nonzero(self.owned)[0]:
            refs[k] = row_col_dot(a, b, int(self.i[k]), int(self.j[k]), refs.device)
        both = _sum(ctx, torch.stack([self.values, refs]))
        if both.shape[1] == 0:
            return 0.0
        return float(
            torch.linalg.vector_norm(both[0] - both[1]) / torch.linalg.vector_norm(both[1])
        )  # sync


@dataclass
class Verdict:
    freivalds: float
    sampled: float
    samples: int
    tolerance: float

    @property
    def passed(self) -> bool:
        # A NaN error compares False, so NaN fails too.
        return self.freivalds <= self.tolerance and self.sampled <= self.tolerance

    def summary(self) -> str:
        word = "PASS" if self.passed else "FAIL"
        return (
            f"Freivalds {self.freivalds:.2e}, {self.samples} sampled entries {self.sampled:.2e}, "
            f"tolerance {self.tolerance:.0e}: {word}"
        )

    def record(self) -> dict:
        return {**asdict(self), "passed": self.passed}


def verify_blocks(
    ctx: DistContext,
    dtype: str,
    seed: int,
    n: int,
    sources: tuple[Source, Source],
    a_blocks: list[Block],
    b_blocks: list[Block],
    c_blocks: list[Block],
    samples: int,
) -> Verdict:
    """Both checks over the blocks this rank holds (every rank calls it; all get the verdict)."""
    fr = Freivalds(check_vector(seed, n, ctx.device))
    for blk in b_blocks:
        fr.add_b(blk)
    fr.finish_b(ctx)
    for blk in a_blocks:
        fr.add_a(blk)
    sampled = SampledEntries(n, samples, seed, ctx.device)
    for blk in c_blocks:
        fr.add_c(blk)
        sampled.add_c(blk)
    return Verdict(fr.error(ctx), sampled.error(ctx, *sources), samples, TOLERANCE[dtype])
