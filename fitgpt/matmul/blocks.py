"""How an n×n matrix is cut into pieces: near-equal index ranges, and a piece held by one rank.

Every layout cuts rows and columns the same way, `split(n, parts)`: the first n % parts pieces
get one extra index, so sizes differ by at most one and n need not be divisible by anything
(n=37 over a 2×2 grid gives row blocks of 19 and 18).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


def split(n: int, parts: int) -> list[tuple[int, int]]:
    """`parts` half-open ranges [start, stop) covering 0..n, sizes differing by at most one."""
    base, extra = divmod(n, parts)
    out, start = [], 0
    for p in range(parts):
        stop = start + base + (1 if p < extra else 0)
        out.append((start, stop))
        start = stop
    return out


def panels(start: int, stop: int, width: int) -> list[tuple[int, int]]:
    """[start, stop) cut into the fewest near-equal ranges of at most `width` indices.

    Balanced rather than `width, width, ..., remainder`: a last sliver of a few columns would
    be a GEMM too thin to run at full rate.
    """
    count = -(-(stop - start) // width)
    return [(start + a, start + b) for a, b in split(stop - start, count)] if count else []


@dataclass
class Block:
    """A piece of a matrix held on one rank: data[r, c] is the matrix entry (r0 + r, c0 + c)."""

    data: torch.Tensor  # (h, w) on the rank's device
    r0: int
    c0: int

    @property
    def rows(self) -> tuple[int, int]:
        return self.r0, self.r0 + self.data.shape[0]

    @property
    def cols(self) -> tuple[int, int]:
        return self.c0, self.c0 + self.data.shape[1]
