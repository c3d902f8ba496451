"""The 2-D layout of ranks for tensor parallelism: T-rank tensor-parallel (TP) groups × D-rank
data-parallel (DP) groups, W = T·D.

TP groups are T consecutive ranks (tp-major): ranks 0..T-1 form the first, so on one box a group
is GPUs that share the fastest links (TP all-reduces run twice per layer per pass, DP reductions
once per step). The DP group of a rank is every rank with its TP index: ranks i, i+T, i+2T, …

    W = 4, T = 2:   TP groups {0,1} {2,3}     DP groups {0,2} {1,3}

torch.distributed.new_group is collective over the whole world, every rank creating every group
in the same order, even groups it is not in; `build_mesh` does exactly that, in one place.
A group of one rank is None: the collectives of fitgpt.engine.comm treat it as a copy.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist

from fitgpt.errors import UserError


@dataclass(frozen=True)
class Mesh:
    """This rank's place in the T × D layout and its two groups (None: a group of one)."""

    tp: int  # T, ranks per tensor-parallel group
    dp: int  # D, ranks per data-parallel group
    tp_rank: int  # index inside the TP group: which 1/T of every split weight this rank holds
    dp_rank: int  # index inside the DP group: which micro-batches and which ZeRO shard
    tp_group: dist.ProcessGroup | None
    dp_group: dist.ProcessGroup | None


def tp_ranks(world: int, tp: int) -> list[list[int]]:
    """The TP groups: T consecutive ranks each."""
    return [list(range(g * tp, (g + 1) * tp)) for g in range(world // tp)]


def dp_ranks(world: int, tp: int) -> list[list[int]]:
    """The DP groups: the ranks sharing one TP index."""
    return [list(range(i, world, tp)) for i in range(tp)]


def check_world(tp: int, world: int) -> None:
    if tp == 0:
        raise UserError("--tensor-parallel auto is the planner's to resolve: use --plan auto")
    if tp < 1 or world % tp:
        raise UserError(
            f"--tensor-parallel {tp} does not divide the {world} rank(s) of this run: use a "
            f"divisor of {world} (or --gpus a multiple of {tp})"
        )


def build_mesh(rank: int, world: int, tp: int) -> Mesh:
    """Create every TP and DP group (collective: every rank calls it with the same arguments)."""
    check_world(tp, world)
    mine = {}
    for kind, groups in (("tp", tp_ranks(world, tp)), ("dp", dp_ranks(world, tp))):
        for ranks in groups:
            # one rank: nothing to communicate; new_group is still called on every rank only for
            # groups that do communicate, in the same order on all of them
            g = dist.new_group(ranks) if len(ranks) > 1 else None
            if rank in ranks:
                mine[kind] = (g, ranks.index(rank))
    (tp_group, tp_rank), (dp_group, dp_rank) = mine["tp"], mine["dp"]
    return Mesh(tp, world // tp, tp_rank, dp_rank, tp_group, dp_group)


# ---- context parallelism --------------------------------------------------------------------
@dataclass(frozen=True)
class ContextGroup:
    """This rank's place in a C-rank context-parallel (CP) group (cp_ranks): C ranks that
    share every row, each holding the contiguous slice [rank·S/C, (rank+1)·S/C) of its
    tokens (fitgpt/parallel/context.py). For gradients and ZeRO the C ranks are data-parallel
    ranks like any other (they train different tokens of the same weights), so the engines
    reduce over the whole job; only the data loader and attention's all-to-alls see the group."""

    size: int  # C
    rank: int  # which slice of every row this rank holds
    group: dist.ProcessGroup | None  # the C ranks; None: a group of one


def cp_ranks(world: int, cp: int, tp: int = 1) -> list[list[int]]:
    """The CP groups: C consecutive ranks of each DP group (ranks i, i+T, ..., i+(C-1)T: at
    T = 1 consecutive ranks, one box's fastest links; attention's all-to-alls run 4 times per
    layer per pass). With T > 1 the T ranks of a TP group sit in T CP groups of the same
    slice index, so they share rows and slices.

        W = 4, T = 2, C = 2:   TP {0,1} {2,3}   CP {0,2} {1,3}   (DP: the same, one row each)"""
    out = []
    for dp_group in dp_ranks(world, tp):
        out += [dp_group[g * cp : (g + 1) * cp] for g in range(len(dp_group) // cp)]
    return out


def build_context_group(rank: int, world: int, cp: int, tp: int = 1) -> ContextGroup:
    """Create every CP group (collective: every rank calls it with the same arguments)."""
    if cp < 1 or world % (cp * tp):
        raise UserError(
            f"--context-parallel {cp} × --tensor-parallel {tp} does not divide the {world} "
            f"rank(s) of this run: use --gpus a multiple of {cp * tp}"
        )
    mine = None
    for ranks in cp_ranks(world, cp, tp):
        g = dist.new_group(ranks) if len(ranks) > 1 else None
        if rank in ranks:
            mine = ContextGroup(cp, ranks.index(rank), g)
    assert mine is not None
    return mine


# ---- expert parallelism ---------------------------------------------------------------------
@dataclass(frozen=True)
class ExpertGroups:
    """This rank's place under P-way expert parallelism (fitgpt/parallel/experts.py): the EP
    group (P consecutive ranks, one box's fastest links, which trade tokens by all-to-all, EP
    rank r holding experts [r·E/P, (r+1)·E/P) of every sparse layer) and the replica group (the
    W/P ranks holding the same experts, ranks r, r+P, ...: the experts' gradients are reduced
    and their ZeRO shards cut over it, as the dense parts' are over the whole world).

        W = 4, P = 2:   EP groups {0,1} {2,3}     replica groups {0,2} {1,3}"""

    size: int  # P
    rank: int  # which E/P experts this rank holds
    group: dist.ProcessGroup | None  # the P ranks; None: a group of one
    replicas: int  # W/P
    replica_rank: int
    replica_group: dist.ProcessGroup | None


def build_expert_groups(rank: int, world: int, ep: int) -> ExpertGroups:
    """Create every EP and replica group (collective: every rank calls it with the same
    arguments); the layout is tp_ranks' and dp_ranks' with T = P."""
    if ep < 1 or world % ep:
        raise UserError(
            f"--expert-parallel {ep} does not divide the {world} rank(s) of this run: use a "
            f"divisor of {world}"
        )
    mine = {}
    for kind, groups in (("ep", tp_ranks(world, ep)), ("rep", dp_ranks(world, ep))):
        for ranks in groups:
            g = dist.new_group(ranks) if len(ranks) > 1 else None
            if rank in ranks:
                mine[kind] = (g, ranks.index(rank))
    (group, ep_rank), (rep_group, rep_rank) = mine["ep"], mine["rep"]
    return ExpertGroups(ep, ep_rank, group, world // ep, rep_rank, rep_group)


# ---- hierarchical sharding (HSDP) -----------------------------------------------------------
def node_ranks(world: int, per_node: int) -> list[list[int]]:
    """The ranks of each machine: G consecutive ranks (torchrun's order: node r holds ranks
    r·G..r·G+G-1)."""
    return [list(range(n * per_node, (n + 1) * per_node)) for n in range(world // per_node)]


def replica_ranks(world: int, per_node: int) -> list[list[int]]:
    """The replicas of one shard: the ranks of the same local index on every machine.

    W = 4, G = 2:   nodes {0,1} {2,3}   replicas {0,2} {1,3}"""
    return [list(range(i, world, per_node)) for i in range(per_node)]


def build_node_groups(rank: int, world: int, per_node: int) -> dict[str, tuple]:
    """This rank's machine group and replica group, {"node": (group, size, index), "replica":
    ...} (collective: every rank calls it with the same arguments; a group of one is None)."""
    if per_node < 1 or world % per_node:
        raise UserError(
            f"--shard-within node: the {world} rank(s) are not whole machines of {per_node} "
            "(every machine must start the same --gpus)"
        )
    mine = {}
    for kind, groups in (("node", node_ranks(world, per_node)),
                         ("replica", replica_ranks(world, per_node))):  # fmt: skip
        for ranks in groups:
            g = dist.new_group(ranks) if len(ranks) > 1 else None
            if rank in ranks:
                mine[kind] = (g, len(ranks), ranks.index(rank))
    return mine
