"""Tensor parallelism's cuts: the maps between a full tensor and rank r's 1/T of it (used at
initialisation, checkpoint save and load), and what T must divide.

Which parameters are cut, and how, is the model family's to say (model/family.py: Family.splits,
a Split per parameter; for GPT-2 Megatron-LM's split, model/families/gpt2/family.py). The chunk
layout records each parameter's Split once (engine/layout.py ParamSlot.split); everything here
takes it from there. A Split(dim, parts) cuts along `dim`, each of `parts` stacked pieces on its
own: a fused q/k/v weight [3H, H] of T ranks keeps [q_r; k_r; v_r] ([3H/T, H]) on rank r, so its
local output splits into q, k and v again. None: the parameter is replicated.
"""

from __future__ import annotations

import torch
from torch import Tensor

from fitgpt.model import ModelConfig, Split, family_of


def local_shape(rule: Split | None, shape: tuple[int, ...], tp: int) -> tuple[int, ...]:
    if rule is None:
        return tuple(shape)
    return tuple(n // tp if d == rule.dim else n for d, n in enumerate(shape))


def shard_of(rule: Split | None, full: Tensor, rank: int, tp: int) -> Tensor:
    """Rank `rank`'s part of the full tensor `full` (a view for a replicated one, else a copy)."""
    if rule is None:
        return full
    dim, parts = rule.dim, rule.parts
    pieces = [p.chunk(tp, dim)[rank] for p in full.chunk(parts, dim)]
    return torch.cat(pieces, dim) if parts > 1 else pieces[0].contiguous()


def unshard(rule: Split | None, shards: list[Tensor]) -> Tensor:
    """The full tensor from every rank's part, in TP-rank order (inverse of shard_of)."""
    if rule is None:
        return shards[0]  # replicated: identical on every TP rank
    dim, parts = rule.dim, rule.parts
    split = [s.chunk(parts, dim) for s in shards]  # [rank][part]
    return torch.cat([split[r][k] for k in range(parts) for r in range(len(shards))], dim)


def tp_sizes(cfg: ModelConfig, world: int | None, sequence_parallel: bool) -> list[tuple[int, str]]:
    """What T must divide: (size, what it is, as the line names it)."""
    checks = family_of(cfg).tp_sizes(cfg)
    if world is not None:
        checks.insert(0, (world, "the rank count (--gpus)"))
    if sequence_parallel:  # the residual stream is split along the sequence
        checks.append((cfg.seq_len, "the sequence length (--seq-len), with --sequence-parallel"))
    return checks


def what_divides(checks: list[tuple[int, str]]) -> str:
    """'a, b and c' of the sizes a refusal names (the model family's, with the ranks)."""
    names = [what for _, what in checks]
    return ", ".join(names[:-1]) + " and " + names[-1] if len(names) > 1 else names[0]


def tp_divisors(cfg: ModelConfig, world: int, sequence_parallel: bool = False) -> list[int]:
    """Every T the job and the model can be split by (what --tensor-parallel auto prices);
    with --sequence-parallel only T >= 2 (it splits within a TP group)."""
    sizes = [n for n, _ in tp_sizes(cfg, world, sequence_parallel)]
    low = 2 if sequence_parallel else 1
    return [d for d in range(low, world + 1) if all(n % d == 0 for n in sizes)]


def tensor_parallel_refusal(
    tp: int, cfg: ModelConfig, world: int | None = None, sequence_parallel: bool = False
) -> str | None:
    """The one line refusing a T the model or the job cannot be split by, or None. `world`: the
    job's rank count where known; T = 0 is auto, which the planner resolves (see tp_divisors)."""
    if tp < 0:
        return f"--tensor-parallel {tp} must be at least 1"
    if tp <= 1:
        return None
    checks = tp_sizes(cfg, world, sequence_parallel)
    for n, what in checks:
        if n % tp:
            ok = [d for d in range(1, tp + 1) if all(m % d == 0 for m, _ in checks)]
            return (
                f"--tensor-parallel {tp} does not divide {what}, {n}: use one of "
                f"{', '.join(map(str, ok))} (it must divide {what_divides(checks)})"
            )
    return None
