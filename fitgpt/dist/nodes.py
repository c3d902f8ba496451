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
joins: node 0 then ends within --dist-timeout naming it (`RollCall`).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import os
import socket
import threading
import time
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
    # --dist-timeout: how long node 0 waits for the others to join (torchrun's own rendezvous
    # waits 600 s by default, whatever --dist-timeout says)
    timeout_s: float = 600.0

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
            f"--rdzv-conf=timeout={math.ceil(self.timeout_s)}",
            f"--nproc-per-node={nproc}",
        ]


def node_of_rank() -> int:
    """This process's machine: torchrun's GROUP_RANK (its --node-rank); 0 without torchrun."""
    return int(os.environ.get("GROUP_RANK", "0"))


def node_shape(world: int) -> tuple[int, int]:
    """(ranks on each node, nodes) of this job: torchrun's LOCAL_WORLD_SIZE (every node starts
    as many); without torchrun, one node of `world`."""
    per = int(os.environ.get("LOCAL_WORLD_SIZE", world)) or world
    return per, max(1, world // per)


def digest(settings: dict) -> int:
    """A 63-bit hash of settled settings (their JSON, keys sorted), to compare across ranks."""
    text = json.dumps(settings, sort_keys=True, default=str).encode()
    return int.from_bytes(hashlib.sha256(text).digest()[:8], "big") >> 1


def check_same(ctx, settings: dict) -> None:
    """Every rank's settled settings are rank 0's, else a one-line refusal naming the nodes
    whose differ (collective: every rank calls it). Each machine settles its own from its own
    command line and files, so two machines given different ones would otherwise train two
    different runs in one job, or hang in a collective one of them never makes. Costs one small
    all_gather at start."""
    if not ctx.distributed:
        return
    import torch
    import torch.distributed as dist

    mine = torch.tensor([digest(settings), node_of_rank()], dtype=torch.int64, device=ctx.device)
    every = [torch.empty_like(mine) for _ in range(ctx.world)]
    dist.all_gather(every, mine, group=ctx.group)
    ref = int(every[0][0])
    odd = [i for i, t in enumerate(every) if int(t[0]) != ref]
    if odd:
        # what differs, from the first odd rank's settings (one more gather, on refusal only)
        texts = [None] * ctx.world
        dist.all_gather_object(texts, json.dumps(settings, sort_keys=True, default=str))
        first = int(every[odd[0]][1])
        fields = differences(json.loads(texts[0]), json.loads(texts[odd[0]]), first)
        differ = sorted({int(every[i][1]) for i in odd})
        e = UserError(
            f"node(s) {', '.join(map(str, differ))} settled a different run than node 0 "
            f"({fields}): give every node the same command line, the same files and the same "
            "fitgpt version"
        )
        e.agreed = e.identical = True  # every rank sees the same gathered hashes
        raise e


def differences(mine: dict, theirs: dict, node: int, most: int = 3) -> str:
    """The settings where node 0's (`mine`) and `node`'s differ, e.g. "seed 1 on node 0, 2 on
    node 1", the first `most` of them by name (a field's path less its section)."""

    def leaves(d, path=()):
        for k, v in d.items():
            if isinstance(v, dict):
                yield from leaves(v, (*path, k))
            else:
                yield (*path, k), v

    a, b = dict(leaves(mine)), dict(leaves(theirs))
    keys = sorted(k for k in a.keys() | b.keys() if a.get(k) != b.get(k))

    def shown(v) -> str:
        return "unset" if v is None else str(v)

    said = [
        f"{k[-1]} {shown(a.get(k))} on node 0, {shown(b.get(k))} on node {node}"
        for k in keys[:most]
    ]
    more = f" and {len(keys) - most} more" if len(keys) > most else ""
    return "; ".join(said) + more


# how often each node's launcher says it is alive, and how long node 0's waits, after the job
# failed, to tell a silent node from a live one: 2.5 beats, so a busy host is not taken for dead
BEAT_S = 1.0
SILENT_S = 2.5


class RollCall:
    """The nodes of a job, counted in and watched from their torchrun launchers, through node
    0's rendezvous store (the static rendezvous' own TCPStore, shared with it in this process).

    torchrun alone cannot name a node: a node that never joins leaves node 0 waiting in its
    rendezvous (600 s by default) with no word of which one is missing, and a node that dies
    mid-run shows on the others as a collective that failed, with no rank or node named
    (gloo: "connection closed by peer"). So each launcher signs in under its node rank before
    torchrun starts (node 0 waits --dist-timeout for the others and names the missing), then
    counts a heartbeat every BEAT_S; when the job fails, the nodes whose count stopped are
    named. Costs one store write per node per second, and SILENT_S at the end of a failed job."""

    def __init__(self, addr: str, port: int, nnodes: int, node_rank: int, timeout_s: float):
        self.addr, self.port, self.nnodes, self.node = addr, port, nnodes, node_rank
        self.timeout_s = timeout_s
        self.store = None
        self.beating = threading.Event()

    @classmethod
    def of(cls, args) -> RollCall | None:
        """The roll call of torchrun's parsed arguments, or None for one node."""
        if args.rdzv_backend != "static" or str(args.nnodes) in ("1", "1:1"):
            return None
        conf = dict(kv.split("=", 1) for kv in (args.rdzv_conf or "").split(",") if "=" in kv)
        timeout = float(conf.get("timeout", 600))
        return cls(args.master_addr, args.master_port, int(args.nnodes), args.node_rank, timeout)

    def where(self) -> str:
        return f"{self.addr}:{self.port}"

    def sign_in(self) -> str | None:
        """Join the roll call; on node 0, wait for every node. None, or the one line to end on."""
        from torch.distributed import TCPStore

        timeout = _timedelta(self.timeout_s)
        if self.node != 0 and (why := self._unreachable()) is not None:
            return (
                f"fitgpt: node {self.node} could not reach node 0 at {self.where()} within "
                f"--dist-timeout {self.timeout_s:g} s ({why}); start node 0 with the same "
                "--master-addr and --master-port, and check that this machine can reach it"
            )
        try:  # multi_tenant: torchrun's static rendezvous reuses this server in this process
            self.store = TCPStore(self.addr, self.port, None, self.node == 0, timeout,
                                  wait_for_workers=False, multi_tenant=True)  # fmt: skip
            # counted, not set: a second launcher given a node rank that joined already
            # (two machines with one --node-rank) must not go on into torchrun's rendezvous,
            # where it waited out gloo's connect timeout and ended in a traceback
            joined = self.store.add(f"fitgpt/joined/{self.node}", 1)
            self.store.set(f"fitgpt/node/{self.node}", "1")
        except Exception as e:  # a timeout, a refused connection, a port in use
            first = (str(e).strip().splitlines() or [type(e).__name__])[0][:200]
            if self.node == 0:
                return f"fitgpt: node 0 could not host the rendezvous at {self.where()} ({first})"
            return (
                f"fitgpt: node {self.node} could not reach node 0 at {self.where()} within "
                f"--dist-timeout {self.timeout_s:g} s ({first}); start node 0 with the same "
                "--master-addr and --master-port, and check that this machine can reach it"
            )
        if joined > 1:
            return (
                f"fitgpt: --node-rank {self.node} has joined the job at {self.where()} already: "
                f"give each machine its own --node-rank (0..{self.nnodes - 1})"
            )
        if self.node == 0:
            missing = self._wait_for_all()
            if missing:
                return (
                    f"fitgpt: node(s) {', '.join(map(str, missing))} of {self.nnodes} did not "
                    f"join at {self.where()} within --dist-timeout {self.timeout_s:g} s; start "
                    "each with the same --nnodes, --master-addr and --master-port"
                )
        threading.Thread(target=self._beat, daemon=True, name="fitgpt-heartbeat").start()
        return None

    def _unreachable(self) -> str | None:
        """Why node 0's port did not accept a connection within the timeout, or None once it
        does. Asked in Python first: a TCPStore client that times out logs a C++ stack trace
        (c10d's socket.cpp) above the one line that says what to do."""
        deadline, why = time.monotonic() + self.timeout_s, "no answer"
        while time.monotonic() < deadline:
            try:
                with socket.create_connection((self.addr, self.port), timeout=2):
                    return None
            except OSError as e:
                why = e.strerror or type(e).__name__
            time.sleep(0.5)
        return why

    def _wait_for_all(self) -> list[int]:
        deadline = time.monotonic() + self.timeout_s
        while True:
            missing = [r for r in range(self.nnodes) if not self.store.check([f"fitgpt/node/{r}"])]
            if not missing or time.monotonic() > deadline:
                return missing
            time.sleep(0.2)

    def _beat(self) -> None:
        """Count this node's heartbeat until the store goes (node 0 ended) or the job does."""
        from torch.distributed import TCPStore

        try:  # a client of its own: a store connection is not shared between threads
            store = TCPStore(self.addr, self.port, None, False, _timedelta(self.timeout_s))
            self.beating.set()
            while True:
                store.add(f"fitgpt/beat/{self.node}", 1)
                time.sleep(BEAT_S)
        except Exception:
            return  # node 0's store is gone: the job is over, or node 0 is; silent_nodes says

    def sign_out(self) -> None:
        """Mark this node as ended by its own launcher (its ranks finished or failed, and its
        output says why): a node whose heartbeat stops without this mark went down."""
        with contextlib.suppress(Exception):  # node 0's store may be gone already
            self.store.set(f"fitgpt/ended/{self.node}", "1")

    def silent_nodes(self) -> list[int]:
        """The nodes whose heartbeat stopped without their launcher signing out (node 0 if its
        store cannot be reached)."""
        try:
            keys = [f"fitgpt/beat/{r}" for r in range(self.nnodes)]
            before = [self.store.add(k, 0) for k in keys]
            time.sleep(SILENT_S)
            after = [self.store.add(k, 0) for k in keys]
            ended = [self.store.check([f"fitgpt/ended/{r}"]) for r in range(self.nnodes)]
        except Exception:
            return [0]
        return [
            r
            for r in range(self.nnodes)
            if r != self.node and after[r] == before[r] and not ended[r]
        ]


def _timedelta(seconds: float):
    import datetime

    return datetime.timedelta(seconds=seconds)
