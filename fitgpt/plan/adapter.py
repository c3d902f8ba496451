"""An adapter run's placement, decided once, where a run is settled (train/assemble.py settle).

LoRA (fitgpt/adapters) trains a few matrices on a frozen base. The chunk engine does not hold
frozen weights yet (its chunks step every parameter they hold), and the planner does not price
a frozen base (its memory model counts gradients and Adam moments for every parameter), so an
adapter run trains on the ddp engine, as given, unplanned: every rank holds the base's fp32
weights and the adapters with their state (docs/adapters.md). What needs the chunk engine, or
cuts the model, is refused in one line naming the flag, before anything is planned or built:

  --engine zero, --zero-stage 1-3         sharded state: the ddp engine shards nothing
  --offload-optimizer, --offload-params,  state in host RAM or on disk: the chunk engine's tiers
  --offload-blocks, --nvme-blocks, and
  the two --*-fraction shares, --nvme-path
  --master split, compact --moments,      the chunk engine's optimizer formats
  --device-moments
  --compile model                         the chunk engine's whole-model graph
  --tensor-parallel, --context-parallel   adapters are not cut or hooked for them yet

The adapter's own checks: its fields in AdapterConfig.__post_init__, its target names against
the family here (adapters/targets.py), and a base to adapt (--init-from, or on a resume the
source its checkpoint names).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from fitgpt.adapters import lora_targets
from fitgpt.engine.config import EngineConfig
from fitgpt.errors import UserError
from fitgpt.plan.fixed import Fixed
from fitgpt.plan.validate import flag_text

WHY = (
    "a LoRA run (--lora-rank) trains on the ddp engine, which holds a frozen base; the chunk "
    "engine's sharding, offload and formats do not hold one yet"
)
# engine field -> the value that asks nothing of the chunk engine (none typed, or off)
PLAIN = {
    "zero_stage": 0,
    "offload_optimizer": "none",
    "offload_params": "none",
    "offload_blocks": None,
    "nvme_blocks": None,
    "master": ("auto", "fp32"),
    "moments": ("auto", "fp32"),
    "device_moments": ("auto", "fp32"),
    "tensor_parallel": 1,
    "context_parallel": 1,
}


def adapter_refusal(e: EngineConfig, typed: Mapping[str, Any]) -> str | None:
    """The one line refusing an engine setting an adapter run cannot have, or None. `e`: the
    engine config as asked (with --plan auto, its fixed fields applied); `typed`: the engine
    flags typed (the shares --offload-fraction and --nvme-fraction among them)."""
    if typed.get("engine") == "zero":
        return f"--engine zero: {WHY}; drop it"
    for name in ("offload_fraction", "nvme_fraction", "nvme_path"):
        if typed.get(name) not in (None, ""):
            return f"{flag_text(name, typed[name])}: {WHY}; drop it"
    for name, plain in PLAIN.items():
        v = getattr(e, name)
        if v == plain or (isinstance(plain, tuple) and v in plain):
            continue
        if name in ("tensor_parallel", "context_parallel"):
            return (
                f"{flag_text(name, v if v else 'auto')}: LoRA adapters are not cut for tensor "
                "or context parallelism yet; drop it (data parallelism over the GPUs holds the "
                "whole base on each)"
            )
        return f"{flag_text(name, v)}: {WHY}; drop it"
    if e.compile == "model":
        return "--compile model: the whole-model graph is the chunk engine's; use --compile blocks"
    return None


def adapter_placement(run, fixed: Fixed | None, typed: Mapping[str, Any], has_base: bool):
    """(run, fixed, notes) for an adapter run: the ddp engine with the fields asked, unplanned
    (fixed None); a run without adapters as it is. Refuses, in one line, a setting
    adapter_refusal names, a target its family has not, and an adapter without a base."""
    a = run.adapter
    if not a.active:
        return run, fixed, ()
    if not has_base:
        raise UserError(
            f"--lora-rank {a.lora_rank} adapts a pretrained model: add --init-from MODEL (a "
            "Hugging Face folder or a fitgpt run)"
        )
    lora_targets(run.model, a)  # each name refused here if the family has no such linear
    e = fixed.applied(run.engine) if fixed is not None and fixed.names else run.engine
    why = adapter_refusal(e, typed)
    if why:
        raise UserError(why)
    run = dataclasses.replace(run, engine=dataclasses.replace(e, engine="ddp"))
    note = (
        "LoRA: the ddp engine (the planner does not price a frozen base yet: set "
        "--checkpointing full if activations do not fit)"
    )
    return run, None, (note,) if fixed is not None else ()
