"""Byte accounting of the chunked engine: what one rank holds, by tier and kind of state.

Two figures, for two moments:
  host_state_bytes / check_host_room  before anything is allocated: the host RAM this rank will
      hold for the offloaded chunks, from the layout and each chunk's home; a placement that
      does not fit in the RAM the machine can give now is refused at start-up.
  memory_report                       after construction: the bytes the engine's buffers
      actually hold now, {tier: {kind: bytes}}, kinds as in plan/memory.py (whose predictions
      the tests hold equal to these).
Element counts: a chunk of n parameters is padded to N (a multiple of W·128); its optimizer
range on one rank is N at stage 0, s = N/W from stage 1 on. fp32 master and moments take 4 bytes
per element each (compressed moments: moments.store_nbytes), the working dtype 2 (bf16/fp16).
"""

from __future__ import annotations

import os

import torch
from torch import Tensor

from fitgpt.engine.chunk import Chunk, padded
from fitgpt.engine.layout import ChunkSpec
from fitgpt.engine.moments import store_nbytes
from fitgpt.engine.offload import HOST_SLOTS, DiskTier, HostOptimizer
from fitgpt.errors import UserError
from fitgpt.plan.hardware import host_usable


def opt_elems(spec: ChunkSpec, world: int, stage: int) -> int:
    """Elements of a chunk's optimizer range on one rank."""
    return padded(spec.numel, world) // (world if stage >= 1 else 1)


def host_state_bytes(
    layout,
    homes: list[str],
    dtype: torch.dtype,
    world: int,
    stage: int,
    moments: str = "fp32",
    weights_on_host: bool = False,
    delayed: bool = False,
) -> int:
    """Bytes this rank will hold in host memory for offloaded chunks: fp32 master weights and
    two Adam moments of host-homed chunks (and the moments' fp32 scratch when compressed), the
    swap buffers of disk-homed ones (one chunk per staging slot), the host optimizer's staging
    buffers, and per offloaded chunk its streamed weights and delayed-update buffer if used."""
    ram = [opt_elems(s, world, stage) for s, h in zip(layout, homes) if h == "cpu"]
    disk = [opt_elems(s, world, stage) for s, h in zip(layout, homes) if h == "nvme"]
    if not ram and not disk:
        return 0
    biggest = max(ram + disk)
    swap = HOST_SLOTS * 12 * max(disk) if disk else 0
    held = sum(4 * n + 2 * store_nbytes(moments, n) for n in ram)
    if ram and moments != "fp32":
        held += 8 * max(ram)
    held += (weights_on_host + delayed) * dtype.itemsize * sum(ram + disk)
    return held + swap + biggest * (HOST_SLOTS * dtype.itemsize + 4)


def check_host_room(
    layout,
    homes,
    dtype,
    world: int,
    stage: int,
    device: torch.device,
    moments: str = "fp32",
    weights_on_host: bool = False,
    delayed: bool = False,
) -> None:
    """Refuse, before allocating anything, a placement whose host state does not fit in the RAM
    the machine can give now (every local rank takes the same share): being OOM-killed an hour
    into a run is the failure users of other offload engines report most."""
    need = host_state_bytes(layout, homes, dtype, world, stage, moments, weights_on_host, delayed)
    if not need or device.type != "cuda":
        return  # on CPU-only runs every tier is host memory; the planner accounts for it
    local = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    avail = host_usable() // max(1, local)
    if avail and need > avail:
        raise UserError(
            f"the offloaded optimizer state needs {need / 2**30:.1f} GiB of host RAM per rank but "
            f"{avail / 2**30:.1f} GiB can be used (short by {(need - avail) / 2**30:.1f} GiB): "
            "offload a smaller --offload-fraction, train fewer layers, or free host memory"
        )


def memory_report(
    chunks: list[Chunk],
    host_opt: HostOptimizer | None,
    moment_scratch: tuple[Tensor, Tensor] | None,
    disk: DiskTier | None,
) -> dict[str, dict[str, int]]:
    """Bytes held now: every chunk's buffers (Chunk.bytes_by_kind), plus the host tier's shared
    buffers: the host optimizer's staging, the delayed-update buffers, the compressed moments'
    fp32 scratch, and the disk tier's swap room (one chunk's state per staging slot)."""
    out: dict[str, dict[str, int]] = {}
    for c in chunks:
        for dev, kinds in c.bytes_by_kind().items():
            for k, v in kinds.items():
                out.setdefault(dev, {}).setdefault(k, 0)
                out[dev][k] += v
    if host_opt is not None:
        out.setdefault("host", {})["host_staging"] = host_opt.nbytes()
    delayed = [c.next_weights for c in chunks if c.next_weights is not None]
    if delayed:
        out["host"]["delayed_weights"] = sum(t.nbytes for t in delayed)
    if moment_scratch is not None:
        out["host"]["moment_scratch"] = sum(t.numel() * 4 for t in moment_scratch)
    if disk is not None:
        # the most disk-homed chunks swapped in at once: one per staging slot
        big = max(c.master.numel() for c in chunks if c.on_disk)
        out["host"]["nvme_swap"] = HOST_SLOTS * 12 * big
    return out
