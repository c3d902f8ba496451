"""`fitgpt train`: the command line read once into a Request (plain values: the fields given,
what the command names), worked out into the run's settings and settled once for the job's
ranks on the train floor (train/request.py; before torchrun with --gpus), then on every rank the
run assembled from them (train/assemble.py) and trained (train/loop.py)."""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import math
import os
import sys
from typing import TYPE_CHECKING

from fitgpt.adapters.config import AdapterConfig
from fitgpt.cli.args import (
    LAUNCH_FLAGS,
    add_config_args,
    add_fraction_flags,
    add_node_args,
    add_removed_flags,
    explicit,
    typed_flags,
)
from fitgpt.data.config import DataConfig
from fitgpt.engine.config import EngineConfig, OptimConfig, PrecisionConfig
from fitgpt.errors import UserError, print_line
from fitgpt.model import ModelConfig, get_preset
from fitgpt.train.config import PARTS, TrainConfig
from fitgpt.train.request import DEFAULT_PRESET, Request

if TYPE_CHECKING:
    from fitgpt.train.assemble import Settings


def add_run_args(p: argparse.ArgumentParser) -> None:
    """The flags of a `fitgpt train` run: the preset, then every field of the run's configs."""
    p.add_argument(
        "--preset",
        default=None,
        help="named model config (see `fitgpt presets`); "
        f"the model flags below override its fields (default: {DEFAULT_PRESET})",
    )
    add_config_args(
        p.add_argument_group("model"),
        ModelConfig,
        defaults=get_preset("tiny"),
        default_text="from --preset; tiny: {}",
    )
    add_config_args(p.add_argument_group("data"), DataConfig, defaults=DataConfig(data="stdlib"))
    add_config_args(p.add_argument_group("training"), TrainConfig)
    add_config_args(
        p.add_argument_group(
            "engine and memory (with --plan auto, the planner chooses what you do not set)"
        ),
        EngineConfig,
        planned_text="the planner's choice; with --plan off: {}",
    )
    add_fraction_flags(p)
    add_config_args(p.add_argument_group("precision"), PrecisionConfig)
    add_config_args(p.add_argument_group("optimizer"), OptimConfig)
    add_config_args(p.add_argument_group("LoRA adapters (docs/adapters.md)"), AdapterConfig)
    add_removed_flags(p)


def flags_given(args: argparse.Namespace) -> dict[str, dict]:
    """The fields of each part of the run's config given on the command line: the command line
    read once (cli/args.py explicit)."""
    return {part: explicit(args, cls) for part, cls in PARTS.items()}


def request_of(args: argparse.Namespace) -> Request:
    """The command line, read once into plain values (train/request.py Request): the fields
    given per config part, a DeepSpeed config's keys among them as if typed (its own keys are
    judged by its notes, not as flags that would change nothing), and what else it names."""
    from fitgpt.plan.hardware import parse_bytes
    from fitgpt.plan.links import stated_link

    # --cpu-mem, --gpu-mem in bytes (parse_bytes refuses a size under one byte); 0: measured
    cpu_mem, gpu_mem = (
        parse_bytes(v, flag) if v is not None else 0
        for v, flag in (
            (getattr(args, "cpu_mem", None), "--cpu-mem"),
            (getattr(args, "gpu_mem", None), "--gpu-mem"),
        )
    )
    link = stated_link(getattr(args, "inter_node_gbps", None))
    typed = typed_flags(args)  # before a DeepSpeed config adds its keys
    given = flags_given(args)
    files = {}
    if getattr(args, "deepspeed_config", None):
        given, files = deepspeed_given(args.deepspeed_config, given)
    return Request(
        given=given,
        typed=typed,
        preset=args.preset,
        init_from=getattr(args, "init_from", None),
        resume=getattr(args, "resume", None),
        offload_fraction=args.offload_fraction,
        nvme_fraction=args.nvme_fraction,
        cpu_mem=cpu_mem,
        gpu_mem=gpu_mem,
        inter_node_gbps=link or 0.0,
        plan=getattr(args, "plan", "auto") == "auto",
        force=getattr(args, "force", False),
        overwrite=getattr(args, "overwrite", False),
        files=files,
    )


def asked_by(args: argparse.Namespace, world: int = 1) -> Settings:
    """The run this command line asks for on `world` ranks, nothing settled, validated or
    allocated (train/request.py asked)."""
    from fitgpt.interop.init_source import find_source
    from fitgpt.train.request import asked

    req = request_of(args)
    return asked(req, world, find_source)


def settled_by(args: argparse.Namespace, world: int) -> Settings:
    """The settings this command line asks for, settled for `world` ranks and --out checked
    (train/request.py settled): what the job cannot run is refused in one line, before torchrun
    starts (--gpus) and before anything is allocated."""
    from fitgpt.interop.init_source import find_source
    from fitgpt.train.request import settled

    req = request_of(args)
    return settled(req, world, find_source)


def register(sub) -> None:
    p = sub.add_parser(
        "train",
        help="train a GPT model",
        description="Train a GPT model. With no flags: the tiny preset on the Python standard "
        "library's source, on the GPU if there is one. Runs under torchrun for several GPUs or "
        "machines; --gpus N starts torchrun on this machine.",
    )
    add_run_args(p)
    p.add_argument(
        "--resume",
        nargs="?",
        const="",
        default=None,
        metavar="CKPT",
        help="continue from a checkpoint folder, or (no value) from the newest in --out",
    )
    p.add_argument(
        "--init-from",
        default=None,
        metavar="SRC",
        help="start a new run from the weights of SRC: a fitgpt run or checkpoint, or a Hugging "
        "Face folder (config.json + weights of a family `fitgpt presets` lists: GPT-2, Llama, "
        "Qwen2, Qwen3, Mistral, Qwen3-MoE, Mixtral; read in place, no copy written); its "
        "architecture, this command's data and settings, a fresh optimizer (docs/interop.md)",
    )
    p.add_argument(
        "--overwrite",
        action="store_true",
        help="delete everything in --out (a run folder: a folder of other files is refused) and "
        "start over",
    )
    p.add_argument(
        "--gpus", type=int, default=None, help="start torchrun with N processes on this machine"
    )
    add_node_args(p, "run")
    p.add_argument(
        "--plan",
        choices=["auto", "off"],
        default="auto",
        help="auto: the planner chooses the engine fields you did not set, and refuses a run "
        "predicted not to fit before allocating anything; off: use the flags as given "
        "(default: auto)",
    )
    p.add_argument(
        "--force", action="store_true", help="train even if the planner predicts it will not fit"
    )
    p.add_argument(
        "--cpu-mem",
        default=None,
        help="host RAM the run may fill, e.g. 240GB (default: what the kernel reports available, "
        "less a 5%% reserve); for machines that report less RAM than they give",
    )
    p.add_argument(
        "--gpu-mem",
        default=None,
        help="memory of each GPU the run may fill, e.g. 80GB (default: the whole GPU): the "
        "planner plans for it and torch's allocator is capped at it, for a shared GPU",
    )
    p.add_argument(
        "--deepspeed-config",
        default=None,
        metavar="FILE.json",
        help="take batch, precision, ZeRO, offload, optimizer and schedule settings from a "
        "DeepSpeed config; flags you type win; every key not honoured is named "
        "(docs/interop.md)",
    )
    p.set_defaults(func=run)


def deepspeed_given(path: str, given: dict[str, dict]) -> tuple[dict[str, dict], dict[str, str]]:
    """`given` with the fields a DeepSpeed config maps to, as if typed, where not typed already;
    prints what it set and a line per other key, and returns the same lines as a file for the
    run folder (deepspeed_notes.txt, written by the trainer once the run has started)."""
    from fitgpt.interop.deepspeed import NOTES_FILE, apply_deepspeed_config

    parts = ("train", "engine", "precision", "optim")
    changes, notes = apply_deepspeed_config(path, {part: given[part] for part in parts})
    given = {part: {**fields, **changes.get(part, {})} for part, fields in given.items()}
    said = " ".join(
        f"--{n.replace('_', '-')} {v}" for vals in changes.values() for n, v in vals.items()
    )
    lines = [f"--deepspeed-config {path}: {x}" for x in [said or "sets no flag", *notes]]
    if os.environ.get("RANK", "0") == "0":
        for line in lines:
            print(line, flush=True)
    return given, {NOTES_FILE: "\n".join(lines) + "\n"}


# the settings a --gpus launcher settled, as JSON in its ranks' environment
HANDED = "FITGPT_SETTLED"


def handed_over() -> Settings | None:
    """The settings this rank's --gpus launcher settled (its --init-from source found again,
    in this process), or None: a process that no fitgpt launcher started settles its own."""
    from fitgpt.dist.context import under_torchrun

    text = os.environ.get(HANDED)
    if text is None or not under_torchrun():
        return None
    from fitgpt.interop.init_source import find_source
    from fitgpt.train.assemble import Settings

    d = json.loads(text)
    source = None if d["init_from"] is None else find_source(d["init_from"])
    return Settings.from_dict(d, source)


def run(args: argparse.Namespace) -> int:
    """`fitgpt train`: the settings settled once, for the job's ranks: here, or with --gpus N
    before torchrun starts, which hands them to its N ranks (HANDED); then, on every rank, the
    run assembled from them (train/assemble.py) and trained (train/loop.py). A stop before the
    first step ends it at once, in one line (stopped_in_startup)."""
    from fitgpt.train.guard import StartupStop, startup_stops

    try:
        with startup_stops():
            return settle_and_run(args)
    except StartupStop as e:
        return stopped_in_startup(e)


def stopped_in_startup(e) -> int:
    """The one line of a run stopped before its first step (train/guard.py StartupStop), and
    its exit status. One process says it for the job: the `--gpus` launcher (relaunch's
    startup_stop; its ranks say nothing), else rank 0 of a job a user's torchrun started (its
    ranks stopped together: torchrun hands a stop to each)."""
    from fitgpt.procs import launcher_speaks

    if not launcher_speaks() and os.environ.get("RANK", "0") == "0":
        print_line(f"fitgpt train: {e}")
    return e.code


def startup_stop(signum: int) -> None:
    """The launcher's part (dist/launch.py relaunch): its job was stopped in start-up."""
    from fitgpt.train.guard import StartupStop

    raise StartupStop(signum)


def settle_and_run(args: argparse.Namespace) -> int:
    settings = handed_over()
    if settings is None:
        from fitgpt.dist.nodes import Nodes

        if args.gpus is not None and args.gpus < 1:
            raise UserError(f"--gpus {args.gpus} must be at least 1")
        nodes = Nodes.of(args, args.gpus)  # before settling: a bad node flag costs nothing
        world = args.gpus * nodes.nnodes if args.gpus else int(os.environ.get("WORLD_SIZE", 1))
        settings = settled_by(args, world)
    if args.gpus is not None:
        from fitgpt.dist.launch import SHUTDOWN_ENV, relaunch, strip_flag

        argv = sys.argv[1:]
        for flag in LAUNCH_FLAGS:  # torchrun's, not the ranks'
            argv = strip_flag(argv, flag)
        env = {HANDED: json.dumps(settings.to_dict())}
        dist_timeout = settings.config.train.dist_timeout
        # After a stop torch's agent SIGKILLs the ranks still running 30 s on: a longer save of
        # the stopped step was lost without a line, leaving the run at its previous checkpoint.
        # The ranks get --dist-timeout, the time a save's collectives may take (600 s by
        # default); they exit once saved, and a second stop still ends them at once. The user's
        # own value wins; an older torch reads none and keeps 30 s.
        if SHUTDOWN_ENV not in os.environ:
            env[SHUTDOWN_ENV] = str(max(30, math.ceil(dist_timeout)))
        nodes = dataclasses.replace(nodes, timeout_s=dist_timeout)
        return relaunch(args.gpus, argv, env=env, nodes=nodes, startup_stop=startup_stop)
    from fitgpt.dist import init_distributed, shutdown
    from fitgpt.dist.env import configure_process
    from fitgpt.dist.nodes import check_same
    from fitgpt.train.assemble import assemble
    from fitgpt.train.loop import train

    t = settings.config.train
    die_with_agent()
    configure_process(t.cpu_threads, t.device)  # before CUDA, NCCL and the first CPU kernel
    ctx = init_distributed(t.device, t.dist_timeout)
    try:

        def log(msg: str) -> None:
            if ctx.is_main:
                print(msg, flush=True)

        check_same(ctx, compared(settings))  # every node settled the same run
        train(assemble(settings, ctx, log))
    except UserError as e:
        if not ctx.distributed:
            raise
        if not e.agreed:
            lone_failure(ctx, e)
        if ctx.is_main or not e.identical:  # the same line on every rank: printed once
            print_line(f"fitgpt train: error: {e}")
        with contextlib.suppress(Exception):  # every line is out before any rank exits
            ctx.barrier()
        sys.exit(2)
    except KeyboardInterrupt as e:
        from fitgpt.train.guard import Interrupted

        if not (ctx.distributed and isinstance(e, Interrupted)):
            raise
        # every rank stopped at the same agreed step, and rank 0's line names the save: it is
        # the job's one line (each rank printed its own before; the others wait for it to go out)
        if ctx.is_main:
            print_line(f"fitgpt train: {e}")
        with contextlib.suppress(Exception):
            ctx.barrier()
        sys.exit(130)
    except Exception as e:
        from fitgpt.engine.comm import CollectiveError

        if ctx.distributed and not isinstance(e, CollectiveError):
            lone_failure(ctx, e)
        raise
    finally:
        shutdown(ctx)
    return 0


def die_with_agent() -> None:
    """A rank of fitgpt's torchrun (dist/torchrun.py) ends when its agent does, even by SIGKILL.
    A stop that reached the agent while torch was starting the ranks ended it before it knew
    them: they were never told, and sat in the rendezvous for --dist-timeout (600 s) trying to
    reach the agent's store, where no signal reaches Python (1 stop in about 40 at random times)."""
    import signal

    from fitgpt.dist.launch import AGENT_ENV
    from fitgpt.procs import die_with_parent

    agent = os.environ.get(AGENT_ENV)
    if agent:
        die_with_parent(int(agent), signal.SIGKILL)


def compared(settings) -> dict:
    """What every node must have settled alike: all of `settings`, but with node-local
    checkpoints each machine's own --out (its own disk; a path of its own on a shared host),
    the notes that name it, and of the checkpoint resumed its step folder's name alone."""
    d = settings.to_dict()
    if settings.config.train.node_local_checkpoints:
        d["config"]["train"].pop("out")
        d.pop("notes")
        d["resume"] = d["resume"] and os.path.basename(os.path.normpath(d["resume"]))
    return d


def lone_failure(ctx, e: BaseException) -> None:
    """One rank of a job failed where the others did not: say so now, naming the rank, and end
    this process without tearing the job's group down. destroy_process_group waits for the
    peers, which sit in a collective this rank will never join, so the cause used to be printed
    only after --dist-timeout, or never (37 B on 2x H100, 2026-11-26: 8 minutes silent). Exiting
    lets torchrun end the others at once; what the exit skips is the group's orderly teardown."""
    import traceback

    from fitgpt.dist.context import hard_exit

    where = f"rank {ctx.rank} of {ctx.world}"
    if isinstance(e, UserError):
        print_line(f"fitgpt train: error on {where}: {e}")
        hard_exit(2)
    traceback.print_exc()
    print_line(f"fitgpt train: {where} failed alone ({type(e).__name__}); the job ends")
    hard_exit(1)
