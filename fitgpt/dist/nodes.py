"""Several machines: `fitgpt train --gpus G --nnodes N --node-rank R --master-addr A
--master-port P` on each of N machines starts torchrun's static rendezvous there (the way
torchrun documents it), G processes per machine, N·G ranks in all, ranks R·G..R·G+G-1 on
machine R.

The flags are read and judged here, once (`Nodes.of`); `launch.command` turns them into
torchrun's. Each machine settles its own run from the same command line, so the ranks check
that they all settled the same one before anything is allocated (`check_same`).

Same-host default: --master-addr defaults to 127.0.0.1 on every node, node ranks > 0
included. That is what several "nodes" on one machine need (the tests, a try-out); on real
machines every node must name node 0's address, and a node that names its own loopback never
joins: node 0 then ends within --dist-timeout naming it (fitgpt/dist/torchrun.py).
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass

from fitgpt.errors import UserError

DEFAULT_ADDR = "127.0.0.1"


@dataclass(frozen=True)
class Nodes:
    nnodes: int = 1
    node_rank: int = 0
    master_addr: str = DEFAULT_ADDR
    # None: one node, and torchrun's --standalone picks a free port; several nodes must agree
    # on one, so there it is required
    master_port: int | None = None

    @property
    def several(self) -> bool:
        return self.nnodes > 1

    @classmethod
    def of(cls, args, gpus: int | None) -> Nodes:
        """The node flags of a command line, judged: each mistake refused in one line."""
        nnodes = getattr(args, "nnodes", None)
        node_rank = getattr(args, "node_rank", None)
        addr = getattr(args, "master_addr", None)
        port = getattr(args, "master_port", None)
        given = [
            f for f, v in (("--nnodes", nnodes), ("--node-rank", node_rank),
                           ("--master-addr", addr), ("--master-port", port)) if v is not None
        ]  # fmt: skip
        if given and gpus is None:
            raise UserError(
                f"{given[0]} needs --gpus G (the processes this node starts under torchrun); "
                "under your own torchrun or SLURM, give the node flags to torchrun instead"
            )
        nnodes = 1 if nnodes is None else nnodes
        if nnodes < 1:
            raise UserError(f"--nnodes {nnodes} must be at least 1")
        node_rank = 0 if node_rank is None else node_rank
        if not 0 <= node_rank < nnodes:
            raise UserError(
                f"--node-rank {node_rank} must be in 0..{nnodes - 1} (--nnodes {nnodes}); "
                "give each machine its own rank, node 0 the one at --master-addr"
            )
        if port is not None and not 1 <= port <= 65535:
            raise UserError(f"--master-port {port} must be a TCP port, 1-65535")
        if nnodes > 1 and port is None:
            raise UserError(
                f"--nnodes {nnodes} needs --master-port P: the same free port of node 0 on every "
                "node (one node alone picks its own)"
            )
        if addr is not None and not addr.strip():
            raise UserError("--master-addr is empty: give node 0's host name or IP address")
        return cls(nnodes, node_rank, addr or DEFAULT_ADDR, port)

    def torchrun_args(self, nproc: int) -> list[str]:
        """torchrun's options for these nodes, `nproc` processes on this one."""
        if self.master_port is None:  # one node: torchrun picks a free port itself
            return ["--standalone", f"--nproc-per-node={nproc}"]
        return [
            f"--nnodes={self.nnodes}",
            f"--node-rank={self.node_rank}",
            f"--master-addr={self.master_addr}",
            f"--master-port={self.master_port}",
            f"--nproc-per-node={nproc}",
        ]


def node_of_rank() -> int:
    """This process's machine: torchrun's GROUP_RANK (its --node-rank); 0 without torchrun."""
    return int(os.environ.get("GROUP_RANK", "0"))


def digest(settings: dict) -> int:
    """A 63-bit hash of settled settings (their JSON, keys sorted), to compare across ranks."""
    text = json.dumps(settings, sort_keys=True, default=str).encode()
    return int.from_bytes(hashlib.sha256(text).digest()[:8], "big") >> 1


def check_same(ctx, settings: dict) -> None:
    """Every rank's settled settings are rank 0's, else a one-line refusal naming the nodes
    whose differ (collective: every rank calls it). Each machine settles its own from its own
    command line and its own host (the planner measures RAM and disk there), so two machines
    given different flags, files or hosts would otherwise train two different runs in one job,
    or hang in a collective one of them never makes. Costs one small all_gather at start."""
    if not ctx.distributed:
        return
    import torch
    import torch.distributed as dist

    mine = torch.tensor([digest(settings), node_of_rank()], dtype=torch.int64, device=ctx.device)
    every = [torch.empty_like(mine) for _ in range(ctx.world)]
    dist.all_gather(every, mine, group=ctx.group)
    ref = int(every[0][0])
    differ = sorted({int(t[1]) for t in every if int(t[0]) != ref})
    if differ:
        e = UserError(
            f"node(s) {', '.join(map(str, differ))} settled a different run than node 0: give "
            "every node the same command line, files and fitgpt version (with --plan auto, "
            "hosts that differ in RAM or disk plan differently: set the engine flags or --plan off)"
        )
        e.agreed = e.identical = True  # every rank sees the same gathered hashes
        raise e
