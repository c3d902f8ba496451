"""`fitgpt train`: build a RunConfig from a preset plus flags, and run the training loop."""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import os
import sys
from pathlib import Path

from fitgpt.cli.args import (
    add_config_args,
    add_fraction_flags,
    add_removed_flags,
    blocks_from_fractions,
    config_from_args,
    explicit,
)
from fitgpt.data.config import BUILTIN, DataConfig
from fitgpt.engine.config import EngineConfig, OptimConfig, PrecisionConfig
from fitgpt.errors import UserError
from fitgpt.model import ModelConfig, get_preset
from fitgpt.plan.fixed import Fixed
from fitgpt.train.config import RunConfig, TrainConfig

DEFAULT_PRESET = "tiny"


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
    add_removed_flags(p)


def data_config_from_args(args: argparse.Namespace) -> DataConfig:
    """The data flags, the Python standard library unless --data says otherwise."""
    return config_from_args(
        args, DataConfig, DataConfig(data="stdlib") if args.data is None else None
    )


def run_config_from_args(
    args: argparse.Namespace, model: ModelConfig | None = None, finetune: bool = False
) -> RunConfig:
    """The run a fresh `fitgpt train` asks for: `model` (--init-from: the source's, the model
    flags checked against it) or the preset with the model flags applied, the Python standard
    library as data unless --data says otherwise. `--preset ""` names no preset and is refused
    by get_preset, as any other name it does not know (an empty name is not the default)."""
    data = data_config_from_args(args)
    if model is None:
        preset = DEFAULT_PRESET if args.preset is None else args.preset
        model = config_from_args(args, ModelConfig, get_preset(preset))
    return RunConfig(
        model=model,
        data=data,
        train=train_config_from_args(args, model, finetune),
        engine=config_from_args(args, EngineConfig),
        precision=config_from_args(args, PrecisionConfig),
        optim=config_from_args(args, OptimConfig),
    )


def train_config_from_args(
    args: argparse.Namespace, model: ModelConfig, finetune: bool = False
) -> TrainConfig:
    """The training flags as given: the rates and warm-up the command does not name stay unset,
    for the Trainer to work out with the run's tokens per step (train/schedule.py
    resolve_schedule, the one place these defaults are decided). A --min-lr above the default
    peak is refused here, before anything is built."""
    from fitgpt.train.schedule import peak_lr

    given = explicit(args, TrainConfig)
    lr = peak_lr(model, finetune)
    # with --init-from, init_config checks it again against the source's width, not the preset's
    source_pending = getattr(args, "init_from", None) is not None and not finetune
    if "lr" not in given and given.get("min_lr", 0) > lr and not source_pending:
        what = "fine-tuning" if finetune else f"a model {model.n_embd} wide"
        raise UserError(
            f"--min-lr {given['min_lr']:g} is above the peak learning rate, {lr:g} by default "
            f"for {what}; lower --min-lr or set --lr"
        )
    return TrainConfig(**given, finetune=finetune)


def resolve_command(args: argparse.Namespace):
    """(the run, the checkpoint to resume from, notes to print). The checkpoint is None for a
    new run, "" for a run restarted from its record (train/loop.py: --out's newest, none yet).
    With --resume the checkpoint's (or the record's) config is the base and the flags given
    are checked against it; shares of blocks (--offload-fraction) become block counts once the
    model is known."""
    run, ckpt, notes = _resolve_command(args)
    if args.offload_fraction is not None or args.nvme_fraction is not None:
        blocks_from_fractions(args, run.model.n_layer)
        engine = dataclasses.replace(
            run.engine, offload_blocks=args.offload_blocks, nvme_blocks=args.nvme_blocks
        )
        run = dataclasses.replace(run, engine=engine)
    return run, ckpt, notes


def _resolve_command(args: argparse.Namespace):
    from fitgpt.train import checkpoint as ckpt_io
    from fitgpt.train.resume import (
        PARTS,
        find_checkpoint,
        fit_context_parallel,
        removed_settings,
        resumed_config,
    )
    from fitgpt.train.rundir import read_record

    if args.init_from is not None:
        return init_config(args), None, []
    if args.resume is None:
        return run_config_from_args(args), None, []
    out = args.out or TrainConfig().out
    ckpt = find_checkpoint(args.resume, out)
    if ckpt is None:
        record = read_record(Path(out))  # a run killed before its first checkpoint
        if record is None:  # no run at all: the one these flags ask for
            note = f"--resume: {out} holds no checkpoint yet; starting a new run there"
            return run_config_from_args(args), None, [note]
        return restart_recorded(args, out, record)
    meta = ckpt_io.load_meta(ckpt)
    given = {part: explicit(args, cls) for part, cls in PARTS.items()}
    if args.resume and args.out is None:
        given["train"]["out"] = str(ckpt.parent)  # continue in the run folder of CKPT
    # checked here, before any work; what changed is said once the run is planned (the trainer)
    run, notes = resumed_config(meta, ckpt, given, args.preset)
    world = args.gpus or int(os.environ.get("WORLD_SIZE", 1))  # the launcher's, or a rank's
    typed = "context_parallel" in given["engine"]
    run, fitted = fit_context_parallel(run, world, typed)
    notes = [*notes, *fitted]
    return run, ckpt, [f"resume: {ckpt} with its own config", *notes, *removed_settings(meta, ckpt)]


def restart_recorded(args: argparse.Namespace, out: str, record: dict):
    """`--resume` on a run folder with no checkpoint but a run record (train/rundir.py): the
    run it records, as it was started (its model, data and settings, with its --init-from
    source from step 0, or from the checkpoint it resumed); the flags given again are checked
    against it as a resume checks them against a checkpoint (train/resume.py resumed_config).
    A source that no longer holds the model the run was started from is refused in one line:
    restarting it would train another model."""
    from fitgpt.train import checkpoint as ckpt_io
    from fitgpt.train.resume import PARTS, fit_context_parallel, resumed_config

    where = Path(out) / ckpt_io.RECORD_NAME
    given = {part: explicit(args, cls) for part, cls in PARTS.items()}
    given["train"]["out"] = out
    ckpt, base, what = "", record, "from scratch"  # "": --out's newest, none yet (train/loop.py)
    if record.get("resume_from"):  # its steps must lie past the checkpoint's
        ckpt = ckpt_io.resolve(Path(record["resume_from"]))
        meta = ckpt_io.load_meta(ckpt)
        base = {**record, "step": meta["step"], "trainer": meta.get("trainer", {})}
        what = f"--resume {ckpt}"
    run, notes = resumed_config(base, where, given, args.preset)
    world = args.gpus or int(os.environ.get("WORLD_SIZE", 1))
    run, fitted = fit_context_parallel(run, world, "context_parallel" in given["engine"])
    if record.get("init_from") and not ckpt:
        args.init_source = recorded_source(record["init_from"], run, where)
        what = f"--init-from {record['init_from']}"
    note = f"--resume: {where} records the run ({what}); restarting it as it was started"
    return run, ckpt, [note, *notes, *fitted]


def recorded_source(path: str, run: RunConfig, where: Path):
    """The --init-from source a run record names, holding the model the run was started with."""
    from fitgpt.interop.init_source import find_source
    from fitgpt.train.init_from import free_fields, model_from_source

    source = find_source(path)
    kept = {k: getattr(run.model, k) for k in free_fields(source.model)}  # the run's own
    try:
        same = model_from_source(source, kept, run.data) == run.model
    except UserError:
        same = False
    if not same:
        raise UserError(
            f"--resume: {where} records a run started from {path}, which holds another model "
            "now; put the source back, or start a new run with --init-from and --overwrite"
        )
    return source


def init_config(args: argparse.Namespace):
    """The run `--init-from SRC` asks for: SRC's architecture, everything else from the flags.
    The model flags are checked against the source's model (its family's fields), never
    against the default preset, whose family may lack them."""
    from fitgpt.interop.init_source import find_source
    from fitgpt.train.init_from import model_from_source

    if args.resume is not None:
        raise UserError(
            "--init-from starts a new run from a model's weights, --resume continues a run: "
            "pass one of them"
        )
    data = data_config_from_args(args)  # validated before the source is opened
    args.init_source = find_source(args.init_from)
    asked = explicit(args, ModelConfig)
    if args.preset is not None:  # a preset named counts as its fields given (not its vocabulary)
        given = get_preset(args.preset).to_dict()
        asked = {**{k: v for k, v in given.items() if k != "vocab_size"}, **asked}
    model = model_from_source(args.init_source, asked, data)
    return run_config_from_args(args, model, finetune=True)  # fine-tuning's defaults


def check_out_apart(args: argparse.Namespace, run: RunConfig, ckpt) -> None:
    """Refuse an --out that is, lies inside or holds the model the run starts from (the
    --init-from source, and the models that one came from), before any work: the run would
    write its files among the user's model files, and --overwrite delete them. With
    --overwrite, the data and the tokenizer folder are kept apart too (it empties --out)."""
    from fitgpt.data.indexed import paths as pair_paths
    from fitgpt.paths import check_apart
    from fitgpt.train import checkpoint as ckpt_io

    what = "the model --init-from reads"
    source = getattr(args, "init_source", None)
    kept = []
    if source is not None:
        typed = getattr(args, "init_from", None)
        kept = [(what, p) for p in dict.fromkeys([typed, str(source.path)]) if p]
        if source.weights is None:  # a fitgpt checkpoint: the models it came from
            kept += [
                (f"a model {source.path} came from", p)
                for p in ckpt_io.sources(ckpt_io.load_meta(source.path))
            ]
    if ckpt:
        kept += [(f"a model {ckpt} came from", p) for p in ckpt_io.sources(ckpt_io.load_meta(ckpt))]
    if args.overwrite:
        if run.data.data not in BUILTIN:
            kept += [("the data --data reads", p) for p in pair_paths(run.data.data)]
        tok = run.data.tokenizer
        if tok not in ("auto", "none", "bytes", "gpt2") and os.path.isdir(tok):
            kept.append(("the tokenizer folder --tokenizer reads", tok))
    why = "the run would write there, and --overwrite delete what is there"
    check_apart("--out", run.train.out, kept, why)


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
        "Face folder (config.json + weights: GPT-2, Llama, Qwen2, Qwen3, Mistral; read in place, "
        "no copy written); its architecture, this command's data and settings, a fresh "
        "optimizer (docs/interop.md)",
    )
    p.add_argument(
        "--overwrite", action="store_true", help="delete --out's checkpoints and start over"
    )
    p.add_argument(
        "--gpus", type=int, default=None, help="start torchrun with N processes on this machine"
    )
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
        "--deepspeed-config",
        default=None,
        metavar="FILE.json",
        help="take batch, precision, ZeRO, offload, optimizer and schedule settings from a "
        "DeepSpeed config; flags you type win; every key not honoured is named "
        "(docs/interop.md)",
    )
    p.set_defaults(func=run)


def apply_deepspeed_flags(args: argparse.Namespace) -> None:
    """Set the flags a DeepSpeed config maps to, as if typed, unless typed already; print what
    it set and a line per other key, and keep the same lines for the run folder
    (deepspeed_notes.txt, written by the trainer once the run has started)."""
    from fitgpt.interop.deepspeed import NOTES_FILE, apply_deepspeed_config

    parts = {"train": TrainConfig, "engine": EngineConfig, "precision": PrecisionConfig}
    parts["optim"] = OptimConfig
    typed = {part: explicit(args, cls) for part, cls in parts.items()}
    changes, notes = apply_deepspeed_config(args.deepspeed_config, typed)
    for values in changes.values():
        for name, value in values.items():
            setattr(args, name, value)  # the flags' dest is the field name
    said = " ".join(
        f"--{n.replace('_', '-')} {v}" for vals in changes.values() for n, v in vals.items()
    )
    lines = [
        f"--deepspeed-config {args.deepspeed_config}: {x}" for x in [said or "sets no flag", *notes]
    ]
    args.run_files = {
        **(getattr(args, "run_files", None) or {}),
        NOTES_FILE: "\n".join(lines) + "\n",
    }
    if os.environ.get("RANK", "0") == "0":
        for line in lines:
            print(line, flush=True)


def check_settings(args: argparse.Namespace, run_cfg: RunConfig, world: int, typed: dict) -> None:
    """Refuse, in one line, what train cannot run on `world` ranks or a typed flag that would
    change nothing (`typed`: the engine and precision flags on the command line), before
    torchrun starts and before anything is allocated: plan/validate.py, the validation plan,
    capacity and bench share. With --plan auto the engine fields not set are the planner's."""
    from fitgpt.plan import validate

    m, e, p, device = run_cfg.model, run_cfg.engine, run_cfg.precision, run_cfg.train.device
    validate.check_settings(m, e, p, world, device, planner_fixed(args), typed)


def planner_fixed(args: argparse.Namespace) -> Fixed | None:
    """The engine fields typed with --plan auto (the planner chooses the rest); None with
    --plan off (the engine config is used as given)."""
    return Fixed.of(explicit(args, EngineConfig)) if args.plan == "auto" else None


def run(args: argparse.Namespace) -> int:
    cpu_mem = 0  # --cpu-mem in bytes (parse_bytes refuses a size under one byte); 0: measured
    if args.cpu_mem is not None:
        from fitgpt.plan.hardware import parse_bytes

        cpu_mem = parse_bytes(args.cpu_mem, "--cpu-mem")
    from fitgpt.plan.validate import typed_flags

    # the flags typed, before a DeepSpeed config adds its keys as if typed (its keys are
    # judged by its own notes, not as flags that would change nothing)
    typed = typed_flags(args)
    if args.gpus is not None:
        if args.gpus < 1:
            raise UserError(f"--gpus {args.gpus} must be at least 1")
        from fitgpt.dist.launch import relaunch, strip_flag

        if not args.deepspeed_config:  # what the job cannot run: refused here, in one line,
            run_cfg, ckpt, _ = resolve_command(args)  # before torchrun
            check_settings(args, run_cfg, args.gpus, typed)
            check_out_apart(args, run_cfg, ckpt)
        argv = strip_flag(sys.argv[1:], "--gpus")
        return relaunch(args.gpus, argv)
    if args.deepspeed_config:
        apply_deepspeed_flags(args)
    run_cfg, ckpt, notes = resolve_command(args)  # validates every config before allocating
    # what this machine gives, for the planner and every rank's engine (each rank parses the
    # flag itself); never a resumed run's saved figure
    engine = dataclasses.replace(run_cfg.engine, cpu_mem=cpu_mem)
    run_cfg = dataclasses.replace(run_cfg, engine=engine)
    check_settings(args, run_cfg, int(os.environ.get("WORLD_SIZE", 1)), typed)
    from fitgpt.paths import check_writable_dir

    check_out_apart(args, run_cfg, ckpt)
    check_writable_dir(run_cfg.train.out, "--out")
    from fitgpt.dist import init_distributed, shutdown
    from fitgpt.dist.env import configure_process
    from fitgpt.train.loop import train
    from fitgpt.train.setup import setup_run

    # before CUDA, NCCL and the first CPU kernel
    configure_process(run_cfg.train.cpu_threads, run_cfg.train.device)
    ctx = init_distributed(run_cfg.train.device, run_cfg.train.dist_timeout)
    try:

        def log(msg: str) -> None:
            if ctx.is_main:
                print(msg, flush=True)

        for note in notes:
            log(note)
        run_cfg = setup_run(run_cfg, ctx, planner_fixed(args), args.force, log)
        resume = None if ckpt is None else str(ckpt)
        init = getattr(args, "init_source", None)
        files = getattr(args, "run_files", None)  # set by apply_deepspeed_flags
        train(
            run_cfg, ctx, resume=resume, overwrite=args.overwrite, init_from=init, run_files=files
        )
    except UserError as e:
        if not ctx.distributed:
            raise
        if not e.agreed:
            lone_failure(ctx, e)
        if ctx.is_main or not e.identical:  # the same line on every rank: printed once
            print(f"fitgpt train: error: {e}", file=sys.stderr, flush=True)
        with contextlib.suppress(Exception):  # every line is out before any rank exits
            ctx.barrier()
        sys.exit(2)
    except Exception as e:
        from fitgpt.engine.comm import CollectiveError

        if ctx.distributed and not isinstance(e, CollectiveError):
            lone_failure(ctx, e)
        raise
    finally:
        shutdown(ctx)
    return 0


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
        print(f"fitgpt train: error on {where}: {e}", file=sys.stderr, flush=True)
        hard_exit(2)
    traceback.print_exc()
    print(f"fitgpt train: {where} failed alone ({type(e).__name__}); the job ends", file=sys.stderr)
    hard_exit(1)
