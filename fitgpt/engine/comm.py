"""Thin wrappers over torch.distributed collectives used by the chunked engine, and `all_ok`,
the ranks' agreement on a yes/no that the run folder, the checkpoints and the divergence guard
use.

They accept a missing group (one process: the collective is a copy or nothing) and hide the
renames between torch releases (`all_gather_into_tensor` is deprecated in 2.13 in favour of
`all_gather_single`, which 2.11 lacks). With async_op the returned handle's wait() makes the
current CUDA stream wait for NCCL's stream: no host sync, and NCCL keeps the buffers alive.

A plain barrier cannot tell the other ranks that this one failed, so each would go on to the next
collective and wait there until --dist-timeout. `all_ok` carries the outcome: every rank learns
whether all succeeded, and a rank that died is reported with this rank and the operation named
(CollectiveError).
"""

from __future__ import annotations

import warnings

import torch
import torch.distributed as dist
from torch import Tensor

from fitgpt.dist import DistContext

warnings.filterwarnings("ignore", message=r".*all_gather_into_tensor.* is deprecated")
warnings.filterwarnings("ignore", message=r".*reduce_scatter_tensor.* is deprecated")


class CollectiveError(RuntimeError):
    """A collective failed or timed out: another rank died or hangs. The message names this rank
    and the operation; torchrun then ends the other ranks and names the one that failed."""


def wait(work, label: str, rank: int) -> None:
    """work.wait(), turning a backend failure or timeout into a CollectiveError naming `label`."""
    try:
        work.wait()
    except Exception as e:  # gloo raises RuntimeError, NCCL DistBackendError
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise CollectiveError(
            f"rank {rank}: collective '{label}' did not complete ({first[:200]}); another rank "
            "died or hangs, so this job ends here (the wait is bounded by --dist-timeout)"
        ) from e


class Done:
    """Handle of a collective that needed no communication."""

    def wait(self) -> bool:
        return True


def all_gather(out_full: Tensor, shard: Tensor, group, world: int, async_op: bool = False):
    """out_full[r·s:(r+1)·s] = shard of rank r, for every r."""
    if group is None or world == 1:
        if out_full.data_ptr() != shard.data_ptr():
            out_full.copy_(shard)
        return Done()
    return dist.all_gather_into_tensor(out_full, shard, group=group, async_op=async_op) or Done()


def reduce_scatter(out_shard: Tensor, full: Tensor, group, world: int, async_op: bool = False):
    """out_shard of rank r = sum over ranks of full[r·s:(r+1)·s]."""
    if group is None or world == 1:
        out_shard.copy_(full)
        return Done()
    return dist.reduce_scatter_tensor(out_shard, full, group=group, async_op=async_op) or Done()


def all_reduce(t: Tensor, group, world: int, async_op: bool = False):
    if group is None or world == 1:
        return Done()
    return dist.all_reduce(t, group=group, async_op=async_op) or Done()


class Peers:
    """One rank's data-parallel group, as the engine's parts use it: `world` ranks, this one
    `rank`, the collectives above bound to the group (None on one process: copies or nothing),
    and wait() that names the operation when another rank fails."""

    def __init__(self, group, world: int, rank: int) -> None:
        self.group, self.world, self.rank = group, world, rank

    def all_gather(self, out_full: Tensor, shard: Tensor, async_op: bool = True):
        return all_gather(out_full, shard, self.group, self.world, async_op)

    def reduce_scatter(self, out_shard: Tensor, full: Tensor, async_op: bool = True):
        return reduce_scatter(out_shard, full, self.group, self.world, async_op)

    def all_reduce(self, t: Tensor, async_op: bool = True):
        return all_reduce(t, self.group, self.world, async_op)

    def wait(self, work, label: str) -> None:
        wait(work, label, self.rank)

    def wait_all(self, works: list[tuple[object, str]]) -> None:
        for work, label in works:
            wait(work, label, self.rank)


def all_ok(ctx: DistContext, ok: bool, label: str) -> bool:
    """True when every rank passed ok=True. Costs one 4-byte all-reduce and a host sync."""
    if not ctx.distributed:
        return ok
    flag = torch.tensor([1 if ok else 0], dtype=torch.int32, device=ctx.device)
    try:
        work = dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=ctx.group, async_op=True)
    except Exception as e:  # gloo can fail at the call already when a peer is gone
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise CollectiveError(
            f"rank {ctx.rank}: collective '{label}' did not complete ({first[:200]}); another "
            "rank died or hangs, so this job ends here"
        ) from e
    wait(work, label, ctx.rank)
    return bool(flag.item())  # host sync
