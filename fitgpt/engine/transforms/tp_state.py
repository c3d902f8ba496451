"""Tensor-parallel state on its way in and out: initialisation, gradient norm, checkpoints.

A checkpoint of a tensor-parallel run is written in the format every other run writes
(engine/state_io.py): each chunk's full, unsplit flat buffer, in the layout of the unsplit model.
At save each chunk is gathered, one at a time and one kind of state at a time, first over the
data-parallel group (the ZeRO shards of this rank's split chunk) and then over the TP group (the
T splits), and global rank 0 writes it. At load every rank reads the full chunk and keeps its
split (TPReader). So a run saved at T=2 resumes at T=1, T=2, or ZeRO-3 on any number of ranks,
and `fitgpt generate`/`export` read it on one device, with nothing downstream aware of T.

Cost: the save moves each chunk's fp32 state (12 bytes per parameter with the moments) through
the collectives once, and rank 0 holds one full chunk of one kind (4 bytes per parameter of the
largest chunk) at a time; the load reads each chunk whole on every rank (T times the bytes).

Legend: `full` refers to the unsplit model's layout (what checkpoints record), `local` to this
rank's (the split parameters 1/T of their elements, same names and order).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import torch
import torch.distributed as dist
from torch import Tensor

from fitgpt.dist.mesh import Mesh
from fitgpt.engine.layout import ChunkSpec
from fitgpt.engine.state_io import Piece, StateReader
from fitgpt.parallel.shard import shard_of, unshard


def sharded_init(
    init: Callable[[str, Tensor], None], full: list[ChunkSpec], mesh: Mesh
) -> Callable[[str, Tensor], None]:
    """init(name, t) for the local tensor t: the full tensor initialised by name (the same values
    at any T), then this rank's part copied in. Transient: one full parameter."""
    slots = {s.name: s for c in full for s in c.slots}

    def init_local(name: str, t: Tensor) -> None:
        s = slots[name]
        if s.split is None:
            init(name, t)
            return
        whole = torch.empty(s.shape, dtype=t.dtype, device=t.device)
        init(name, whole)
        t.copy_(shard_of(s.split, whole, mesh.tp_rank, mesh.tp))

    return init_local


def replicated_ranges(local: ChunkSpec) -> list[tuple[int, int]]:
    """[lo, hi) of the chunk's flat buffer holding replicated parameters."""
    return [(s.offset, s.offset + s.numel) for s in local.slots if s.split is None]


class TPGradNorm:
    """The squared global gradient norm under TP: every split parameter's square counted on the
    rank that holds it, a replicated one's once (its gradient is the same on every TP rank, so
    each counts 1/T of it), summed over the TP group."""

    def __init__(self, mesh: Mesh) -> None:
        self.mesh = mesh

    def local_sq(self, grad: Tensor, ranges: list[tuple[int, int]], offset: int) -> Tensor:
        """This rank's share of sum(g²) for `grad`, elements [offset, offset+len) of a chunk
        whose replicated parameters lie in `ranges`."""
        sq = torch.linalg.vector_norm(grad, dtype=torch.float32).square()
        rep = torch.zeros_like(sq)
        for lo, hi in ranges:
            a, b = max(lo, offset) - offset, min(hi, offset + grad.numel()) - offset
            if a < b:
                rep += torch.linalg.vector_norm(grad[a:b], dtype=torch.float32).square()
        return sq - rep * (1.0 - 1.0 / self.mesh.tp)

    def total(self, sq: Tensor) -> Tensor:
        """sq summed over the TP group (blocking: one scalar)."""
        if self.mesh.tp_group is not None:
            dist.all_reduce(sq, group=self.mesh.tp_group)
        return sq


def sync_replicated(grads: list[Tensor], mesh: Mesh) -> None:
    """Sequence parallelism: the replicated parameters' gradients, partial sums over each TP
    rank's tokens, summed over the TP group in place (one all-reduce of their concatenation:
    the LayerNorms' and biases' few elements per block)."""
    if mesh.tp_group is None or not grads:
        return
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat, group=mesh.tp_group)
    offset = 0
    for g in grads:
        g.copy_(flat[offset : offset + g.numel()].view_as(g))
        offset += g.numel()


class SequenceParallelGrads:
    """The chunk engine's hook for sync_replicated: called by the gradient reducer when a
    chunk's backward is complete, before its data-parallel reduction (stages 0-1: at the last
    micro-batch, on the accumulated flat gradient; stages 2-3: every micro-batch, on the
    per-parameter gradients)."""

    def __init__(self, mesh: Mesh, local: list[ChunkSpec]) -> None:
        self.mesh = mesh
        self.ranges = [replicated_ranges(c) for c in local]

    def __call__(self, c) -> None:
        if c.grad is not None:
            parts = [c.grad[a:b] for a, b in self.ranges[c.spec.index]]
        else:
            parts = [p.grad for p, s in zip(c.params, c.spec.slots) if s.split is None]
        sync_replicated(parts, self.mesh)


def tp_gather(t: Tensor, mesh: Mesh, device: torch.device) -> list[Tensor]:
    """Every TP rank's `t` (equal shapes), in TP-rank order, on the CPU. Through `device` (NCCL
    moves device tensors only): a transient of T times t there."""
    if mesh.tp_group is None:
        return [t]
    src = t.to(device).contiguous()
    parts = [torch.empty_like(src) for _ in range(mesh.tp)]
    dist.all_gather(parts, src, group=mesh.tp_group)
    return [p.cpu() for p in parts]


def unsplitter(
    mesh: Mesh, device: torch.device, layout: list[ChunkSpec]
) -> Callable[[str, Tensor], Tensor]:
    """unsplit(name, t): the whole parameter from every TP rank's part t (collective); `layout`
    says how each is cut (any layout of the model: the cuts are the same)."""
    rules = {s.name: s.split for c in layout for s in c.slots}

    def unsplit(name: str, t: Tensor) -> Tensor:
        if rules[name] is None:
            return t
        return unshard(rules[name], tp_gather(t, mesh, device)).to(t.device)

    return unsplit


def full_flat(locals_: list[Tensor], full: ChunkSpec, local: ChunkSpec) -> Tensor:
    """The full chunk's flat buffer [n] from every TP rank's local flat buffer."""
    out = torch.empty(full.numel, dtype=locals_[0].dtype)
    for fs, ls in zip(full.slots, local.slots):
        parts = [t[ls.offset : ls.offset + ls.numel].view(ls.shape) for t in locals_]
        out[fs.offset : fs.offset + fs.numel] = unshard(ls.split, parts).reshape(-1)
    return out


def local_flat(full_t: Tensor, full: ChunkSpec, local: ChunkSpec, mesh: Mesh) -> Tensor:
    """This rank's local flat buffer [n_local] from the full chunk's."""
    out = torch.empty(local.numel, dtype=full_t.dtype)
    for fs, ls in zip(full.slots, local.slots):
        whole = full_t[fs.offset : fs.offset + fs.numel].view(fs.shape)
        part = shard_of(ls.split, whole, mesh.tp_rank, mesh.tp)
        out[ls.offset : ls.offset + ls.numel] = part.reshape(-1)
    return out


class TPReader:
    """StateReader's read() in this rank's local coordinates: each chunk and kind read whole
    from the (full-layout) checkpoint once and split; the last one is kept for the next range."""

    def __init__(self, reader: StateReader, full: list[ChunkSpec], local: list[ChunkSpec], mesh):
        self.reader, self.full, self.local, self.mesh = reader, full, local, mesh
        self.cached: tuple[tuple[int, str], Tensor] | None = None

    def read(self, chunk: int, kind: str, lo: int, hi: int, out: Tensor | None = None) -> Tensor:
        if self.cached is None or self.cached[0] != (chunk, kind):
            f = self.full[chunk]
            whole = self.reader.read(chunk, kind, 0, f.numel)
            self.cached = ((chunk, kind), local_flat(whole, f, self.local[chunk], self.mesh))
        part = self.cached[1][lo:hi]
        return part.clone() if out is None else out.copy_(part)


def tp_pieces(
    local_chunks: Iterator[tuple[ChunkSpec, dict[str, Tensor]]],
    full: list[ChunkSpec],
    mesh: Mesh,
    device: torch.device,
) -> Iterator[Piece]:
    """Full-layout pieces from (local spec, {kind: local flat [n_local] fp32}) per chunk: gathered
    over the TP group. Every TP rank must consume it (collectives); only one needs to write."""
    for local, tensors in local_chunks:
        f = full[local.index]
        out = {k: full_flat(tp_gather(t, mesh, device), f, local) for k, t in tensors.items()}
        yield Piece(local.index, 0, f.numel, out)
