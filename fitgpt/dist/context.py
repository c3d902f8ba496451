"""The distributed context: an explicit object passed to whatever communicates (no globals).

Under torchrun (RANK/WORLD_SIZE/LOCAL_RANK/MASTER_ADDR set) `init_distributed` joins the job's
process group: NCCL on GPUs, gloo on CPUs. Without torchrun it returns a one-process context.
"""

from __future__ import annotations

import datetime
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

from fitgpt.errors import UserError

# A collective that waits longer than this ends the job with the rank and operation named,
# instead of hanging forever. Long enough for checkpoint writes and first-step compilation.
DEFAULT_TIMEOUT_S = 600.0


@dataclass
class DistContext:
    rank: int
    world: int
    local_rank: int
    device: torch.device
    group: dist.ProcessGroup | None = None  # None: a single process, nothing to communicate

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.group is not None and self.world > 1

    def barrier(self) -> None:
        if self.distributed:
            dist.barrier(group=self.group)


def pick_device(device: str = "auto", local_rank: int = 0) -> torch.device:
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device.startswith("cuda"):
        if not torch.cuda.is_available():
            raise UserError(f"--device {device}: no CUDA GPU is visible; use --device cpu")
        dev = torch.device("cuda", local_rank if device == "cuda" else torch.device(device).index)
        torch.cuda.set_device(dev)
        return dev
    if device != "cpu":
        raise UserError(f"--device {device!r}: use auto, cpu or cuda")
    return torch.device("cpu")


def under_torchrun() -> bool:
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def init_distributed(device: str = "auto", timeout_s: float = DEFAULT_TIMEOUT_S) -> DistContext:
    """Join the torchrun job if there is one, else a single-process context."""
    if not under_torchrun():
        return DistContext(0, 1, 0, pick_device(device, 0), None)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    dev = pick_device(device, local_rank)
    if not dist.is_initialized():
        backend = "nccl" if dev.type == "cuda" else "gloo"
        dist.init_process_group(
            backend,
            timeout=datetime.timedelta(seconds=timeout_s),
            device_id=dev if dev.type == "cuda" else None,
        )
    return DistContext(rank, world, local_rank, dev, dist.group.WORLD)


def shutdown(ctx: DistContext) -> None:
    if ctx.group is not None and dist.is_initialized():
        dist.destroy_process_group()
