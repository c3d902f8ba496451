"""What a `fitgpt train` command asks for, worked out once into the run's Settings.

The command line is read once, by cli/train.py, into a `Request`: plain values (the fields
given per config part, a DeepSpeed config's keys among them as if typed; the preset, the
--init-from source, the checkpoint to resume), no argparse. Everything after that is decided
here, on the train floor, in one pass that hands its result down:

    asked     the run's configs: a preset with the flags, the --init-from source's model, or the
              resumed run's own config (a checkpoint's meta.json, or the record of a run killed
              before its first checkpoint), the shares of blocks as counts, where it starts
    settled   those settled for the job's ranks (train/assemble.py settle: the one validation)
              and --out checked: apart from what the run reads, and writable

Reading a model source is interop's (Hugging Face folders); the CLI hands its reader in
(`open_source`), so this floor never imports the one above it.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fitgpt.adapters.peft import adapter_config, check_peft_weights
from fitgpt.data.config import BUILTIN, DataConfig
from fitgpt.engine.config import EngineConfig, OptimConfig, PrecisionConfig
from fitgpt.errors import UserError
from fitgpt.model import ModelConfig, get_preset
from fitgpt.plan.fixed import Fixed
from fitgpt.train import checkpoint as ckpt_io
from fitgpt.train.assemble import Settings, settle
from fitgpt.train.config import RunConfig, TrainConfig
from fitgpt.train.init_from import InitSource, free_fields, model_from_source

DEFAULT_PRESET = "tiny"

OpenSource = Callable[[str], InitSource]  # a path -> the model it holds (interop/init_source.py)


@dataclass(frozen=True)
class Request:
    """A `fitgpt train` command line, read once (cli/train.py request_of)."""

    # part ("model", "data", "train", "engine", "precision", "optim") -> the fields given
    given: Mapping[str, Mapping[str, Any]]
    # the engine and precision flags typed, and the block shares (plan/validate.py no_effect)
    typed: Mapping[str, Any] = field(default_factory=dict)
    preset: str | None = None  # None: the default preset; "" names none and is refused
    init_from: str | None = None  # a fitgpt run or checkpoint, or a Hugging Face folder
    resume: str | None = None  # a checkpoint; "": --out's newest; None: a new run
    offload_fraction: float | None = None  # shares of the blocks, counted once the model is known
    nvme_fraction: float | None = None
    cpu_mem: int = 0  # --cpu-mem in bytes; 0: as the machine reports it
    gpu_mem: int = 0  # --gpu-mem in bytes; 0: the whole GPU
    inter_node_gbps: float = 0.0  # --inter-node-gbps; 0: as probed, else assumed
    plan: bool = True  # --plan auto: the planner chooses the engine fields not given
    force: bool = False
    overwrite: bool = False
    files: Mapping[str, str] = field(default_factory=dict)  # name -> text, for the run folder


def settled(req: Request, world: int, open_source: OpenSource) -> Settings:
    """The settings `req` asks for (`asked`), settled for `world` ranks on the device the run
    names (train/assemble.py settle: the one validation of the settings), and --out checked: apart from what
    the run reads, and writable. What the job cannot run is refused here, in one line, before
    torchrun starts (--gpus) and before anything is allocated."""
    from fitgpt.dist.context import device_type
    from fitgpt.paths import check_writable_dir
    from fitgpt.train.rundir import check_overwritable

    settings = asked(req, world, open_source)
    device = device_type(settings.config.train.device)
    settings = settle(settings, world, device)
    check_out_apart(req.init_from, settings)
    if settings.overwrite and req.resume is None:  # --resume keeps what is there
        check_overwritable(Path(settings.config.train.out))
    check_writable_dir(settings.config.train.out, "--out")
    return settings


def asked(req: Request, world: int, open_source: OpenSource) -> Settings:
    """The run `req` asks for on `world` ranks: its configs (`configs`), the machine's RAM as
    stated, the engine fields the planner keeps, and where the run starts. What the command
    names is read (a checkpoint's meta.json, a run record, a source's config); nothing is
    settled, validated or allocated."""
    given = {part: dict(fields) for part, fields in req.given.items()}
    run, ckpt, source, notes = configs(req, given, world, open_source)
    given, run = with_block_counts(req, given, run)
    # what this machine gives, for the planner and every rank's engine; never a resumed run's
    # saved figure
    mem = {"cpu_mem": req.cpu_mem, "gpu_mem": req.gpu_mem, "inter_node_gbps": req.inter_node_gbps}
    run = dataclasses.replace(run, engine=dataclasses.replace(run.engine, **mem))
    # --plan auto: the engine fields given are kept, the planner chooses the rest; off: as given
    fixed = Fixed.of(given["engine"]) if req.plan else None
    return Settings(
        run,
        fixed,
        req.force,
        req.typed,
        resume=None if ckpt is None else str(ckpt),
        init_from=source,
        overwrite=req.overwrite,
        files=req.files,
        notes=tuple(notes),
    )


def configs(req: Request, given: dict[str, dict], world: int, open_source: OpenSource):
    """(the run's configs, the checkpoint to resume from, the --init-from source, notes to
    print). The checkpoint is None for a new run, "" for a run restarted from its record
    (train/loop.py: --out's newest, none yet). With --resume the checkpoint's (or the record's)
    config is the base and the flags given are checked against it, its --context-parallel
    fitted to `world` ranks."""
    from fitgpt.train.resume import (
        find_checkpoint,
        removed_settings,
        resumed_config,
    )
    from fitgpt.train.rundir import read_record

    if req.init_from is not None:
        run, source = init_config(req, given, open_source)
        return run, None, source, []
    if req.resume is None:
        return fresh_config(req, given), None, None, []
    out = given["train"].get("out") or TrainConfig().out
    ckpt = find_checkpoint(req.resume, out)
    if ckpt is None:
        record = read_record(Path(out))  # a run killed before its first checkpoint
        if record is None:  # no run at all: the one these flags ask for
            note = f"--resume: {out} holds no checkpoint yet; starting a new run there"
            return fresh_config(req, given), None, None, [note]
        return restart_recorded(req, given, out, record, world, open_source)
    # meta.json and the files on this machine: a node-local checkpoint's others are asked for
    # where the ranks that read them are known (train/loop.py, checkpoint.require_files)
    meta = ckpt_io.load_meta(ckpt, ckpt_io.ANY_NODE)
    if req.resume and "out" not in given["train"]:  # continue in the run folder of CKPT
        given["train"] = {**given["train"], "out": str(ckpt.parent)}
    # checked here, before any work; what changed is said once the run is planned (the trainer)
    run, notes = resumed_config(meta, ckpt, given, req.preset)
    run, fitted = fit_to_world(run, world, given, req.plan)
    notes = [f"resume: {ckpt} with its own config", *notes, *fitted, *removed_settings(meta, ckpt)]
    return run, ckpt, adapter_base(run, meta, ckpt, open_source), notes


def fit_to_world(
    run: RunConfig, world: int, given: dict[str, dict], plan: bool
) -> tuple[RunConfig, list[str]]:
    """A resumed `run` fitted to `world` ranks, with notes: its saved --tensor-parallel,
    --context-parallel and --expert-parallel that were not typed again and do not divide the
    ranks (train/resume.py fit_degree and fit_context_parallel; the planner of --plan auto
    chooses T and P itself)."""
    from fitgpt.train.resume import fit_context_parallel, fit_degree

    typed = given["engine"]
    e = run.engine
    tp, notes = fit_degree(
        "--tensor-parallel", e.tensor_parallel, world, plan or "tensor_parallel" in typed
    )
    run = dataclasses.replace(run, engine=dataclasses.replace(e, tensor_parallel=tp))
    run, more = fit_context_parallel(run, world, "context_parallel" in typed)
    ep, most = fit_degree(
        "--expert-parallel", run.engine.expert_parallel, world, plan or "expert_parallel" in typed
    )
    engine = dataclasses.replace(run.engine, expert_parallel=ep)
    return dataclasses.replace(run, engine=engine), [*notes, *more, *most]


def restart_recorded(
    req: Request,
    given: dict[str, dict],
    out: str,
    record: dict,
    world: int,
    open_source: OpenSource,
):
    """`--resume` on a run folder with no checkpoint but a run record (train/rundir.py): the
    run it records, as it was started (its model, data and settings, with its --init-from
    source from step 0, or from the checkpoint it resumed); the flags given again are checked
    against it as a resume checks them against a checkpoint (train/resume.py resumed_config).
    A source that no longer holds the model the run was started from is refused in one line:
    restarting it would train another model."""
    from fitgpt.train.resume import resumed_config

    where = Path(out) / ckpt_io.RECORD_NAME
    given["train"] = {**given["train"], "out": out}
    ckpt, base, what = "", record, "from scratch"  # "": --out's newest, none yet (train/loop.py)
    if record.get("resume_from"):  # its steps must lie past the checkpoint's
        ckpt = ckpt_io.resolve(Path(record["resume_from"]))
        meta = ckpt_io.load_meta(ckpt, ckpt_io.ANY_NODE)  # its config
        base = {**record, "step": meta["step"], "trainer": meta.get("trainer", {})}
        what = f"--resume {ckpt}"
    run, notes = resumed_config(base, where, given, req.preset)
    run, fitted = fit_to_world(run, world, given, req.plan)
    source = None
    if record.get("init_from") and not ckpt:
        path = record["init_from"]
        source = recorded_source(path, open_source(path), run, where)
        what = f"--init-from {record['init_from']}"
    elif ckpt:
        source = adapter_base(run, ckpt_io.load_meta(ckpt), ckpt, open_source)
    note = f"--resume: {where} records the run ({what}); restarting it as it was started"
    return run, ckpt, source, [note, *notes, *fitted]


def adapter_base(run: RunConfig, meta: dict, ckpt: Path, open_source: OpenSource):
    """The frozen base of a resumed adapter run: the --init-from source its checkpoint names,
    holding the model it was trained on (checkpoints hold the adapters alone); None for a run
    that trains the whole model."""
    if not run.adapter.active:
        return None
    path = meta.get("init_from")
    if not path:  # a randomly initialised base (--preset, no --init-from): the seed remakes it
        return None
    source = open_source(path)
    # the architecture alone: the run's data was checked against this source when it started,
    # and the checkpoint's data against the run's by resumed_config
    kept = {k: getattr(run.model, k) for k in free_fields(source.model)}  # the run's own
    if dataclasses.replace(source.model, **kept) != run.model:
        raise UserError(
            f"--resume: {ckpt} trained LoRA adapters on {path}, which holds another model now; "
            "put the base back, or start a new run with --init-from and --overwrite"
        )
    from fitgpt.train.resume import same_base

    if not same_base(meta, path):
        raise UserError(
            f"--resume: {ckpt} trained LoRA adapters on {path}, which holds other weights now "
            "(a model of the same shape saved there); put the base back, or start a new run "
            "with --init-from and --overwrite"
        )
    return source


def recorded_source(path: str, source: InitSource, run: RunConfig, where: Path) -> InitSource:
    """`source`, the --init-from `path` a run record names, if it still holds the model the run
    was started with."""
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


def init_config(req: Request, given: dict[str, dict], open_source: OpenSource):
    """(the run `--init-from SRC` asks for, SRC): SRC's architecture, everything else from the
    flags. The model flags are checked against the source's model (its family's fields), never
    against the default preset, whose family may lack them."""
    if req.resume is not None:
        raise UserError(
            "--init-from starts a new run from a model's weights, --resume continues a run: "
            "pass one of them"
        )
    data = data_config(given)  # validated before the source is opened
    source = open_source(req.init_from)
    asked_fields = given["model"]
    if req.preset is not None:  # a preset named counts as its fields given (not its vocabulary)
        named = get_preset(req.preset).to_dict()
        asked_fields = {**{k: v for k, v in named.items() if k != "vocab_size"}, **asked_fields}
    model = model_from_source(source, asked_fields, data)
    return fresh_config(req, given, model, finetune=True), source  # fine-tuning's defaults


def fresh_config(
    req: Request, given: dict[str, dict], model: ModelConfig | None = None, finetune: bool = False
) -> RunConfig:
    """The run a fresh `fitgpt train` asks for: `model` (--init-from: the source's, the model
    flags checked against it) or the preset with the model flags applied, the Python standard
    library as data unless --data says otherwise. `--preset ""` names no preset and is refused
    by get_preset, as any other name it does not know (an empty name is not the default)."""
    adapter = adapter_config(given["adapter"], model)  # --lora-from: its folder's adapter
    if model is None and adapter.active and req.preset is None:
        raise UserError(
            f"--lora-rank {adapter.lora_rank} adapts a pretrained model: add --init-from MODEL "
            "(a Hugging Face folder or a fitgpt run), or name --preset for a randomly "
            "initialised base (to measure a LoRA run's speed and memory)"
        )
    if model is None:
        preset = DEFAULT_PRESET if req.preset is None else req.preset
        model = dataclasses.replace(get_preset(preset), **given["model"])
    if adapter.lora_from:  # its tensors' names and shapes (a header), before a base is read
        check_peft_weights(Path(adapter.lora_from), model, adapter)
    return RunConfig(
        model=model,
        data=data_config(given),
        train=train_config(given["train"], model, finetune, adapter.active),
        engine=EngineConfig(**given["engine"]),
        precision=PrecisionConfig(**given["precision"]),
        optim=OptimConfig(**given["optim"]),
        adapter=adapter,
    )


def data_config(given: Mapping[str, Mapping]) -> DataConfig:
    """The data flags, the Python standard library unless --data says otherwise."""
    return DataConfig(**{"data": "stdlib", **given["data"]})


def train_config(
    given: Mapping, model: ModelConfig, finetune: bool = False, adapters: bool = False
) -> TrainConfig:
    """The training flags as given: the rates and warm-up the command does not name stay unset,
    for the Trainer to work out with the run's tokens per step (train/schedule.py
    resolve_schedule, the one place these defaults are decided). A --min-lr above the default
    peak is refused here, before anything is built."""
    from fitgpt.train.schedule import peak_lr

    lr = peak_lr(model, finetune, adapters)
    if "lr" not in given and given.get("min_lr", 0) > lr:
        what = "LoRA" if adapters else "fine-tuning" if finetune else f"a model {model.n_embd} wide"
        raise UserError(
            f"--min-lr {given['min_lr']:g} is above the peak learning rate, {lr:g} by default "
            f"for {what}; lower --min-lr or set --lr"
        )
    return TrainConfig(**given, finetune=finetune)


def with_block_counts(req: Request, given: dict[str, dict], run: RunConfig):
    """(`given`, `run`) with the shares of blocks given (--offload-fraction, --nvme-fraction)
    as the block counts they ask for, once the model's layers are known: the planner keeps them
    as if typed. The one place a share of blocks becomes a count: everything after counts
    blocks. A count typed beside its share is refused (they say the same thing)."""
    if req.offload_fraction is None and req.nvme_fraction is None:
        return given, run
    counts = {k: given["engine"].get(k) for k in ("offload_blocks", "nvme_blocks")}
    shares = (("offload_fraction", "offload_blocks"), ("nvme_fraction", "nvme_blocks"))
    for share, count in shares:
        f = getattr(req, share)
        if f is None:
            continue
        flag = "--" + share.replace("_", "-")
        if not 0.0 <= f <= 1.0:
            raise UserError(f"{flag} {f} must lie in [0, 1]")
        if counts[count] is not None:
            raise UserError(f"{flag} and --{count.replace('_', '-')} say the same thing: give one")
        of = counts["offload_blocks"]  # --nvme-fraction: a share of the offloaded blocks
        if share == "offload_fraction" or of is None:
            of = run.model.n_layer
        counts[count] = round(f * of)
    typed = {k: v for k, v in counts.items() if v is not None}
    given = {**given, "engine": {**given["engine"], **typed}}
    return given, dataclasses.replace(run, engine=dataclasses.replace(run.engine, **counts))


def check_out_apart(typed_source: str | None, settings: Settings) -> None:
    """Refuse an --out that is, lies inside or holds the model the run starts from (the
    --init-from source as typed and as found, the models that one came from, and the
    --lora-from adapter folder), before any work: the run would write its files among the
    user's model files, and --overwrite delete them. With --overwrite, the data and the
    tokenizer folder are kept apart too (it empties --out)."""
    from fitgpt.data.indexed import paths as pair_paths
    from fitgpt.paths import check_apart

    run, ckpt, source = settings.config, settings.resume, settings.init_from
    what = "the model --init-from reads"
    kept = []
    if source is not None:
        kept = [(what, p) for p in dict.fromkeys([typed_source, str(source.path)]) if p]
        if source.weights is None:  # a fitgpt checkpoint: the models it came from
            kept += [
                (f"a model {source.path} came from", p)
                for p in ckpt_io.sources(ckpt_io.load_meta(source.path))
            ]
        if run.adapter.lora_from:  # the PEFT folder whose adapters it goes on training
            kept.append(("the adapter --lora-from reads", run.adapter.lora_from))
    if ckpt:
        meta = ckpt_io.load_meta(Path(ckpt), ckpt_io.ANY_NODE)  # its sources alone
        kept += [(f"a model {ckpt} came from", p) for p in ckpt_io.sources(meta)]
    if settings.overwrite:
        if run.data.data not in BUILTIN:
            kept += [("the data --data reads", p) for p in pair_paths(run.data.data)]
        tok = run.data.tokenizer
        if tok not in ("auto", "none", "bytes", "gpt2") and os.path.isdir(tok):
            kept.append(("the tokenizer folder --tokenizer reads", tok))
    why = "the run would write there, and --overwrite delete what is there"
    check_apart("--out", run.train.out, kept, why)
