"""Byte accounting of the chunked engine: what one rank holds, by tier and kind of state.

Two figures, for two moments:
  check_host_room  before anything is allocated: the host RAM this rank will hold for the
      offloaded chunks, which the Placement (engine/chunked/placement.py) computes; a placement that
      does not fit in the RAM the machine can give now is refused at start-up.
  memory_report    after construction: the bytes the engine's buffers actually hold now,
      {tier: {kind: bytes}}, measured from the tensors; the tests hold them equal to
      Placement.state_bytes(), the planner's figures.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

from fitgpt.engine.chunked.chunk import Chunk
from fitgpt.engine.chunked.disk_tier import DiskTier
from fitgpt.engine.chunked.offload import HostOptimizer
from fitgpt.engine.chunked.placement import HOST_SLOTS, Placement
from fitgpt.engine.formats.compact import Scratch
from fitgpt.engine.host.hostmem import host_usable
from fitgpt.errors import UserError


def check_host_room(placement: Placement, device: torch.device, group=None, world: int = 1) -> None:
    """Refuse, before allocating anything, a placement whose host state does not fit in the RAM
    the machine can give now, or the RAM the user stated (`--cpu-mem`, carried by the placement)
    (every local rank takes the same share): being OOM-killed an hour
    into a run is the failure users of other offload engines report most."""
    if device.type != "cuda":
        return  # on CPU-only runs every tier is host memory; the planner accounts for it
    local = int(os.environ.get("LOCAL_WORLD_SIZE", placement.world))
    avail = host_usable(placement.cpu_mem) // max(1, local)  # a stated --cpu-mem, else measured
    refuse_unless_room(placement.host_bytes(), avail, device, group, world)


def refuse_unless_room(need: int, avail: int, device: torch.device, group, world: int) -> None:
    """The verdict of check_host_room, agreed by every rank of the job. Each rank reads the RAM
    the machine can give before the all-reduce, and none allocates before it, so no rank reads
    another's allocations: a rank that read late used to see its peer's first chunks gone from
    MemAvailable, refuse alone and leave the peer waiting in its first collective (37 B on 2x
    H100, 2026-11-26: 8 minutes, no line printed). Costs one 16-byte all-reduce at start-up."""
    if world > 1 and group is not None:
        t = torch.tensor([avail if avail else 1 << 62, -need], dtype=torch.int64, device=device)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=group)  # the least room, the most need
        avail, need = int(t[0]), -int(t[1])
        avail = 0 if avail == 1 << 62 else avail  # no rank knew
    if need and avail and need > avail:
        e = UserError(
            f"the offloaded optimizer state needs {need / 2**30:.1f} GiB of host RAM per rank but "
            f"{avail / 2**30:.1f} GiB can be used (short by {(need - avail) / 2**30:.1f} GiB): "
            "offload fewer --offload-blocks, train fewer layers, or free host memory"
        )
        # every rank raises it here, with the same all-reduced figures
        e.agreed = e.identical = world > 1 and group is not None
        raise e


def memory_report(
    chunks: list[Chunk],
    host_opt: HostOptimizer | None,
    scratch: dict[str, Scratch],
    disk: DiskTier | None,
) -> dict[str, dict[str, int]]:
    """Bytes held now: every chunk's buffers (Chunk.bytes_by_kind), plus the host tier's shared
    buffers: the host optimizer's staging, the compact formats' fp32 scratch per tier, and the
    disk tier's swap room (one chunk's state per staging slot)."""
    out: dict[str, dict[str, int]] = {}
    for c in chunks:
        for dev, kinds in c.bytes_by_kind().items():
            for k, v in kinds.items():
                out.setdefault(dev, {}).setdefault(k, 0)
                out[dev][k] += v
    if host_opt is not None:
        h = out.setdefault("host", {})
        h["host_staging"] = sum(t.nbytes for t in (*host_opt.staging, host_opt.g32))
        if host_opt.wstaging:
            h["weight_staging"] = sum(t.nbytes for t in host_opt.wstaging)
    for tier, s in scratch.items():
        dev = "host" if tier == "host" else chunks[0].device.type
        out.setdefault(dev, {})["compact_scratch"] = s.nbytes()
    if disk is not None:
        # the most disk-homed chunks swapped in at once: one per staging slot
        big = max(sum(t.nbytes for t in c.state_tensors().values()) for c in chunks if c.on_disk)
        out["host"]["nvme_swap"] = HOST_SLOTS * big
    return out
