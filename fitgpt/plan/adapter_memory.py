"""The memory model of an adapter run (LoRA, fitgpt/adapters): bytes per rank on the GPU, in
host RAM and on the disk for a frozen base held in a format, its blocks placed on those tiers
and perhaps sharded over the ranks (engine/chunked/frozen.py), plus the adapters and their
optimizer state and the activations. plan/adapter.py searches placements with it; the packed
sizes are the engine's own codec's (engine/formats/frozen_base.py), so they are exact.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass, field

import torch

from fitgpt.adapters import AdapterConfig
from fitgpt.adapters.targets import adapter_elements
from fitgpt.engine.chunked.frozen import DiskBlocks
from fitgpt.engine.config import EngineConfig
from fitgpt.engine.formats.frozen_base import ALIGN, BlockCodec, is_direct, packed_base
from fitgpt.model import ModelConfig
from fitgpt.plan.hardware import Hardware
from fitgpt.plan.memory import (
    CUDA_CONTEXT,
    HOST_BASE,
    NCCL_BUFFERS,
    Estimate,
    GiB,
    Workload,
    activation_peak,
    gpu_budget,
    host_checkpointed_inputs,
    layout_of,
)


@dataclass(frozen=True)
class BasePlan:
    """An adapter run's memory: the base in `fmt`, its last `host_blocks` blocks off the GPU,
    the last `disk_blocks` of those in files rather than pinned host RAM."""

    fmt: str
    host_blocks: int
    blocks: int
    est: Estimate
    disk_blocks: int = 0
    shards: int = 1  # the ranks each block's bytes are cut over (1: whole on every rank)
    ranks: int = 1  # the ranks on this machine, sharing its host RAM and disk
    checkpointing: str = "off"
    keep: int = 0  # under checkpointing full, the last blocks that keep their activations
    compile: str = "off"  # --compile's scope (engine/transforms/compile.py SCOPES), priced
    # predicted seconds per step, term by term (plan/adapter_time.py; empty: not priced)
    time: dict[str, float] = field(default_factory=dict, compare=False)

    def gpu_fits(self, hw: Hardware) -> bool:
        return hw.device != "cuda" or self.est.compute_total <= gpu_budget(hw.gpu_mem)

    @property
    def host_bytes(self) -> int:
        """Host RAM of every rank on the machine (each pins its own blocks)."""
        return self.est.host_total * self.ranks

    def host_fits(self, hw: Hardware) -> bool:
        disk = sum(self.est.nvme.values()) * self.ranks
        disk_ok = not disk or (bool(hw.nvme_path) and disk <= hw.nvme_free)
        return disk_ok and (not hw.cpu_mem or self.host_bytes <= hw.cpu_mem)

    def fits(self, hw: Hardware) -> bool:
        return self.gpu_fits(hw) and self.host_fits(hw)

    def line(self) -> str:
        gpu = f"{self.est.compute_total / GiB:.1f} GiB a GPU, " if self.est.compute else ""
        device = "GPU" if self.est.compute else "device"
        disk = f" ({self.disk_blocks} of them from the disk)" if self.disk_blocks else ""
        if self.shards > 1:
            disk += f", each block sharded over {self.shards} ranks"
        where = (
            f"{self.blocks - self.host_blocks} of its {self.blocks} blocks on the {device}, "
            f"{self.host_blocks} streamed from host RAM{disk}"
        )
        nvme = sum(self.est.nvme.values()) * self.ranks
        nvme = f", {nvme / GiB:.1f} GiB disk" if nvme else ""
        ranks = f" ({self.ranks} ranks)" if self.ranks > 1 else ""
        host = f"{self.host_bytes / GiB:.1f} GiB host{ranks}"
        ckpt = f", checkpointing {self.checkpointing}" if self.checkpointing != "off" else ""
        if self.keep:
            which = "block's" if self.keep == 1 else f"{self.keep} blocks'"
            ckpt += f", the last {which} activations kept"
        if self.compile != "off":
            ckpt += ", compiled"
        step = f", predicted {self.time['total']:.3g} s/step" if self.time else ""
        return f"the base in {self.fmt}, {where}{ckpt}: {gpu}{host}{nvme}{step}"


def price_base(
    work: Workload,
    adapter: AdapterConfig,
    fmt: str,
    host_blocks: int,
    checkpointing: str,
    disk_blocks: int = 0,
    shards: int = 1,
    keep: int = 0,
) -> BasePlan:
    """Bytes per rank of an adapter run whose base is held in `fmt` with its last `host_blocks`
    blocks in pinned host RAM, the last `disk_blocks` of those on the disk, each block's bytes
    cut over `shards` ranks (engine/chunked/frozen.py), under checkpointing full the last `keep`
    blocks' activations kept whole (--keep-activations): the packed blocks on their tiers, the
    embedding and head, the working copies of two blocks while they run, the adapters with
    their gradients and Adam moments (16 bytes an element), the activations as a run without
    adapters holds them (the plain engine's memory model: memory.py activation_peak)."""
    w = work.w
    packed = packed_base(
        dataclasses.replace(adapter, base_format=fmt, base_host_blocks=host_blocks), work.precision
    )
    whole, numels, outer = _block_bytes(work.model, fmt, w)
    unit = shards * ALIGN  # a block's bytes padded so each rank holds an aligned equal part
    sizes = [-(-n // unit) * ALIGN for n in whole]  # this rank's part (all of it at 1)
    first_host = len(sizes) - host_blocks
    dev = {
        "frozen_blocks": sum(sizes[:first_host]),
        "frozen_embedding_head": outer * (4 if fmt == "fp32" else w),
        "adapters": 16 * adapter_elements(work.model, adapter),
    }
    big = max(numels, default=0)
    if packed or shards > 1:  # the running block and the prefetched one, unpacked; their
        # bytes while they land (streamed) or are gathered (sharded)
        dev["unpacked_blocks"] = 2 * big * w if not is_direct(fmt, _working(w)) else 0
        if host_blocks or shards > 1:
            dev["landed_blocks"] = 2 * max(whole)
    elif w == 2:  # an fp32 base under autocast: bf16 copies of the weights, saved for backward
        dev["autocast_weights"] = 2 * sum(numels)
    dev.update(_activations(work, checkpointing, keep))
    to_host = checkpointing == "cpu" and work.device != "cpu"
    if to_host:
        # the frozen embedding's output, block 0's input, needs no gradient: the host hooks
        # leave it on the GPU (activation.py HostActivations.pack); the other blocks' go
        dev["first_block_input"] = work.model.seq_len * work.micro_batch * work.model.n_embd * w
    est = Estimate()
    est.host["process"] = HOST_BASE["cpu" if work.device == "cpu" else "cuda"]
    first_disk = len(sizes) - disk_blocks
    est.host["frozen_blocks_pinned"] = sum(sizes[first_host:first_disk])
    if to_host:
        est.host["checkpointed_inputs"] = host_checkpointed_inputs(work, work.model.n_layer - 1)
    if disk_blocks:  # the files, and the staging ring they are read into (DiskBlocks)
        est.nvme["frozen_blocks"] = sum(sizes[first_disk:])
        est.host["frozen_disk_staging"] = DiskBlocks.RING * max(sizes[first_disk:])
    if work.device == "cpu":
        est.host.update(dev)
    else:
        est.compute = dict(dev)
        est.compute["outside:cuda_context"] = CUDA_CONTEXT
        if work.world > 1:
            est.compute["outside:nccl_buffers"] = NCCL_BUFFERS
    ranks = work.world if work.device == "cuda" else 1  # a CPU job's host RAM: its own check
    return BasePlan(
        fmt, host_blocks, len(sizes), est, disk_blocks, shards, ranks, checkpointing, keep
    )


@functools.lru_cache(maxsize=256)
def _activations(work: Workload, checkpointing: str, keep: int = 0) -> dict[str, int]:
    e = EngineConfig(engine="ddp", checkpointing=checkpointing, keep_activations=keep)
    return activation_peak(work, e)


@functools.lru_cache(maxsize=32)
def _block_bytes(
    model: ModelConfig, fmt: str, w: int
) -> tuple[tuple[int, ...], tuple[int, ...], int]:
    """(packed bytes of each block in `fmt`, each block's parameters, the parameters outside the
    blocks): the engine's own codec on the model's layout (a search prices them many times)."""
    layout = layout_of(model)
    blocks = [c for c in layout if c.name.startswith("block.")]
    working = _working(w)
    sizes, by_shape = [], {}
    for c in blocks:
        key = tuple(s.shape for s in c.slots)
        if key not in by_shape:
            by_shape[key] = BlockCodec(c, fmt, working).nbytes
        sizes.append(by_shape[key])
    outer = sum(c.numel for c in layout if c not in blocks)
    return tuple(sizes), tuple(c.numel for c in blocks), outer


def _working(w: int) -> torch.dtype:
    """The compute dtype of `w` bytes an element (the blocks are unpacked to it)."""
    return torch.float32 if w == 4 else torch.bfloat16
