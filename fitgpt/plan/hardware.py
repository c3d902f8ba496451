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

from fitgpt.errors import UserError

UNITS = {
    "": 2**30,
    "k": 1e3,
    "kb": 1e3,
    "m": 1e6,
    "mb": 1e6,
    "g": 1e9,
    "gb": 1e9,
    "t": 1e12,
    "tb": 1e12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}


def parse_bytes(text: str, what: str) -> int:
    """'80GB' (10^9), '125GiB' (2^30), '64' (GiB). Raises a UserError naming `what`, also for
    sizes under one byte: a zero budget is never meant (it used to read as "unlimited")."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", text)
    if not m or m.group(2).lower() not in UNITS:
        raise UserError(f"{what} {text!r}: write a positive size like 80GB, 125GiB or 64 (GiB)")
    n = int(float(m.group(1)) * UNITS[m.group(2).lower()])
    if n < 1:
        raise UserError(
            f"{what} {text!r}: a size must be more than 0; give what the machine has "
            "(e.g. 64GB), or leave the flag out to measure it"
        )
    return n


# Host RAM a plan may fill: MemAvailable less a reserve for what the kernel and the process do
# besides holding state (page cache of the data and the disk tier, allocator slack, threads'
# stacks). Measured on the H100 box: 114 GiB of 122.7 available trained; 124.6 of 125 was
# OOM-killed. Costs ~6 GiB of capacity (~0.5 B parameters there).
HOST_RESERVE_FRACTION = 0.05
HOST_RESERVE_MIN = 4 << 30


def host_usable() -> int:
    """The host bytes a plan may fill now (0 when unknown): FITGPT_CPU_MEM when the user stated
    it (`fitgpt train --cpu-mem`), else what the kernel says is available less a reserve."""
    stated = os.environ.get("FITGPT_CPU_MEM")
    if stated:
        return parse_bytes(stated, "--cpu-mem")
    avail = host_available()
    return max(0, avail - max(HOST_RESERVE_MIN, int(HOST_RESERVE_FRACTION * avail))) if avail else 0


def host_available() -> int:
    """MemAvailable from /proc/meminfo (bytes), or 0 when unknown."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


@dataclass(frozen=True)
class Hardware:
    device: str  # "cuda" or "cpu": where compute runs
    gpus: int  # data-parallel ranks (GPUs, or processes on a CPU box)
    gpu_mem: int  # bytes per GPU (0 on CPU)
    gpu_name: str
    cpu_mem: int  # usable host bytes for the whole machine
    cpu_cores: int
    nvme_path: str = ""
    nvme_free: int = 0

    def describe(self) -> str:
        gpu = (
            f"{self.gpus}× {self.gpu_name} ({self.gpu_mem / 2**30:.0f} GiB)"
            if self.device == "cuda"
            else f"{self.gpus} CPU process(es)"
        )
        nvme = (
            f", NVMe tier {self.nvme_free / 2**30:.0f} GiB free at {self.nvme_path}"
            if self.nvme_path
            else ""
        )
        return (
            f"{gpu}, host RAM {self.cpu_mem / 2**30:.0f} GiB usable, {self.cpu_cores} cores{nvme}"
        )


def detect(
    gpus: int | None = None,
    gpu_mem: str | None = None,
    cpu_mem: str | None = None,
    nvme: str | None = None,
    device: str = "auto",
) -> Hardware:
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
    if gpu_mem is not None:
        mem = parse_bytes(gpu_mem, "--gpu-mem")
    if gpus is not None:
        if gpus < 1:
            raise UserError(f"--gpus {gpus} must be at least 1")
        count = gpus
    host = parse_bytes(cpu_mem, "--cpu-mem") if cpu_mem is not None else host_usable()
    nvme_path, nvme_free = "", 0
    if nvme:
        if re.fullmatch(r"\s*[0-9.]+\s*[a-zA-Z]*\s*", nvme) and not os.path.exists(nvme):
            nvme_path, nvme_free = "(planned)", parse_bytes(nvme, "--nvme")
        else:
            if not os.path.isdir(nvme):
                raise UserError(
                    f"--nvme {nvme}: not a folder; pass an existing folder or a size like 64GB"
                )
            from fitgpt.engine.nvme import disk_room

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
    )
