"""Agreement between ranks on a yes/no: one small all-reduce that is also a barrier.

A plain barrier cannot tell the other ranks that this one failed, so each would go on to the next
collective and wait there until --dist-timeout. `all_ok` carries the outcome: every rank learns
whether all succeeded, and a rank that died is reported with this rank and the operation named,
like the engine's collectives (comm.CollectiveError).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from fitgpt.dist import DistContext
from fitgpt.engine.comm import CollectiveError, wait


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
