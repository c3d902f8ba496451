"""`fitgpt train`: the command line read once into the run's settings (a preset plus flags, an
--init-from source or a resumed run), settled once for the job's ranks (before torchrun with
--gpus), then on every rank the run assembled from them (train/assemble.py) and trained."""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from fitgpt.adapters.config import AdapterConfig, adapter_config
from fitgpt.cli.args import (
    add_config_args,
    add_fraction_flags,
    add_removed_flags,
    blocks_from_fractions,
    explicit,
    typed_flags,
)
from fitgpt.data.config import BUILTIN, DataConfig
from fitgpt.engine.config import EngineConfig, OptimConfig, PrecisionConfig
from fitgpt.errors import UserError
from fitgpt.model import ModelConfig, get_preset
from fitgpt.plan.fixed import Fixed
from fitgpt.train.config import PARTS, RunConfig, TrainConfig

if TYPE_CHECKING:
    from fitgpt.train.assemble import Settings

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
    add_config_args(p.add_argument_group("LoRA adapters (docs/adapters.md)"), AdapterConfig)
    add_removed_flags(p)


def flags_given(args: argparse.Namespace) -> dict[str, dict]:
    """The fields of each part of the run's config given on the command line: the command line
    read once (cli/args.py explicit)."""
    return {part: explicit(args, cls) for part, cls in PARTS.items()}


def with_block_counts(args: argparse.Namespace, given: dict[str, dict], run: RunConfig):
    """(`given`, `run`) with the shares of blocks given (--offload-fraction, --nvme-fraction)
    as the block counts they ask for, once the model's layers are known (cli/args.py
    blocks_from_fractions): the planner keeps them as if typed."""
    counts = blocks_from_fractions(args, run.model.n_layer, given["engine"])
    if counts is None:
        return given, run
    typed = {k: v for k, v in counts.items() if v is not None}
    given = {**given, "engine": {**given["engine"], **typed}}
    return given, dataclasses.replace(run, engine=dataclasses.replace(run.engine, **counts))


def data_config(given: dict[str, dict]) -> DataConfig:
    """The data flags, the Python standard library unless --data says otherwise."""
    return DataConfig(**{"data": "stdlib", **given["data"]})


def run_config_from_args(
    args: argparse.Namespace,
    given: dict[str, dict],
    model: ModelConfig | None = None,
    finetune: bool = False,
) -> RunConfig:
    """The run a fresh `fitgpt train` asks for (`given`: the flags, per config part): `model`
    (--init-from: the source's, the model flags checked against it) or the preset with the model
    flags applied, the Python standard library as data unless --data says otherwise.
    `--preset ""` names no preset and is refused by get_preset, as any other name it does not
    know (an empty name is not the default)."""
    data = data_config(given)
    if model is None:
        preset = DEFAULT_PRESET if args.preset is None else args.preset
        model = dataclasses.replace(get_preset(preset), **given["model"])
    return RunConfig(
        model=model,
        data=data,
        train=train_config(given["train"], model, finetune),
        engine=EngineConfig(**given["engine"]),
        precision=PrecisionConfig(**given["precision"]),
        optim=OptimConfig(**given["optim"]),
        adapter=adapter_config(given["adapter"]),  # --lora-from: its folder's adapter
    )


def train_config(given: dict, model: ModelConfig, finetune: bool = False) -> TrainConfig:
    """The training flags as given: the rates and warm-up the command does not name stay unset,
    for the Trainer to work out with the run's tokens per step (train/schedule.py
    resolve_schedule, the one place these defaults are decided). A --min-lr above the default
    peak is refused here, before anything is built."""
    from fitgpt.train.schedule import peak_lr

    lr = peak_lr(model, finetune)
    if "lr" not in given and given.get("min_lr", 0) > lr:
        what = "fine-tuning" if finetune else f"a model {model.n_embd} wide"
        raise UserError(
            f"--min-lr {given['min_lr']:g} is above the peak learning rate, {lr:g} by default "
            f"for {what}; lower --min-lr or set --lr"
        )
    return TrainConfig(**given, finetune=finetune)


def asked(args: argparse.Namespace, world: int = 1) -> Settings:
    """The run this command line asks for on `world` ranks (train/assemble.py Settings). The
    command line is read once, into the fields given per config part, a DeepSpeed config's keys
    among them as if typed; then the run's configs (`configs`: a preset with the flags, the
    --init-from source's model, or the resumed run's config), the machine's RAM as stated, the
    engine fields the planner keeps, and where the run starts. What the command names is read
    (a checkpoint's meta.json, a run record, a source's config); nothing is settled, validated
    or allocated."""
    from fitgpt.train.assemble import Settings

    cpu_mem = 0  # --cpu-mem in bytes (parse_bytes refuses a size under one byte); 0: measured
    if args.cpu_mem is not None:
        from fitgpt.plan.hardware import parse_bytes

        cpu_mem = parse_bytes(args.cpu_mem, "--cpu-mem")
    # the flags typed, before a DeepSpeed config adds its keys as if typed (its keys are
    # judged by its own notes, not as flags that would change nothing)
    typed = typed_flags(args)
    given = flags_given(args)
    files = {}
    if args.deepspeed_config:
        given, files = deepspeed_given(args.deepspeed_config, given)
    run, ckpt, source, notes = configs(args, given, world)
    given, run = with_block_counts(args, given, run)
    # what this machine gives, for the planner and every rank's engine; never a resumed run's
    # saved figure
    run = dataclasses.replace(run, engine=dataclasses.replace(run.engine, cpu_mem=cpu_mem))
    # --plan auto: the engine fields given are kept, the planner chooses the rest; off: as given
    fixed = Fixed.of(given["engine"]) if args.plan == "auto" else None
    start = {"resume": None if ckpt is None else str(ckpt), "init_from": source}
    notes = tuple(notes)
    return Settings(
        run, fixed, args.force, typed, **start, overwrite=args.overwrite, files=files, notes=notes
    )


def configs(args: argparse.Namespace, given: dict[str, dict], world: int):
    """(the run's configs, the checkpoint to resume from, the --init-from source, notes to
    print). The checkpoint is None for a new run, "" for a run restarted from its record
    (train/loop.py: --out's newest, none yet). With --resume the checkpoint's (or the record's)
    config is the base and the flags given are checked against it, its --context-parallel
    fitted to `world` ranks."""
    from fitgpt.train import checkpoint as ckpt_io
    from fitgpt.train.resume import (
        find_checkpoint,
        fit_context_parallel,
        removed_settings,
        resumed_config,
    )
    from fitgpt.train.rundir import read_record

    if args.init_from is not None:
        run, source = init_config(args, given)
        return run, None, source, []
    if args.resume is None:
        return run_config_from_args(args, given), None, None, []
    out = given["train"].get("out") or TrainConfig().out
    ckpt = find_checkpoint(args.resume, out)
    if ckpt is None:
        record = read_record(Path(out))  # a run killed before its first checkpoint
        if record is None:  # no run at all: the one these flags ask for
            note = f"--resume: {out} holds no checkpoint yet; starting a new run there"
            return run_config_from_args(args, given), None, None, [note]
        return restart_recorded(args, given, out, record, world)
    meta = ckpt_io.load_meta(ckpt)
    if args.resume and "out" not in given["train"]:  # continue in the run folder of CKPT
        given = {**given, "train": {**given["train"], "out": str(ckpt.parent)}}
    # checked here, before any work; what changed is said once the run is planned (the trainer)
    run, notes = resumed_config(meta, ckpt, given, args.preset)
    run, fitted = fit_context_parallel(run, world, "context_parallel" in given["engine"])
    notes = [f"resume: {ckpt} with its own config", *notes, *fitted, *removed_settings(meta, ckpt)]
    return run, ckpt, adapter_base(run, meta, ckpt), notes


def restart_recorded(
    args: argparse.Namespace, given: dict[str, dict], out: str, record: dict, world: int
):
    """`--resume` on a run folder with no checkpoint but a run record (train/rundir.py): the
    run it records, as it was started (its model, data and settings, with its --init-from
    source from step 0, or from the checkpoint it resumed); the flags given again are checked
    against it as a resume checks them against a checkpoint (train/resume.py resumed_config).
    A source that no longer holds the model the run was started from is refused in one line:
    restarting it would train another model."""
    from fitgpt.train import checkpoint as ckpt_io
    from fitgpt.train.resume import fit_context_parallel, resumed_config

    where = Path(out) / ckpt_io.RECORD_NAME
    given = {**given, "train": {**given["train"], "out": out}}
    ckpt, base, what = "", record, "from scratch"  # "": --out's newest, none yet (train/loop.py)
    if record.get("resume_from"):  # its steps must lie past the checkpoint's
        ckpt = ckpt_io.resolve(Path(record["resume_from"]))
        meta = ckpt_io.load_meta(ckpt)
        base = {**record, "step": meta["step"], "trainer": meta.get("trainer", {})}
        what = f"--resume {ckpt}"
    run, notes = resumed_config(base, where, given, args.preset)
    run, fitted = fit_context_parallel(run, world, "context_parallel" in given["engine"])
    source = None
    if record.get("init_from") and not ckpt:
        source = recorded_source(record["init_from"], run, where)
        what = f"--init-from {record['init_from']}"
    elif ckpt:
        source = adapter_base(run, ckpt_io.load_meta(ckpt), ckpt)
    note = f"--resume: {where} records the run ({what}); restarting it as it was started"
    return run, ckpt, source, [note, *notes, *fitted]


def adapter_base(run: RunConfig, meta: dict, ckpt: Path):
    """The frozen base of a resumed adapter run: the --init-from source its checkpoint names,
    holding the model it was trained on (checkpoints hold the adapters alone); None for a run
    that trains the whole model."""
    if not run.adapter.active:
        return None
    if not meta.get("init_from"):
        raise UserError(f"--resume: {ckpt} holds LoRA adapters but names no base; it is damaged")
    return recorded_source(meta["init_from"], run, ckpt)


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


def init_config(args: argparse.Namespace, given: dict[str, dict]):
    """(the run `--init-from SRC` asks for, SRC): SRC's architecture, everything else from the
    flags. The model flags are checked against the source's model (its family's fields), never
    against the default preset, whose family may lack them."""
    from fitgpt.interop.init_source import find_source
    from fitgpt.train.init_from import model_from_source

    if args.resume is not None:
        raise UserError(
            "--init-from starts a new run from a model's weights, --resume continues a run: "
            "pass one of them"
        )
    data = data_config(given)  # validated before the source is opened
    source = find_source(args.init_from)
    asked = given["model"]
    if args.preset is not None:  # a preset named counts as its fields given (not its vocabulary)
        named = get_preset(args.preset).to_dict()
        asked = {**{k: v for k, v in named.items() if k != "vocab_size"}, **asked}
    model = model_from_source(source, asked, data)
    run = run_config_from_args(args, given, model, finetune=True)  # fine-tuning's defaults
    return run, source


def check_out_apart(args: argparse.Namespace, settings: Settings) -> None:
    """Refuse an --out that is, lies inside or holds the model the run starts from (the
    --init-from source, and the models that one came from), before any work: the run would
    write its files among the user's model files, and --overwrite delete them. With
    --overwrite, the data and the tokenizer folder are kept apart too (it empties --out)."""
    from fitgpt.data.indexed import paths as pair_paths
    from fitgpt.paths import check_apart
    from fitgpt.train import checkpoint as ckpt_io

    run, ckpt, source = settings.config, settings.resume, settings.init_from
    what = "the model --init-from reads"
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
        meta = ckpt_io.load_meta(Path(ckpt))
        kept += [(f"a model {ckpt} came from", p) for p in ckpt_io.sources(meta)]
    if settings.overwrite:
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


def settled(args: argparse.Namespace, world: int) -> Settings:
    """The settings this command line asks for (`asked`), settled for `world` ranks
    (train/assemble.py settle: the one validation of the settings), and --out checked: apart
    from what the run reads, and writable. What the job cannot run is refused here, in one
    line, before torchrun starts (--gpus) and before anything is allocated."""
    from fitgpt.paths import check_writable_dir
    from fitgpt.plan.validate import device_type
    from fitgpt.train.assemble import settle

    settings = asked(args, world)
    settings = settle(settings, world, device_type(settings.config.train.device))
    check_out_apart(args, settings)
    check_writable_dir(settings.config.train.out, "--out")
    return settings


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
    run assembled from them (train/assemble.py) and trained (train/loop.py)."""
    settings = handed_over()
    if settings is None:
        if args.gpus is not None and args.gpus < 1:
            raise UserError(f"--gpus {args.gpus} must be at least 1")
        settings = settled(args, args.gpus or int(os.environ.get("WORLD_SIZE", 1)))
    if args.gpus is not None:
        from fitgpt.dist.launch import relaunch, strip_flag

        argv = strip_flag(sys.argv[1:], "--gpus")
        return relaunch(args.gpus, argv, env={HANDED: json.dumps(settings.to_dict())})
    from fitgpt.dist import init_distributed, shutdown
    from fitgpt.dist.env import configure_process
    from fitgpt.train.assemble import assemble
    from fitgpt.train.loop import train

    t = settings.config.train
    configure_process(t.cpu_threads, t.device)  # before CUDA, NCCL and the first CPU kernel
    ctx = init_distributed(t.device, t.dist_timeout)
    try:

        def log(msg: str) -> None:
            if ctx.is_main:
                print(msg, flush=True)

        train(assemble(settings, ctx, log))
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
