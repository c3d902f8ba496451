"""The chunk engine's chunks made from its Placement (engine/chunked/placement.py), one at a time,
and what they share: the compact formats' fp32 scratch per tier and the disk tier. ChunkEngine calls
these once, at construction, in this order: shared_state, build_chunks, warm_up_codecs."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor, nn

from fitgpt.engine.chunked.chunk import Chunk
from fitgpt.engine.chunked.disk_tier import DiskTier
from fitgpt.engine.chunked.placement import ChunkPlan, Placement
from fitgpt.engine.comm import Peers
from fitgpt.engine.config import OptimConfig
from fitgpt.engine.formats.compact import Scratch
from fitgpt.engine.host.pinned import PinnedArena


def shared_state(
    placement: Placement, device: torch.device, nvme_path: str
) -> tuple[dict[str, Scratch], DiskTier | None]:
    """What chunks share: the fp32 scratch the compact formats are stepped through, one per tier
    that has them ("device": the main thread's, "host": the host optimizer worker's;
    engine/formats/compact.py), and the disk tier, whose free space is checked here, before anything
    else is allocated."""
    scratch = {}
    for tier in ("device", "host"):
        if elems := placement.scratch_elems(tier):
            dev = device if tier == "device" else torch.device("cpu")
            scratch[tier] = Scratch(elems, dev)
    on_disk = {c.spec.index: c.state_layout() for c in placement.chunks if c.on_disk}
    disk = DiskTier(nvme_path, on_disk) if on_disk else None
    return scratch, disk


def scratch_of(scratch: dict[str, Scratch], c: Chunk) -> Scratch | None:
    return scratch.get("host" if c.offloaded else "device")


def build_chunks(
    placement: Placement,
    model: nn.Module,
    init: Callable[[str, Tensor], None],
    ocfg: OptimConfig,
    *,
    peers_of: Callable[[ChunkPlan], Peers],
    dtype: torch.dtype,
    device: torch.device,
    pinned: PinnedArena,
    scratch: dict[str, Scratch],
    disk: DiskTier | None,
) -> list[Chunk]:
    """One chunk at a time: allocate, bind into the model, initialise, build its optimizer (its
    views are cut while the state is resident), and write a disk-homed chunk's state out, so
    init transients and host RAM stay at one chunk's worth. `peers_of(plan)`: the ranks a
    chunk is reduced and sharded over (the data-parallel group; an experts' chunk under expert
    parallelism, its replica group), kept as `c.peers` for every part that communicates."""
    chunks = []
    for plan in placement.chunks:
        peers = peers_of(plan)
        c = Chunk(plan, rank=peers.rank, dtype=dtype, device=device, pinned=pinned)
        c.peers = peers
        c.bind(model)
        c.build_optimizer(ocfg)
        c.init_weights(init, scratch_of(scratch, c))
        if c.on_disk:
            disk.write_out(c)  # host RAM holds one disk-homed chunk's state at a time
        chunks.append(c)
    return chunks


def warm_up_codecs(chunks: list[Chunk], scratch: dict[str, Scratch]) -> None:
    """Compile the host tier's fused codecs (engine/formats/codec.py) here, on the main thread, once
    per format, rather than inside the host optimizer's first step."""
    seen = set()
    for c in chunks:
        if c.offloaded and c.compact is not None and (c.plan.master, c.plan.moments) not in seen:
            seen.add((c.plan.master, c.plan.moments))
            c.compact.warm_up(scratch["host"])
