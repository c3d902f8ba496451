"""One validation of a run's settings: model × engine × precision × world size × device.

Each config checks its own fields in `__post_init__` (engine/config.py: `--engine ddp` with a
ZeRO stage, streamed weights without an offload tier, ...). What needs two configs, the job's
rank count or the device is decided here, once, and called by everything that plans or runs:

  a run's assembly (train/assemble.py settle, on the model as built: `fitgpt train` once, before
  torchrun starts and before any rank allocates; the benchmark harness's trials),
  `fitgpt plan`, `fitgpt capacity` and `fitgpt bench sweep` (before the first candidate or
  trial), and the planner itself, which drops every candidate `refusal` refuses,
  so it can never choose a plan that train would refuse (tests/test_settings_grid.py).

Two kinds of line:
- a setting the engines cannot run (a T or C that does not divide the heads, a split master under
  fp16, fp16 on a CPU, ...): `refusal`;
- a flag the user typed that would change nothing (`--master split` under fp32 compute,
  `--moments int8` with nothing offloaded, a loss-scale flag without fp16): `no_effect`. Only
  typed flags are judged (a resumed run's saved config and a DeepSpeed file's mapped keys are
  not), and only against settings that are settled: under `--plan auto` a field the planner
  chooses may still make the flag count.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import SimpleNamespace
from typing import Any

from fitgpt.dist.context import device_type
from fitgpt.engine.config import EngineConfig, PrecisionConfig
from fitgpt.errors import UserError
from fitgpt.model import ModelConfig, family_of
from fitgpt.plan.fixed import ENGINE_FIELDS, Fixed

SCALER_FIELDS = ("initial_scale", "growth_interval", "hysteresis", "min_scale")

# fp16 on a CPU: `fitgpt train --preset tiny --device cpu --steps 20 --cpu-threads 1` on the
# 2-core AMD EPYC box (avx512_bf16, 2026-11-26, six runs with other jobs' load beside them):
# fp32 225-604 ms/step, bf16 245-371, fp16 5,120-6,088 (18-25x fp32's). CPUs have no fast fp16
# matmul; bf16 ran at fp32's speed there, so it stays the user's choice (--precision auto
# picks fp32 on CPUs).
CPU_FP16_SLOWDOWN = 20


def refusal(
    model: ModelConfig,
    engine: EngineConfig,
    precision: str,
    world: int,
    device: str,
    planning: bool = False,
    chosen: frozenset[str] = frozenset(),
) -> str | None:
    """The one line refusing what the engines cannot run, or None. `precision` is resolved
    (bf16, fp16 or fp32), `device` is "cuda" or "cpu", `world` the job's ranks. `planning`: the
    planner resolves what is left open (--tensor-parallel auto); `chosen`: the engine fields
    it will choose, whose values in `engine` are placeholders and are not judged."""
    from fitgpt.engine.chunked.placement import (
        disk_blocks,
        offloaded_blocks,
        split_master_refusal,
        stream_refusal,
    )
    from fitgpt.parallel.context import context_parallel_refusal
    from fitgpt.parallel.experts import expert_parallel_refusal
    from fitgpt.parallel.shard import (
        tensor_parallel_refusal,
        tp_divisors,
        tp_sizes,
        what_divides,
    )

    def settled(*names: str) -> bool:
        return not chosen.intersection(names)

    e, tp = engine, engine.tensor_parallel
    if settled("master") and e.master == "split" and split_master_refusal(precision):
        return split_master_refusal(precision)
    if precision == "fp16" and device == "cpu":
        return (
            f"--precision fp16 on a CPU: CPUs have no fast fp16 matmul (measured "
            f"~{CPU_FP16_SLOWDOWN}x slower than fp32); use --precision fp32 (or bf16)"
        )
    if settled("offload_blocks", "nvme_blocks"):
        # the block counts, the placement's own rule (engine/chunked/placement.py), before how
        # the model cuts over the ranks; a tier the planner chooses is the one these counts imply
        # (plan/enumeration.py: enumerate_plans)
        tier = e.offload_optimizer if settled("offload_optimizer") else implied_tier(e)
        counts = SimpleNamespace(
            offload_optimizer=tier, offload_blocks=e.offload_blocks, nvme_blocks=e.nvme_blocks
        )
        try:
            disk_blocks(counts, offloaded_blocks(counts, model.n_layer))
        except UserError as err:
            return str(err)
    if e.keep_activations > model.n_layer:
        return (
            f"--keep-activations {e.keep_activations}: the model has {model.n_layer} blocks; use "
            f"0 to {model.n_layer}"
        )
    if tp == 0 and not planning:
        return (
            "--tensor-parallel auto is the planner's to resolve: train with --plan auto, or give T"
        )
    if tp == 0 and e.sequence_parallel and not tp_divisors(model, world, True):
        return (
            "--tensor-parallel auto --sequence-parallel: no T of 2 or more divides "
            f"{what_divides(tp_sizes(model, world, True))}; drop --sequence-parallel or change "
            "--gpus"
        )
    # a T the planner chooses is a placeholder here, as P is below (a resumed run's is the saved
    # run's T, which need not divide the new rank count): the planner prices only the T that
    # pass this rule
    if settled("tensor_parallel"):
        why = tensor_parallel_refusal(tp, model, world, e.sequence_parallel)
        if why:
            return why
    else:
        tp = 1  # the rules below judge the other degrees at the T every rank count allows
    why = context_parallel_refusal(e.context_parallel, model, world, tp, e.sequence_parallel)
    if why:
        return why
    if e.expert_parallel == 0 and not planning:
        return (
            "--expert-parallel auto is the planner's to resolve: train with --plan auto, or give P"
        )
    # a P the planner chooses is a placeholder here (a resumed run's is the saved run's P, which
    # need not divide the new rank count): the planner prices only the P that pass this rule
    if settled("expert_parallel"):
        why = expert_parallel_refusal(e.expert_parallel, model, world, tp, e.context_parallel)
        if why:
            return why
    if e.offload_experts and not family_of(model).has_experts:
        return f"--offload-experts: the {model.family} family has no experts; drop it"
    if e.expert_parallel > 1 and settled("engine") and e.engine != "zero":
        return (
            f"--expert-parallel {e.expert_parallel} runs on the chunked engine: use --engine zero"
        )
    if e.compile == "model" and e.expert_parallel > 1:
        # the all-to-alls' splits are host integers (a host sync per sparse layer)
        return "--compile model with --expert-parallel: use --compile blocks or off"
    if e.compile == "model" and settled("engine") and e.engine != "zero":
        # DDP's reducer starts each bucket's all-reduce from a gradient hook between blocks,
        # which one graph of the whole model would not leave room for
        return "--compile model needs --engine zero (DDP compiles the blocks): use --compile blocks"
    dp = world // max(1, tp)  # the ranks ZeRO shards over
    streams = e.offload_params == "cpu" and e.offload_blocks != 0
    if settled("offload_params", "zero_stage") and streams and stream_refusal(dp, e.zero_stage):
        return stream_refusal(dp, e.zero_stage)
    return None


def implied_tier(fixed: EngineConfig | Fixed) -> str:
    """The offload tier block counts imply when the user fixed them but not the tier: nvme
    for --nvme-blocks, cpu for --offload-blocks, none otherwise (`fixed`: an EngineConfig or the
    fields the user fixed)."""
    if fixed.nvme_blocks is not None:
        return "nvme"
    return "cpu" if fixed.offload_blocks is not None else "none"


def no_effect(
    engine: EngineConfig,
    precision: str,
    typed: Mapping[str, Any],
    chosen: frozenset[str] = frozenset(),
) -> str | None:
    """The one line refusing a typed flag that would change nothing, or None. `typed`: the
    engine and precision fields given on the command line (flag name = field name); `chosen`:
    the engine fields the planner will choose (a flag that counts if it chooses so is fine)."""

    def settled(name: str) -> bool:
        return name not in chosen

    e = engine
    if typed.get("master") == "split" and precision == "fp32":
        return (
            "--master split changes nothing under fp32 compute (the master weights are the "
            "working weights): add --precision bf16, or drop --master"
        )
    no_tier = settled("offload_optimizer") and e.offload_optimizer == "none"
    for name in ("moments", "offload_blocks", "offload_fraction", "speculative_update"):
        # moments: only the compact formats (fp32 is what a tier-less run keeps anyway)
        if name in typed and no_tier and (name != "moments" or typed[name] in ("bf16", "int8")):
            shown = flag_text(name, typed[name])
            also = " (--device-moments stores the state on the GPU)" if name == "moments" else ""
            return (
                f"{shown} changes nothing with --offload-optimizer none (it is about the "
                f"offloaded blocks): add --offload-optimizer cpu, or drop it{also}"
            )
    not_disk = settled("offload_optimizer") and e.offload_optimizer != "nvme"
    for name in ("nvme_blocks", "nvme_fraction", "nvme_path"):
        if typed.get(name) not in (None, "") and not_disk:
            return (
                f"{flag_text(name, typed[name])} changes nothing with --offload-optimizer "
                f"{e.offload_optimizer} (it is about the disk tier): add --offload-optimizer "
                "nvme, or drop it"
            )
    for name in SCALER_FIELDS:
        if name in typed and precision != "fp16":
            return (
                f"{flag_text(name, typed[name])} changes nothing in {precision} (it sets fp16's loss "
                "scaler): add --precision fp16, or drop it"
            )
    return None


def flag_text(name: str, value: Any) -> str:
    """A field as the flag that sets it: `--moments int8`, `--no-speculative-update`."""
    flag = name.replace("_", "-")
    if isinstance(value, bool):
        return f"--{flag}" if value else f"--no-{flag}"
    return f"--{flag} {value:g}" if isinstance(value, float) else f"--{flag} {value}"


def check_settings(
    model: ModelConfig,
    engine: EngineConfig,
    precision: PrecisionConfig,
    world: int,
    device: str,
    fixed: Fixed | None = None,
    typed: Mapping[str, Any] | None = None,
) -> None:
    """Refuse (UserError, one line) a run `train` would refuse, before anything is planned or
    allocated. `device`: --device as given (auto, cuda, cpu); `fixed`: with --plan auto, the
    engine fields the user set (the planner chooses the rest); None: --plan off, `engine` is
    used as it is. `typed`: the engine and precision flags typed on the command line."""
    dev = device_type(device)
    prec = precision.resolved(dev).precision
    if fixed is not None and fixed.names:
        # the fields the planner keeps (a benchmark system's, or the flags: no change)
        engine = fixed.applied(engine)
    chosen = frozenset() if fixed is None else ENGINE_FIELDS - fixed.names
    # a flag that changes nothing is said only when nothing is refused (refusals come first)
    idle = no_effect(engine, prec, typed, chosen) if typed else None
    why = refusal(model, engine, prec, world, dev, fixed is not None, chosen) or idle
    if why:
        raise UserError(why)
