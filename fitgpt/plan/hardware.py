"""What the machine offers: GPUs and their memory, usable host RAM, free disk for the NVMe tier.

Detected when not told; every figure can be overridden, because some machines report less RAM
than they will give (memory that grows as it is used) and a user may want to plan for another
machine.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass

import torch

# The host's memory and byte sizes are the engine's knowledge too (it refuses a placement whose
# host state does not fit before allocating): they live in engine/host/hostmem.py, re-exported here.
from fitgpt.engine.host.hostmem import (
    HOST_RESERVE_FRACTION,
    HOST_RESERVE_MIN,
    UNITS,
    host_available,
    host_usable,
    parse_bytes,
)
from fitgpt.errors import UserError

__all__ = [
    "HOST_RESERVE_FRACTION",
    "HOST_RESERVE_MIN",
    "UNITS",
    "Hardware",
    "detect",
    "host_available",
    "host_usable",
    "parse_bytes",
]


@dataclass(frozen=True)
class Hardware:
    """One machine (a node) and how many alike the job spans: every per-machine figure (GPUs,
    host RAM, disk) is one node's, the collectives' links are priced in plan/links.py."""

    device: str  # "cuda" or "cpu": where compute runs
    gpus: int  # ranks on each node (GPUs, or processes on a CPU box)
    gpu_mem: int  # bytes per GPU (0 on CPU)
    gpu_name: str
    cpu_mem: int  # usable host bytes of one node
    cpu_cores: int
    nvme_path: str = ""
    nvme_free: int = 0  # one node's
    nnodes: int = 1  # machines alike, `gpus` ranks each

    @property
    def world(self) -> int:
        """Ranks of the whole job."""
        return self.gpus * self.nnodes

    def describe(self) -> str:
        gpu = (
            f"{self.gpus}× {self.gpu_name} ({self.gpu_mem / 2**30:.0f} GiB)"
            if self.device == "cuda"
            else f"{self.gpus} CPU process(es)"
        )
        if self.nnodes > 1:
            gpu = f"{self.nnodes} nodes of {gpu}"
        nvme = (
            f", NVMe tier {self.nvme_free / 2**30:.0f} GiB free at {self.nvme_path}"
            if self.nvme_path
            else ""
        )
        return (
            f"{gpu}, host RAM {self.cpu_mem / 2**30:.0f} GiB usable, {self.cpu_cores} cores{nvme}"
        )


def for_run(ecfg, world: int, device: str) -> Hardware:
    """The machines a run of `world` ranks trains on, as its EngineConfig states them (RAM, the
    GPU's share, the disk folder) and torchrun lays them out (dist/nodes.py node_shape: the
    ranks on each node, the nodes): what the planner plans a run for, the one place."""
    from fitgpt.dist.nodes import node_shape

    per_node, nnodes = node_shape(world)  # RAM and disk are each node's
    return detect(
        gpus=per_node,
        device=device,
        cpu_mem=ecfg.cpu_mem,
        gpu_mem=ecfg.gpu_mem or None,
        nvme=ecfg.nvme_path or None,
        nnodes=nnodes,
    )


def detect(
    gpus: int | None = None,
    gpu_mem: str | int | None = None,
    cpu_mem: str | int | None = None,
    nvme: str | None = None,
    device: str = "auto",
    nnodes: int | None = None,
) -> Hardware:
    """This machine as detected, each figure given overriding it; `nnodes` machines alike."""
    cuda = torch.cuda.is_available() and device != "cpu"
    if device == "cuda" and not torch.cuda.is_available() and gpu_mem is None:
        raise UserError("--device cuda: no GPU is visible; pass --gpu-mem to plan for one anyway")
    # --gpu-mem means "plan for a GPU of this size", also from a machine without one
    use_cuda = cuda or device == "cuda" or (gpu_mem is not None and device != "cpu")
    if use_cuda and torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        name, mem, count = props.name, props.total_memory, torch.cuda.device_count()
    else:
        name, mem, count = ("(planned GPU)" if use_cuda else "cpu"), 0, 1
    if gpu_mem is not None:  # `fitgpt plan --gpu-mem` as typed, or a run's bytes
        mem = parse_bytes(gpu_mem, "--gpu-mem") if isinstance(gpu_mem, str) else gpu_mem
    if gpus is not None:
        if gpus < 1:
            raise UserError(f"--gpus {gpus} must be at least 1")
        count = gpus
    if nnodes is not None and nnodes < 1:
        raise UserError(f"--nnodes {nnodes} must be at least 1")
    if isinstance(cpu_mem, str):  # `fitgpt plan --cpu-mem` as typed
        host = parse_bytes(cpu_mem, "--cpu-mem")
    else:  # a run's EngineConfig.cpu_mem, in bytes (None or 0: measured)
        host = host_usable(cpu_mem or 0)
    nvme_path, nvme_free = "", 0
    if nvme:
        if re.fullmatch(r"\s*[0-9.]+\s*[a-zA-Z]*\s*", nvme) and not os.path.exists(nvme):
            nvme_path, nvme_free = "(planned)", parse_bytes(nvme, "--nvme")
        else:
            if not os.path.isdir(nvme):
                raise UserError(
                    f"--nvme {nvme}: not a folder; pass an existing folder or a size like 64GB"
                )
            from fitgpt.engine.host.nvme import disk_room

            nvme_path, nvme_free = nvme, max(0, disk_room(nvme))  # what the tier may use
    return Hardware(
        "cuda" if use_cuda else "cpu",
        count,
        mem,
        name,
        host,
        os.cpu_count() or 1,
        nvme_path,
        nvme_free,
        nnodes or 1,
    )
