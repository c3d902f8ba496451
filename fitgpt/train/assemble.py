"""The run, assembled once: settings in, one typed, resolved, validated `Run` out.

torchtitan's Trainer.__init__ and picotron's train.py build a run in one ordered pass that every
later part takes as given; this is fitgpt's, for `fitgpt train` (cli/train.py), the benchmark
harness (bench/systems.py) and a script or test that trains a RunConfig:

    Settings   the configs as asked (for the command line: a preset with the flags, an
               --init-from source, or a resumed run), how they are placed (the planner, or as
               given) and where the run starts
    settle     the model sized for its data (the tokenizer's vocabulary) and the precision for
               the device, then the one validation of the settings for the job's ranks
               (plan/validate.py check_settings); with --gpus the launcher settles, before
               torchrun, and hands its ranks the settled settings
    assemble   on every rank: the placement (the planner's plan, or the engine config as given)
               with its --compile scope, then the mesh (the TP × DP and CP groups, dist/mesh.py),
               then the rates and warm-up the command left unset (train/schedule.py: the
               warm-up counts tokens, which count the mesh's data-parallel ranks)
    Run        the config the engines build, the context laid out for it, where the run starts

The Trainer and the engines take a Run as given: nothing after it sizes the vocabulary, resolves
the precision, --compile or the schedule, validates a setting or lays the ranks out again.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from fitgpt.dist import DistContext
from fitgpt.dist.nodes import node_shape
from fitgpt.errors import UserError
from fitgpt.plan.adapter import adapter_placement, place_base
from fitgpt.plan.apply import plan_engine
from fitgpt.plan.fixed import Fixed
from fitgpt.plan.memory import tokens_per_step
from fitgpt.plan.validate import check_settings
from fitgpt.train.config import RunConfig
from fitgpt.train.init_from import InitSource
from fitgpt.train.schedule import resolve_schedule
from fitgpt.train.setup import resolve_run, unplanned_compile


@dataclass(frozen=True)
class Settings:
    """A run as asked for. `settled`: the (ranks, device type) that `settle` resolved and
    validated it for; None until then."""

    config: RunConfig  # as asked: the vocabulary, precision, placement and --compile still open
    fixed: Fixed | None = None  # --plan auto: the engine fields set; None: --plan off, as given
    force: bool = False  # train even where the planner predicts the run will not fit
    # the engine and precision flags typed (plan/validate.py no_effect judges them)
    typed: Mapping[str, Any] = field(default_factory=dict)
    resume: str | None = None  # a checkpoint; "": --out's newest; None: a new run
    init_from: InitSource | None = None  # the weights a new run starts from
    overwrite: bool = False  # --out's checkpoints are deleted
    files: Mapping[str, str] = field(default_factory=dict)  # name -> text, for the run folder
    notes: tuple[str, ...] = ()  # said once the ranks have joined (rank 0)
    settled: tuple[int, str] | None = None

    def to_dict(self) -> dict:
        """These settings as JSON values: how a launcher hands them to its ranks
        (cli/train.py), the --init-from source by its path."""
        return {
            "config": self.config.to_dict(),
            "fixed": None if self.fixed is None else self.fixed.as_dict(),
            "force": self.force,
            "typed": dict(self.typed),
            "resume": self.resume,
            "init_from": None if self.init_from is None else str(self.init_from.path),
            "overwrite": self.overwrite,
            "files": dict(self.files),
            "notes": list(self.notes),
            "settled": self.settled,
        }

    @classmethod
    def from_dict(cls, d: dict, init_from: InitSource | None) -> Settings:
        """The settings `to_dict` wrote, with the --init-from source it names found again."""
        return cls(
            config=RunConfig.from_dict(d["config"]),
            fixed=None if d["fixed"] is None else Fixed.of(d["fixed"]),
            force=d["force"],
            typed=d["typed"],
            resume=d["resume"],
            init_from=init_from,
            overwrite=d["overwrite"],
            files=d["files"],
            notes=tuple(d["notes"]),
            settled=None if d["settled"] is None else tuple(d["settled"]),
        )


@dataclass(frozen=True)
class Run:
    """A run as it is built: the Trainer and the engines take every part of it as given."""

    config: RunConfig  # the vocabulary, precision, placement and --compile settled
    ctx: DistContext  # laid out for config.engine: its TP × DP mesh and CP groups
    resume: str | None = None
    init_from: InitSource | None = None
    overwrite: bool = False
    files: Mapping[str, str] = field(default_factory=dict)
    # which schedule defaults a new run took, said at its step 0 (a resumed run took its own)
    schedule_line: str | None = None


def settle(settings: Settings, world: int, device: str) -> Settings:
    """`settings` for a job of `world` ranks on `device` ("cuda" or "cpu"): the model sized for
    its data and the precision resolved (train/setup.py resolve_run), then validated, once
    (plan/validate.py check_settings: a refusal is one line, before anything is allocated)."""
    config = resolve_run(settings.config, device)
    # LoRA: the ddp engine, unplanned, or one line refusing what needs another (plan/adapter.py)
    has_base = settings.init_from is not None
    config, fixed, notes = adapter_placement(config, settings.fixed, settings.typed, has_base)
    m, e, p = config.model, config.engine, config.precision
    typed = settings.typed
    if config.adapter.active:  # --nvme-path holds a LoRA base's disk blocks (plan/adapter.py)
        typed = {k: v for k, v in typed.items() if k != "nvme_path"}
    check_settings(m, e, p, world, device, fixed, typed)
    notes = (*settings.notes, *(n for n in notes if n not in settings.notes))
    return dataclasses.replace(
        settings, config=config, fixed=fixed, notes=notes, settled=(world, device)
    )


def assemble(settings: Settings, ctx: DistContext, log=print) -> Run:
    """The Run `settings` make on `ctx`'s ranks, in order: settled (unless they are, for these
    ranks), their notes said (`log`: rank 0's), placed (`placed`), the ranks laid out for the
    placement (the planner may choose T), and the schedule's defaults worked out for the tokens
    a step takes on those ranks (train/schedule.py resolve_schedule, the one place they are
    decided)."""
    device = ctx.device.type
    if settings.settled != (ctx.world, device):
        settings = settle(settings, ctx.world, device)
    for note in settings.notes:
        log(note)
    config = placed(settings, ctx, log)
    check_node_local(config, ctx)
    e = config.engine
    ctx = ctx.laid_out(e.tensor_parallel, e.context_parallel, e.expert_parallel)
    t = config.train
    tokens = tokens_per_step(t.micro_batch, t.grad_accum, config.model.seq_len, ctx.data_world)
    adapters = config.adapter.active  # LoRA's rates (train/schedule.py LORA_LR)
    train, line, warning = resolve_schedule(t, config.model, tokens, config.optim.beta2, adapters)
    if warning:
        log(warning)
    config = dataclasses.replace(config, train=train)
    s = settings
    return Run(config, ctx, s.resume, s.init_from, s.overwrite, s.files, schedule_line=line)


def check_node_local(config: RunConfig, ctx: DistContext) -> None:
    """--node-local-checkpoints on several machines needs every rank to write, and on a resume
    read, its own shard alone (ZeRO stages 1-3 on the whole world, one model copy): otherwise a
    machine would read files that only another machine holds. Refused in one line, on every
    rank alike (the placement is the same on every rank)."""
    e = config.engine
    own = (
        e.engine == "zero" and e.zero_stage >= 1 and e.tensor_parallel == 1
        and e.expert_parallel == 1 and e.shard_within == "world" and not config.adapter.active
    )  # fmt: skip
    if not config.train.node_local_checkpoints or own or node_shape(ctx.world)[1] == 1:
        return
    err = UserError(
        "--node-local-checkpoints needs each rank to save its own shard: --engine zero "
        f"--zero-stage 1-3 without --tensor-parallel, --expert-parallel, --shard-within node "
        f"or LoRA (this run: --engine {e.engine} --zero-stage {e.zero_stage}, --tensor-parallel "
        f"{e.tensor_parallel}, --shard-within {e.shard_within}); pin those, or put --out on a "
        "shared disk and drop the flag"
    )
    err.agreed = err.identical = ctx.distributed
    raise err


def placed(settings: Settings, ctx: DistContext, log=print) -> RunConfig:
    """The settled config with its placement: the planner's plan, which settles --compile with
    it (plan/apply.py plan_engine: rank 0 decides for every rank), or under --plan off the
    engine config as given, its --compile settled by the planner's rule
    (train/setup.py unplanned_compile)."""
    config = settings.config
    if settings.fixed is not None:
        return plan_engine(config, ctx, settings.fixed, settings.force, log)
    if config.adapter.active:  # the frozen base placed, priced, refused if it does not fit
        config = place_base(config, ctx, log)
    scope = unplanned_compile(config, ctx.device.type, ctx.world)
    return dataclasses.replace(config, engine=dataclasses.replace(config.engine, compile=scope))
