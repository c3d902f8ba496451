"""`fitgpt plan`: what fits on this machine, where every byte lives, and which plan is fastest."""

from __future__ import annotations

import argparse
import dataclasses

from fitgpt import units
from fitgpt.adapters.config import AdapterConfig
from fitgpt.cli.args import (
    add_config_args,
    add_fraction_flags,
    add_removed_flags,
    explicit,
    typed_flags,
)
from fitgpt.data.config import DataConfig
from fitgpt.engine.config import EngineConfig, PrecisionConfig
from fitgpt.errors import UserError
from fitgpt.model import ModelConfig, get_preset
from fitgpt.plan.links import INTER_NODE_GBIT, stated_link
from fitgpt.train.config import TrainConfig
from fitgpt.train.request import DEFAULT_PRESET


def add_hardware_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("hardware (detected when not given)")
    g.add_argument(
        "--gpus",
        type=int,
        default=None,
        help="GPUs to plan for on each node (each trains on its share of the batch)",
    )
    g.add_argument(
        "--nnodes",
        type=int,
        default=None,
        help="machines alike, --gpus each: --cpu-mem and --nvme are each one's (default: 1)",
    )
    g.add_argument(
        "--inter-node-gbps",
        type=float,
        default=None,
        help="the link between nodes, Gb/s per GPU (bits, as NICs are sold; default: "
        f"{INTER_NODE_GBIT:g}, one 400 Gb/s NIC per GPU: docs/planner.md)",
    )
    g.add_argument("--gpu-mem", default=None, help="memory per GPU, e.g. 80GB or 79GiB")
    g.add_argument(
        "--cpu-mem",
        default=None,
        help="usable host RAM, e.g. 125GB (some machines "
        "report less than they give: say what you know)",
    )
    g.add_argument(
        "--nvme",
        default=None,
        help="a folder on a fast disk the plan may keep optimizer state in, or a size like "
        "64GB to plan for such a disk",
    )


def register(sub) -> None:
    p = sub.add_parser(
        "plan",
        help="predict memory and speed of every plan and choose one",
        description="Enumerate the plans that could train this model here, predict "
        "each one's memory per device and step time, and print them with the "
        "chosen one first. Nothing is allocated.",
    )
    p.add_argument(
        "--preset",
        default=None,
        help=f"named model config (see `fitgpt presets`; default: {DEFAULT_PRESET})",
    )
    p.add_argument(
        "--init-from",
        default=None,
        metavar="SRC",
        help="plan for the model of SRC, as `fitgpt train --init-from SRC` would train it: a "
        "Hugging Face folder or a fitgpt run (its config and the tensors' headers are read, "
        "no weights)",
    )
    add_config_args(
        p.add_argument_group("model"),
        ModelConfig,
        defaults=get_preset("tiny"),
        default_text="from --preset; tiny: {}",
    )
    add_config_args(
        p.add_argument_group("data (its tokenizer sets the vocabulary, as in `fitgpt train`)"),
        DataConfig,
        skip=("split", "sample_order"),
    )
    # the batch flags are train's, with train's defaults: plan prices the run train makes
    # (--steps: what --compile auto weighs a compile against, engine/transforms/compile.py)
    batch = ("micro_batch", "grad_accum", "steps")
    add_config_args(
        p.add_argument_group("batch and length (as in `fitgpt train`)"),
        TrainConfig,
        skip=tuple(f.name for f in dataclasses.fields(TrainConfig) if f.name not in batch),
    )
    p.add_argument(
        "--device",
        choices=["auto", "cuda", "cpu"],
        default="auto",
        help="where to run: auto (a GPU if there is one), cuda or cpu (default: auto)",
    )
    p.add_argument(
        "--breakdown",
        action="store_true",
        help="also print where the chosen plan's memory goes: its bytes per rank by item, on the "
        "GPU and in host RAM, and its step time by term",
    )
    add_hardware_args(p)
    add_config_args(
        p.add_argument_group("fix part of the plan (the planner chooses what you do not set)"),
        EngineConfig,
        skip=("nvme_path",),
        planned_text="the planner's choice",
    )
    add_fraction_flags(p)
    add_removed_flags(p)
    add_config_args(p.add_argument_group("precision"), PrecisionConfig)
    add_config_args(
        p.add_argument_group(
            "LoRA adapters (docs/adapters.md): the frozen base placed as train places it"
        ),
        AdapterConfig,
    )
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from fitgpt.plan import hardware, rates
    from fitgpt.plan.apply import plan_run
    from fitgpt.plan.memory import GPU_SAFETY_MARGIN, GiB, gpu_budget
    from fitgpt.plan.validate import check_settings
    from fitgpt.train.setup import engine_flags

    hw = hardware.detect(args.gpus, args.gpu_mem, args.cpu_mem, args.nvme, args.device, args.nnodes)
    typed = typed_flags(args)  # as train judges them: before the shares become block counts
    run, fixed = planned_run(args, hw.device)
    if run.adapter.active:
        return plan_lora(args, run, fixed, typed, hw)
    model = run.model
    # what train refuses, plan refuses, in the same line, before pricing anything
    check_settings(model, run.engine, run.precision, hw.world, hw.device, fixed, typed)
    link = stated_link(args.inter_node_gbps)
    plans = plan_run(run, hw, rates.with_network(rates.load(hw.gpu_name), link), fixed)
    work, t = plans.work, run.train
    print(
        f"model {model_name(args)}: "
        f"{units.params(model.num_params())} parameters ({model.n_layer}×{model.n_embd}), micro-batch "
        f"{t.micro_batch} × {t.grad_accum} accumulation × seq {model.seq_len}, {work.precision}"
    )
    print(f"machine: {hw.describe()}; rates: {plans.rates.source}")
    if hw.nnodes > 1:
        said = plans.rates.inter_node_source
        if said == "assumed":
            said = "assumed: give --inter-node-gbps, or run `fitgpt probe` on the nodes"
        print(f"between nodes: {plans.rates.inter_node_gbit:g} Gb/s per GPU ({said})")
    cpu = cpu_only(args, hw)
    if cpu:
        print(cpu)
    if hw.device == "cuda":
        print(
            f"GPU budget: {gpu_budget(hw.gpu_mem) / GiB:.1f} of {hw.gpu_mem / GiB:.1f} GiB per GPU "
            f"(a {100 * GPU_SAFETY_MARGIN:.0f}% safety margin: docs/planner.md)"
        )
    print_table(plans.candidates, work, t.grad_accum, hw)
    if not plans.fits:
        raise UserError(plans.refusal() + (f" ({cpu})" if cpu else ""))
    print(f"chosen: {plans.summary().removeprefix('plan: ')}")
    # the plan as flags: `fitgpt train` runs exactly it with them (it validates them the same)
    print(f"as train flags: {engine_flags(plans.best.ecfg)} --plan off")
    wear = disk_wear(plans.best)
    if wear:
        print(wear)
    if args.breakdown:
        print_breakdown(plans.best)
    return 0


def plan_lora(args: argparse.Namespace, run, fixed, typed, hw) -> int:
    """`fitgpt plan --lora-rank R`: the frozen base's format and tiers as `fitgpt train` places
    them on `hw` (plan/adapter.py, the one place) with the predicted step time, the flags that
    ask for exactly that, and with --breakdown the bytes per rank item by item on the GPU, in
    host RAM and on the disk, and the step time term by term (plan/adapter_time.py)."""
    from fitgpt.plan import rates
    from fitgpt.plan.adapter import adapter_placement, plan_base, timed_base
    from fitgpt.plan.adapter_memory import price_base
    from fitgpt.plan.apply import workload_of

    has_base = args.init_from is not None
    run, _, notes = adapter_placement(run, fixed, typed, has_base=has_base)
    r = rates.with_network(rates.load(hw.gpu_name), stated_link(args.inter_node_gbps))
    cpu = cpu_only(args, hw)  # a laptop's answer must not read as a GPU box's
    try:
        placed, line = plan_base(run, hw, r)  # one line refusing a run that fits nowhere
    except UserError as e:
        raise UserError(f"{e} ({cpu})" if cpu else str(e)) from None
    a, model, t = placed.adapter, run.model, run.train
    print(
        f"model {model_name(args)}: {units.params(model.num_params())} parameters "
        f"({model.n_layer}×{model.n_embd}), micro-batch {t.micro_batch} × {t.grad_accum} "
        f"accumulation × seq {model.seq_len}, LoRA rank {a.lora_rank} ({a.lora_targets})"
    )
    print(f"machine: {hw.describe()}; rates: {r.source}")
    if cpu:
        print(cpu)
    for note in notes:
        print(f"note: {note}")
    print(line)
    flags = f"--base-format {a.base_format} --base-host-blocks {a.base_host_blocks}"
    flags += f" --base-disk-blocks {a.base_disk_blocks}" if a.base_disk_blocks else ""
    flags += " --base-sharded" if a.base_sharded else " --no-base-sharded"
    e = placed.engine
    flags += f" --checkpointing {e.checkpointing}"
    if e.checkpointing == "full":  # 0 too: train would plan it again otherwise
        flags += f" --keep-activations {e.keep_activations}"
    flags += f" --compile {e.compile}"  # resolved for this run's --steps (plan/adapter.py)
    print(f"as train flags: {flags}")
    if args.breakdown:
        work = workload_of(run, hw.gpus, hw.device)
        shards = hw.gpus if a.base_sharded else 1
        p = price_base(work, a, a.base_format, a.base_host_blocks, e.checkpointing,
                       a.base_disk_blocks or 0, shards, e.keep_activations)  # fmt: skip
        p = dataclasses.replace(p, compile=e.compile)
        print_breakdown(timed_base(p, placed, work, r), p.ranks)
    return 0


def cpu_only(args: argparse.Namespace, hw) -> str | None:
    """The line that says a plan is this machine's CPU's because no GPU was found (--device
    auto, no --gpu-mem), with the flags that plan for a GPU box from here; None otherwise. A
    command copied from the README onto a laptop must not read as a GPU's answer."""
    if hw.device != "cpu" or args.device == "cpu":
        return None
    return (
        "planned for this machine's CPU and host RAM: no GPU found; to plan for a GPU box, "
        "say its memory: --gpu-mem 80GB --cpu-mem 125GB, and --gpus N for several"
    )


def print_breakdown(c, ranks: int = 0) -> None:
    """The chosen plan's estimate item by item (plan/memory.py Estimate; docs/memory.md names
    each item), largest first, and its step time term by term (plan/throughput.py; a LoRA
    base's plan, plan/adapter_memory.py BasePlan: plan/adapter_time.py), the latter saying the
    machine's host RAM and disk over its `ranks`."""
    from fitgpt.plan.memory import FRAGMENTATION, GiB

    for tier, items in (("GPU", c.est.compute), ("host", c.est.host), ("disk", c.est.nvme)):
        if not items:
            continue
        total = c.est.compute_total if tier == "GPU" else sum(items.values())
        print(f"{tier} per rank: {total / GiB:.2f} GiB")
        for name, n in sorted(items.items(), key=lambda kv: -kv[1]):
            print(f"  {name:<32}{n / GiB:>9.2f} GiB")
        if tier == "GPU":  # what compute_total adds to the allocator's peak
            frag = c.est.compute_peak * FRAGMENTATION
            print(f"  {'fragmentation margin':<32}{frag / GiB:>9.2f} GiB")
        elif ranks > 1:  # each rank pins its own blocks and writes its own files
            print(f"  {f'the machine ({ranks} ranks)':<32}{total * ranks / GiB:>9.2f} GiB")
    if not c.time:
        return
    terms = ", ".join(f"{k} {v:.2f}" for k, v in c.time.items() if k != "total")
    print(f"step {c.time['total']:.2f} s: {terms}")


def model_name(args: argparse.Namespace) -> str:
    """The --init-from source or the preset, with the fields the flags changed: "llama3.1-8b
    with seq_len=131072"."""
    name = args.init_from or args.preset or DEFAULT_PRESET
    changed = explicit(args, ModelConfig)
    if not changed:
        return name
    return f"{name} with " + ", ".join(f"{k}={v}" for k, v in changed.items())


def planned_run(args: argparse.Namespace, device: str):
    """(the run `fitgpt train` makes of these flags, the engine fields given): the run as
    train/request.py makes it (fresh_config: the same preset, data, batch and engine defaults;
    init_config for --init-from: the source's model and fine-tuning's defaults; with_block_counts:
    the shares of blocks as counts), resolved as train resolves it for `device` (the data's
    vocabulary, the precision): the planner prices the model train builds. Nothing is opened
    but the tokenizer and a source's config and tensor headers.

    One difference: with neither --data nor --tokenizer, train's default data (the standard
    library through the bytes tokenizer) would give the model a 256-row vocabulary, and a
    preset's plan would price a model nobody trains (llama3.1-70b as 68.46 B parameters, not
    its 70.55 B). There the model keeps its own vocabulary: the preset's, --vocab-size, or an
    --init-from source's (whose tokenizer train's default data would be refused against)."""
    from fitgpt.cli.train import request_of
    from fitgpt.plan.fixed import Fixed
    from fitgpt.train.request import fresh_config, with_block_counts
    from fitgpt.train.setup import resolve_run

    req = request_of(args)
    given = {part: dict(fields) for part, fields in req.given.items()}
    own_vocab = not {"data", "tokenizer"} & set(given["data"])
    if req.init_from is not None:  # the source's model, fine-tuning's defaults: train's own
        from fitgpt.interop.init_source import find_source
        from fitgpt.train.request import init_config

        if own_vocab:  # the source's vocabulary (train's default data would refuse its tokenizer)
            given["data"]["data"] = "synthetic"
        run, _ = init_config(req, given, find_source)
    else:
        run = fresh_config(req, given)
    given, run = with_block_counts(req, given, run)
    resolved = resolve_run(run, device)  # the planner settles --compile
    if own_vocab:
        own = resolved.model.replace(vocab_size=run.model.vocab_size)
        resolved = dataclasses.replace(resolved, model=own)
    return resolved, Fixed.of(given["engine"])


def print_table(cands, work, grad_accum: int, hw) -> None:
    """One row per candidate, the chosen one marked: its memory, optimizer-state formats, disk
    writes (when some plan uses the disk) and predicted speed; the plan's name last."""
    from fitgpt.plan.formats import short
    from fitgpt.plan.memory import GiB

    disk = any(c.disk_written for c in cands)
    head = f"  {'fits':<4} {'GPU/rank':>9} {'host':>8}  {'state':<15}"
    head += f" {'disk GB/step':>12} {'TB/1k steps':>11}" if disk else ""
    print(head + f" {'step s':>7} {'tokens/s':>10} {'FLOP/s/GPU':>12}  {'peak phase':<16} TP plan")
    for i, c in enumerate(cands):
        gpu = f"{c.est.compute_total / GiB:.1f}G" if c.est.compute else "-"
        t = c.time["total"]
        # over the world/(T·C) data-parallel ranks
        tokens = work.tokens_per_step(grad_accum, c.tp, max(1, c.ecfg.context_parallel))
        flops = work.model.flops_per_token() * tokens / work.world  # per GPU
        row = f"{'>' if i == 0 and c.fits else ' '} {'yes' if c.fits else 'no':<4} {gpu:>9} "
        row += f"{c.est.host_total / GiB:7.1f}G  {short(c.formats):<15}"
        if disk:
            w = c.disk_written
            row += f" {w / 1e9:12.1f} {w * 1000 / 1e12:11.1f}" if w else f" {'-':>12} {'-':>11}"
        row += f" {t:7.2f} {tokens / t:10,.0f} {units.flops_rate(flops / t):>12}  {c.est.peak_phase:<16} "
        print(row + f"{c.tp:>2} {c.name}")
    print("  TP: tensor-parallel degree (--tensor-parallel; auto prices every T that divides)")
    print("  state: formats of the master weights / offloaded moments / device moments")
    if disk:
        print("  disk: bytes written to the disk tier per step on this machine (SSD wear)")


def disk_wear(c) -> str | None:
    """The chosen plan's disk writes as a line, or None without a disk tier."""
    if not c.disk_written:
        return None
    return (
        f"disk tier: {c.disk_written / 1e9:.1f} GB written per step on this machine, "
        f"{c.disk_written * 1000 / 1e12:.1f} TB per 1,000 steps (SSD wear: compare the drive's "
        "rated endurance, its TBW)"
    )
