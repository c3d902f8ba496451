"""Which parameters tensor parallelism splits, along which dimension, and the maps between a
full tensor and rank r's 1/T of it (used at initialisation, checkpoint save and load).

Megatron-LM's split of a GPT-2 block (Shoeybi et al. 2019), for T ranks:
  attn.qkv  [3H, H]  column-parallel: rows split, whole heads per rank. The rows are q, k, v
                     back to back, so each of the three is split on its own and rank r holds
                     [q_r; k_r; v_r] ([3H/T, H]): the local qkv output splits into q, k, v again.
  mlp.fc    [4H, H]  column-parallel: rows split ([4H/T, H]), the bias with them.
  attn.proj [H, H]   row-parallel: columns split ([H, H/T]); the bias is replicated (added
  mlp.proj  [H, 4H]  once, after the all-reduce of the partial outputs).
  wte, lm_head [V, H] split by vocabulary rows ([V/T, H]).
Everything else (LayerNorms, position embedding, row-parallel biases) is replicated.
"""

from __future__ import annotations

import torch
from torch import Tensor

from fitgpt.errors import UserError
from fitgpt.model import ModelConfig

# parameter-name suffix -> (dimension split, how many stacked parts are each split on their own)
_RULES = {
    "attn.qkv.weight": (0, 3),
    "attn.qkv.bias": (0, 3),
    "mlp.fc.weight": (0, 1),
    "mlp.fc.bias": (0, 1),
    "attn.proj.weight": (1, 1),
    "mlp.proj.weight": (1, 1),
    "wte.weight": (0, 1),
    "lm_head.weight": (0, 1),
}


def split_rule(name: str) -> tuple[int, int] | None:
    """(dim, parts) of a split parameter, None for a replicated one."""
    for suffix, rule in _RULES.items():
        if name == suffix or name.endswith("." + suffix):
            return rule
    return None


def local_shape(name: str, shape: tuple[int, ...], tp: int) -> tuple[int, ...]:
    rule = split_rule(name)
    if rule is None:
        return tuple(shape)
    dim = rule[0]
    return tuple(n // tp if d == dim else n for d, n in enumerate(shape))


def shard_of(name: str, full: Tensor, rank: int, tp: int) -> Tensor:
    """Rank `rank`'s part of the full tensor `full` (a view for a replicated one, else a copy)."""
    rule = split_rule(name)
    if rule is None:
        return full
    dim, parts = rule
    pieces = [p.chunk(tp, dim)[rank] for p in full.chunk(parts, dim)]
    return torch.cat(pieces, dim) if parts > 1 else pieces[0].contiguous()


def unshard(name: str, shards: list[Tensor]) -> Tensor:
    """The full tensor from every rank's part, in TP-rank order (inverse of shard_of)."""
    rule = split_rule(name)
    if rule is None:
        return shards[0]  # replicated: identical on every TP rank
    dim, parts = rule
    split = [s.chunk(parts, dim) for s in shards]  # [rank][part]
    return torch.cat([split[r][k] for k in range(parts) for r in range(len(shards))], dim)


def _splits(cfg: ModelConfig, world: int | None, sequence_parallel: bool) -> list[tuple[int, str]]:
    """What T must divide: (size, what it is, as the line names it)."""
    checks = [
        (cfg.n_head, "the head count (--heads)"),
        (4 * cfg.n_embd, "the MLP width 4·--hidden"),
        (cfg.padded_vocab_size, "the padded vocabulary"),
    ]
    if world is not None:
        checks.insert(0, (world, "the rank count (--gpus)"))
    if sequence_parallel:  # the residual stream is split along the sequence
        checks.append((cfg.seq_len, "the sequence length (--seq-len), with --sequence-parallel"))
    return checks


def tp_divisors(cfg: ModelConfig, world: int, sequence_parallel: bool = False) -> list[int]:
    """Every T the job and the model can be split by (what --tensor-parallel auto prices);
    with --sequence-parallel only T >= 2 (it splits within a TP group)."""
    sizes = [n for n, _ in _splits(cfg, world, sequence_parallel)]
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
    checks = _splits(cfg, world, sequence_parallel)
    for n, what in checks:
        if n % tp:
            ok = [d for d in range(1, tp + 1) if all(m % d == 0 for m, _ in checks)]
            return (
                f"--tensor-parallel {tp} does not divide {what}, {n}: use one of "
                f"{', '.join(map(str, ok))} (it must divide the ranks, heads, 4·hidden and "
                "the padded vocabulary)"
            )
    return None


def check_tensor_parallel(
    tp: int, cfg: ModelConfig, world: int | None = None, sequence_parallel: bool = False
) -> None:
    """Refuse a T the model or the job cannot be split by, in one line, before anything is built.
    `world`: the job's rank count where known."""
    if tp == 0:
        raise UserError(
            "--tensor-parallel auto is the planner's to resolve: train with --plan auto, or give T"
        )
    why = tensor_parallel_refusal(tp, cfg, world, sequence_parallel)
    if why:
        raise UserError(why)
