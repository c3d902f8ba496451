"""Expert-parallel state on its way in and out: initialisation, checkpoints, the whole model for
sampling (tp_state.py's counterpart for fitgpt/parallel/experts.py).

A checkpoint holds the full layout (engine/layout.py: every expert of each `block.i.experts`
chunk). Rank r of a P-rank EP group holds experts [r·E/P, (r+1)·E/P): of each of the experts'
parameters (`mlp.experts.fc` [E·2F, H], `.proj` [E·H, F]; gpt-oss's [E, ...]: expert-major
along the first dimension) its r-th block of rows, one contiguous range of the full chunk per
parameter. So each rank writes its ranges as
pieces of the full chunk (to_full) and reads them back the same way (ExpertReader): no
collective at save or load, and any P (or none) reads any other's checkpoint. Initialisation
draws every parameter whole (the same values at any P) and keeps this rank's rows.

Legend: `full` the unsplit model's layout (what checkpoints record), `local` this rank's.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import torch
import torch.distributed as dist
from torch import Tensor

from fitgpt.dist.mesh import ExpertGroups
from fitgpt.engine.layout import EXPERTS, ChunkSpec
from fitgpt.engine.state_io import Piece, Reader, WeightSource, open_reader


def slot_ranges(full: ChunkSpec, local: ChunkSpec, rank: int, lo: int, hi: int):
    """(local a, local b, full a) for each piece of local elements [lo, hi) of an experts'
    chunk: rank r's part of each parameter is its r-th block of rows, contiguous in the full
    chunk (expert-major rows)."""
    for fs, ls in zip(full.slots, local.slots, strict=True):
        a, b = max(lo, ls.offset), min(hi, ls.offset + ls.numel)
        if a < b:
            yield a, b, fs.offset + rank * ls.numel + (a - ls.offset)


class ExpertReader:
    """A full-layout reader read in this rank's layout: an experts' chunk's ranges mapped to
    this rank's rows of the full chunk, every other chunk as it is."""

    def __init__(self, reader: Reader, full: list[ChunkSpec], local: list[ChunkSpec], rank: int):
        self.reader, self.full, self.local, self.rank = reader, full, local, rank

    def read(self, chunk: int, kind: str, lo: int, hi: int, out: Tensor | None = None) -> Tensor:
        if not self.local[chunk].experts:
            return self.reader.read(chunk, kind, lo, hi, out)
        if out is None:
            out = torch.empty(hi - lo, dtype=torch.float32)
        for a, b, f in slot_ranges(self.full[chunk], self.local[chunk], self.rank, lo, hi):
            self.reader.read(chunk, kind, f, f + b - a, out=out[a - lo : b - lo])
        return out


class ExpertView:
    """engine/transforms/build.py's StateView under expert parallelism: whole parameters drawn
    and this rank's experts kept; checkpoints read and written in the full layout."""

    def __init__(self, full: list[ChunkSpec], local: list[ChunkSpec], groups: ExpertGroups):
        self.full, self.local, self.groups = full, local, groups
        self.shapes = {s.name: s.shape for c in full for s in c.slots}

    def init(self, init: Callable[[str, Tensor], None]) -> Callable[[str, Tensor], None]:
        def init_local(name: str, t: Tensor) -> None:
            if EXPERTS not in name:
                init(name, t)
                return
            whole = torch.empty(self.shapes[name], dtype=t.dtype, device=t.device)
            init(name, whole)  # the same values at any P; transient: one whole parameter
            t.copy_(whole.chunk(self.groups.size, 0)[self.groups.rank])

        return init_local

    def reader(self, src: Path | WeightSource) -> Reader:
        return ExpertReader(open_reader(src), self.full, self.local, self.groups.rank)

    def to_full(self, piece: Piece) -> list[Piece]:
        """This rank's piece of a chunk as pieces of the full layout."""
        local = self.local[piece.chunk]
        if not local.experts:
            return [piece]
        return [
            Piece(piece.chunk, f, f + b - a, {k: t[a - piece.lo : b - piece.lo] for k, t in
                                              piece.tensors.items()})
            for a, b, f in slot_ranges(self.full[piece.chunk], local, self.groups.rank,
                                       piece.lo, piece.hi)
        ]  # fmt: skip

    def pieces(self, local: Iterator) -> Iterator[Piece]:
        """Whole-chunk pieces are tensor parallelism's way to save (the engines call pieces()
        only with a TP mesh); expert parallelism is refused beside TP (plan/validate.py), and
        its ranks save their own pieces in the full layout through to_full."""
        raise RuntimeError("expert parallelism with tensor parallelism: refused by the planner")

    def unsplit(self, name: str, t: Tensor) -> Tensor:
        """The whole parameter from every EP rank's rows (collective over the EP group)."""
        if EXPERTS not in name or self.groups.group is None:
            return t
        parts = [torch.empty_like(t) for _ in range(self.groups.size)]
        dist.all_gather(parts, t.contiguous(), group=self.groups.group)
        return torch.cat(parts, 0)
