"""A run folder describes itself: `--resume` takes the run's config from its checkpoint.

`fitgpt train --out runs/x --resume` continues runs/x with the model, data, tokenizer and
training settings it was started with; the command need not repeat them. Flags given again are
checked against the checkpoint:

- what the saved state or the data order depends on (model shape, data, tokenizer, split,
  seed) must agree, or the resume is refused in one line naming the field; data or a tokenizer
  that moved may be named at its new place (it is recognised by its fingerprint);
- what may legitimately change between two legs of a run (steps, learning rate and schedule,
  logging and checkpoint cadence, batch split, precision, optimizer settings, where state lives,
  dropout) is applied.

Once the resumed run is planned, the trainer states in one line every setting that differs from
the saved run, asked for or not: world size, tokens per step, ZeRO stage, placement, precision,
tensor parallelism, and every flag (`changed_settings`).

Paths in a checkpoint (data, tokenizer, --nvme-path, --out) are stored absolute, so a run folder
resumes from any working directory; checkpoints written before that hold them relative to the
directory the run started in, which is worked out from where the run folder lies.

A setting fitgpt has since removed is dropped from the saved config; where the run had it on,
one line says what the run does instead.
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
import os
from pathlib import Path

from fitgpt.adapters.config import resumed_adapter
from fitgpt.data import sidecar
from fitgpt.data.config import BUILTIN, DataConfig
from fitgpt.data.indexed import paths as pair_paths
from fitgpt.data.tokenizer import Tokenizer, load_tokenizer
from fitgpt.errors import UserError
from fitgpt.model import ModelConfig, get_preset
from fitgpt.plan.memory import tokens_per_step
from fitgpt.train import checkpoint as ckpt_io
from fitgpt.train.config import PARTS, RunConfig
from fitgpt.train.init_from import FREE

# Fields whose change would make the saved state or the data order mean something else.
FIXED = {"train": ("seed",)}
# Fields since removed, (part, name) -> what a run saved with the field on does now.
REMOVED = {
    ("engine", "delayed_update"): "--delayed-update, which was removed (docs/offload.md); it "
    "goes on with exact updates",
}
# Path-like fields: "prefix" and "dir" are one path, "spec" a tokenizer spec whose
# comma-separated parts may each be one. Names that are not paths stay as they are.
PATH_FIELDS = {
    ("data", "data"): "prefix",
    ("data", "tokenizer"): "spec",
    ("engine", "nvme_path"): "dir",
    ("train", "out"): "dir",
    ("adapter", "lora_from"): "dir",
}
NAMES = {*BUILTIN, *sidecar.BUILTIN_SPECS, "auto", "none", ""}
# Not settings of the run: --profile looks at one leg's steps and is off on every resume;
# --cpu-mem states what the machine gives, and every command sets it anew (cli/train.py).
NOT_SETTINGS = {
    ("train", "profile"),
    ("engine", "cpu_mem"),
    ("engine", "gpu_mem"),
    ("engine", "inter_node_gbps"),
    # whether the base's planner may choose --checkpointing / --keep-activations: no flags of
    # their own, they follow the flags typed on each command; what the planner then chose is
    # the engine's field, compared and named as itself
    ("adapter", "checkpointing_planned"),
    ("adapter", "keep_planned"),
}
# Values that mean another one where no planner replaced them: a storage format left "auto" is
# fp32 to the engine (engine/chunked/placement.py), so a run saved with --plan off and resumed planned
# has not changed it.
SAME_AS = {("engine", k): {"auto": "fp32"} for k in ("master", "moments", "device_moments")}
SAMPLED = 1 << 20  # bytes hashed at each end of a data file (data_fingerprint)


# ---- paths -----------------------------------------------------------------------------------
def absolute(value: str, kind: str = "dir", base: Path | None = None) -> str:
    """`value` with its relative path parts made absolute against `base` (default: the working
    directory); names such as stdlib, gpt2 or auto are kept."""
    if value in NAMES:
        return value
    parts = value.split(",") if kind == "spec" else [value]
    root = str(base) if base is not None else os.getcwd()
    return ",".join(p if not p else os.path.abspath(os.path.join(root, p)) for p in parts)


def portable(config: dict) -> dict:
    """A RunConfig's dict with every path field absolute: what a checkpoint stores."""
    out = {part: dict(fields) for part, fields in config.items()}
    for (part, name), kind in PATH_FIELDS.items():
        if name in out.get(part, {}):
            out[part][name] = absolute(out[part][name], kind)
    return out


def _started_in(meta: dict, ckpt: Path) -> Path | None:
    """The working directory an older checkpoint's run started in (its paths are relative to
    it): the run folder less the relative --out it was saved with. None when --out was
    absolute, or the run folder was moved or renamed since (its paths then stay relative to the
    working directory, as before)."""
    out = meta["config"].get("train", {}).get("out", "")
    if not out or os.path.isabs(out):
        return None
    rel = Path(os.path.normpath(out)).parts
    run = Path(os.path.abspath(ckpt.parent)).parts
    if rel == (".",):  # the run folder was the working directory
        return Path(*run)
    if ".." in rel or run[-len(rel) :] != rel:
        return None
    return Path(*run[: -len(rel)])


def saved_config(meta: dict, ckpt: Path) -> dict[str, dict]:
    """The checkpoint's config, per part, its relative paths (older checkpoints) read against
    the directory its run started in."""
    config = {part: dict(meta["config"].get(part, {})) for part in PARTS}
    base = _started_in(meta, ckpt)
    if base is not None:
        for (part, name), kind in PATH_FIELDS.items():
            if name in config[part]:
                config[part][name] = absolute(config[part][name], kind, base)
    return config


def from_saved(section: str, saved: dict):
    """A config part from a checkpoint's meta (fields added since it was written take their
    defaults; fields since removed are dropped)."""
    cls = PARTS[section]
    names = {f.name for f in dataclasses.fields(cls)}
    return cls(**{k: v for k, v in saved.items() if k in names})


# ---- what identifies the data and the tokenizer ----------------------------------------------
def data_fingerprint(prefix: str) -> dict | None:
    """The sizes of a .bin/.idx pair and a SHA-256 of the first and last MiB of each: what
    recognises the same data under another name (one read of 4 MiB at most). None for built-in
    data and for a pair that cannot be read."""
    if prefix in BUILTIN:
        return None
    digest, sizes = hashlib.sha256(), []
    try:
        for p in pair_paths(prefix):
            size = p.stat().st_size
            with open(p, "rb") as f:
                digest.update(f.read(SAMPLED))
                f.seek(max(SAMPLED, size - SAMPLED))
                digest.update(f.read())
            sizes.append(size)
    except OSError:
        return None
    return {"bin_bytes": sizes[0], "idx_bytes": sizes[1], "sha256": digest.hexdigest()}


def base_fingerprint(source: str) -> str | None:
    """What recognises the weights an adapter run's frozen base held (its checkpoints hold the
    adapters alone, and merge, generate and resume read the base again): for a Hugging Face
    folder its weight files' names and sizes and a SHA-256 of the first and last MiB of each
    (2 MiB a file, read at every save: a model of the same shape saved over it differs
    there), for a fitgpt
    checkpoint its meta.json's checksum. None where nothing can be read."""
    path = Path(source)
    try:
        ckpt = ckpt_io.resolve(path)
        return "fitgpt:" + ckpt_io.load_meta(ckpt)["checksum"]
    except (UserError, OSError, KeyError, ValueError):
        pass  # not a fitgpt checkpoint: a Hugging Face folder
    folder = path if path.is_dir() else path.parent
    files = sorted(folder.glob("*.safetensors")) or sorted(folder.glob("pytorch_model*.bin"))
    digest = hashlib.sha256()
    try:
        for f in files:
            size = f.stat().st_size
            digest.update(f"{f.name}:{size};".encode())
            with open(f, "rb") as fh:
                digest.update(fh.read(SAMPLED))
                fh.seek(max(SAMPLED, size - SAMPLED))
                digest.update(fh.read())
    except OSError:
        return None
    return "hf:" + digest.hexdigest() if files else None


def same_base(meta: dict, source: str) -> bool:
    """Whether `source` still holds the weights `meta`'s adapter run recorded (True for a run
    that recorded none: older checkpoints, a base that could not be read)."""
    recorded = meta.get("init_from_fingerprint")
    return recorded is None or base_fingerprint(source) in (recorded, None)


def _fingerprint(tok: Tokenizer | None) -> str | None:
    """sidecar.fingerprint, or None for no tokenizer or ids without text (`data fake`'s
    recorded vocabulary, which refuses to encode)."""
    if tok is None:
        return None
    try:
        return sidecar.fingerprint(tok)
    except UserError:
        return None


def saved_run(run: RunConfig, tokenizer: Tokenizer | None, source: str | None) -> dict:
    """What a checkpoint's meta.json records of its run: the config with absolute paths, the
    tokenizer (absolute spec and fingerprint), the data's fingerprint, the --init-from source."""
    return {
        "config": portable(run.to_dict()),
        "tokenizer": absolute(tokenizer.name, "spec") if tokenizer is not None else None,
        "tokenizer_fingerprint": _fingerprint(tokenizer),
        "data_fingerprint": data_fingerprint(run.data.data),
        "init_from": absolute(source) if source else None,
        # an adapter run's base is read again by merge, generate and resume: its weights' own
        "init_from_fingerprint": base_fingerprint(source)
        if source and run.adapter.active
        else None,
    }


def run_record(run: RunConfig, source: str | None, resume_from: str | None) -> dict:
    """What a run folder records of its run until the first checkpoint does (train/rundir.py):
    what that checkpoint's meta.json would (saved_run; the tokenizer is the data's spec, not yet
    loaded), at step 0, and the checkpoint the run resumes from, if any. `--resume` on a folder
    with no checkpoint restarts this run (cli/train.py), checking the flags given again against
    it as against a checkpoint (resumed_config)."""
    resumed = absolute(resume_from) if resume_from else None
    return {**saved_run(run, None, source), "step": 0, "resume_from": resumed}


# ---- the resumed run's config -------------------------------------------------------------------
def _flag(cls, name: str) -> str:
    """The command-line flag of a config field (--layers for n_layer)."""
    f = next(f for f in dataclasses.fields(cls) if f.name == name)
    return "--" + f.metadata.get("flag", name).replace("_", "-")


def find_checkpoint(resume: str, out: str) -> Path | None:
    """The checkpoint `--resume [CKPT]` names: CKPT (which must hold one), or the newest in
    --out (None when --out holds none yet: the run starts fresh)."""
    if resume:
        return ckpt_io.resolve(Path(resume))
    found = ckpt_io.step_dirs(Path(out))
    return found[-1] if found else None


def removed_settings(meta: dict, ckpt: Path) -> list[str]:
    """One note per removed setting (REMOVED) that the checkpoint's run had on."""
    return [
        f"resume: {ckpt} was trained with {now}"
        for (part, name), now in REMOVED.items()
        if meta["config"].get(part, {}).get(name)
    ]


def _refuse(ckpt: Path, flag: str, old, new) -> UserError:
    return UserError(
        f"--resume: {ckpt} was trained with {flag} {old}, this command asks {flag} {new}; drop "
        "the flag to continue that run, or start a new run with another --out"
    )


def _pair_exists(prefix: str) -> bool:
    return all(p.is_file() for p in pair_paths(prefix))


def _data(saved: dict, asked: dict, meta: dict, ckpt: Path) -> tuple[DataConfig, list[str]]:
    """The data part of the resumed run and its notes: --data may name the saved data at
    another place (recognised by its fingerprint), never other data."""
    old, notes = saved["data"], []
    new = asked.get("data", old)
    if "data" not in asked and old not in BUILTIN and not _pair_exists(old):
        raise UserError(
            f"--resume: {ckpt} was trained on {old}, and {old}.bin/.idx no longer exist; if the "
            "data moved, pass --data with its new prefix"
        )
    moved = new != old and os.path.realpath(new) != os.path.realpath(old)
    if moved and (new in BUILTIN or old in BUILTIN):
        raise _refuse(ckpt, "--data", old, new)
    for name, value in asked.items():  # the split, the sample order: the data order itself
        if name not in ("data", "tokenizer") and name in saved and value != saved[name]:
            raise _refuse(ckpt, _flag(DataConfig, name), saved[name], value)
    known = {f.name for f in dataclasses.fields(DataConfig)}
    merged = {k: v for k, v in {**saved, **asked}.items() if k in known}
    cfg = DataConfig(**merged)  # --data NEW must exist: refused in one line naming it if not
    if moved:
        recorded = meta.get("data_fingerprint") or data_fingerprint(old)
        found = data_fingerprint(new)
        if recorded is None:
            notes.append(
                f"resume: {ckpt} records no fingerprint of its data and {old} is gone: --data "
                f"{new} is taken to be the same data"
            )
        elif found != recorded:
            theirs = f"{recorded['bin_bytes']:,}+{recorded['idx_bytes']:,}"
            sizes = f"{found['bin_bytes']:,}+{found['idx_bytes']:,}" if found else "unreadable"
            what = (
                f"its .bin+.idx hold {sizes} bytes, the run's {theirs}"
                if sizes != theirs
                else "its .bin/.idx have the run's sizes but other content"
            )
            raise UserError(
                f"--data {new} is not the data {ckpt} was trained on ({old}): {what}; pass the "
                "data the run was trained on, or start a new run with another --out"
            )
    if "tokenizer" in asked:
        _check_tokenizer(dataclasses.replace(cfg, tokenizer=saved["tokenizer"]), cfg, meta, ckpt)
    return cfg, notes


def _check_tokenizer(saved: DataConfig, asked: DataConfig, meta: dict, ckpt: Path) -> None:
    """--tokenizer on a resume: the saved run's tokenizer, possibly at another place (the same
    fingerprint), or refused naming both."""
    old, new = saved.tokenizer_spec(), asked.tokenizer_spec()
    if old == new:
        return
    if "none" in (old, new):  # pre-tokenized data against a tokenizer: never the same
        raise _refuse(ckpt, "--tokenizer", old, new)
    recorded = meta.get("tokenizer_fingerprint")
    if recorded is None:
        try:
            recorded = sidecar.fingerprint(load_tokenizer(old))
        except UserError:  # moved, and the checkpoint predates tokenizer fingerprints
            return
    if sidecar.fingerprint(load_tokenizer(new)) != recorded:
        raise _refuse(ckpt, "--tokenizer", old, new)


def _model(saved: dict, asked: dict, preset: str | None, ckpt: Path) -> ModelConfig:
    """The model part: the saved architecture; a typed flag that differs is refused, except the
    fields a run may change (FREE: dropout). A --preset named again counts for its
    architecture only, and a difference it makes is blamed on it, not on a flag never typed."""
    base = from_saved("model", saved)  # fields added since the checkpoint: their defaults
    fields = base.to_dict()
    from_preset = {}
    if preset is not None:
        shape = get_preset(preset).to_dict()  # its vocabulary comes from the data, dropout is FREE
        from_preset = {k: v for k, v in shape.items() if k != "vocab_size" and k not in FREE}
    for name, value in {**from_preset, **asked}.items():
        old = getattr(base, name)
        if name in FREE and name in asked:
            fields[name] = value
        elif old != value:
            flag = _flag(ModelConfig, name)
            if name in asked:
                raise _refuse(ckpt, flag, old, value)
            raise UserError(
                f"--resume: {ckpt} was trained with {flag} {old}, and --preset {preset} has "
                f"{flag} {value}; drop --preset (a resume takes the model from its checkpoint), "
                "or start a new run with another --out"
            )
    return from_saved("model", fields)


def _check_steps(meta: dict, ckpt: Path, steps: int, typed: bool) -> None:
    """A resume that would train nothing is refused before any work (it used to print
    'resumed' and exit 0 with an empty --out)."""
    step = meta.get("trainer", {}).get("step", meta["step"])
    if steps <= step:
        given = f"--steps {steps}" if typed else f"its --steps {steps}"
        raise UserError(
            f"--resume: {ckpt} is at step {step} and {given} is not above it, so nothing would "
            f"be trained; pass --steps above {step} to train on"
        )


def resumed_config(
    meta: dict, ckpt: Path, explicit: dict[str, dict], preset: str | None
) -> tuple[RunConfig, list[str]]:
    """(the RunConfig of the resumed run, notes to print).

    `explicit` holds, per part, the fields the user set on the command line; `preset` the
    --preset named explicitly, if any."""
    saved = saved_config(meta, ckpt)
    asked = {k: dict(explicit.get(k, {})) for k in PARTS}
    data, notes = _data(saved["data"], asked["data"], meta, ckpt)  # it also decides the vocab
    # the adapters' shape is the checkpoint's (fitgpt/adapters/config.py)
    adapter = resumed_adapter(saved["adapter"], asked["adapter"], ckpt)
    parts = {"data": data, "adapter": adapter}
    parts["model"] = _model(saved["model"], asked["model"], preset, ckpt)
    for part in ("train", "engine", "precision", "optim"):
        for name in FIXED.get(part, ()):
            old, value = saved[part].get(name), asked[part].get(name)
            if name in asked[part] and value != old:
                raise UserError(
                    f"--resume: {ckpt} was trained with --{name.replace('_', '-')} {old}; "
                    f"resuming with {value} would change the data order. Drop the flag"
                )
        parts[part] = dataclasses.replace(from_saved(part, saved[part]), **asked[part])
    if "profile" not in asked["train"]:  # a look at one run's steps, not a setting of it
        parts["train"] = dataclasses.replace(parts["train"], profile=0)
    _check_steps(meta, ckpt, parts["train"].steps, "steps" in asked["train"])
    return RunConfig(**parts), notes


def fit_context_parallel(run: RunConfig, world: int, typed: bool) -> tuple[RunConfig, list[str]]:
    """The resumed run at `world` ranks: a saved --context-parallel C that the user did not type
    again and that (with T) does not divide the new rank count becomes 1, with a note. C splits
    the sequence, not the state (the C ranks are data-parallel for the weights), so nothing
    saved depends on it; keeping it would refuse a resume on fewer GPUs that the user never
    asked to split. A C typed again is the user's, and is checked as given."""
    e = run.engine
    C, T = e.context_parallel, max(1, e.tensor_parallel)
    if typed or C <= 1 or world % (C * T) == 0:
        return run, []
    note = (
        f"resume: the run's --context-parallel {C} does not divide {world} rank(s); "
        "resuming with 1 (type --context-parallel to choose)"
    )
    return dataclasses.replace(run, engine=dataclasses.replace(e, context_parallel=1)), [note]


def fit_degree(flag: str, saved: int, world: int, kept: bool) -> tuple[int, list[str]]:
    """(degree, notes) for a resumed run at `world` ranks whose saved --tensor-parallel T or
    --expert-parallel P (`flag`) is `saved`: kept as it is where the user typed it again or
    --plan auto's planner chooses it (it prices only the degrees that divide); a saved degree
    that does not divide `world` becomes gcd(saved, world), which divides the ranks and every
    size the saved one divided (heads, MLP columns, vocabulary; experts), with a note.
    Checkpoints hold whole tensors (transforms/tp_state.py, ep_state.py), so nothing saved
    depends on the degree: keeping it would refuse a resume on fewer ranks that the user never
    asked to split."""
    if kept or saved <= 1 or world % saved == 0:
        return saved, []
    fitted = math.gcd(saved, world)
    note = (
        f"resume: the run's {flag} {saved} does not divide {world} rank(s); resuming with "
        f"{fitted} (type {flag} to choose)"
    )
    return fitted, [note]


# ---- what the resumed run changes -------------------------------------------------------------
def _shown(value) -> str:
    if isinstance(value, bool):
        return "on" if value else "off"
    if value is None or value == "":
        return "not set"
    return f"{value:g}" if isinstance(value, float) else str(value)


def _tokens(train: dict, model: dict, dp_world: int) -> int:
    return tokens_per_step(train["micro_batch"], train["grad_accum"], model["seq_len"], dp_world)


def changed_settings(
    meta: dict, ckpt: Path, run: RunConfig, world: int, dp_world: int, device: str
) -> list[str]:
    """Every setting of the resumed `run` (as planned and resolved for `world` ranks on
    `device`) that differs from the saved run's, as 'what old → new' strings: world size,
    device, tokens per step, then every config field by its flag. Fields the checkpoint does
    not record (added to fitgpt since) are not compared. `dp_world`: the ranks that read
    different rows (DistContext.data_world: world / (T·C))."""
    saved, now = saved_config(meta, ckpt), portable(run.to_dict())
    out = []
    if meta["world"] != world:
        out.append(f"world size {meta['world']} → {world}")
    if meta.get("device", device) != device:
        out.append(f"device {meta['device']} → {device}")
    tp = saved["engine"].get("tensor_parallel") or 1
    cp = saved["engine"].get("context_parallel") or 1  # C ranks read the same rows, as T do
    before = _tokens(saved["train"], saved["model"], meta["world"] // (tp * cp))
    after = _tokens(now["train"], now["model"], dp_world)
    if before != after:
        per_accum = after // now["train"]["grad_accum"]
        keep = f" (--grad-accum {before // per_accum} keeps {before:,})"
        out.append(
            f"tokens per step {before:,} → {after:,}{keep if before % per_accum == 0 else ''}"
        )
    # the adapter's shape is the checkpoint's (adapters/config.py resumed_adapter): what may
    # differ is its dropout and its base's format and tiers, placed again for this machine
    for part in ("engine", "precision", "train", "optim", "model", "data", "adapter"):
        for name, new in now[part].items():
            if (part, name) in NOT_SETTINGS or name not in saved[part]:
                continue
            old = saved[part][name]
            if isinstance(old, list):  # JSON's form of a tuple field (mlp_only_layers)
                old = tuple(old)
            if (part, name) in PATH_FIELDS:
                old = absolute(old, PATH_FIELDS[part, name])  # an old relative one, unplaced
            same = SAME_AS.get((part, name))  # only for hashable fields (rope_scaling: a dict)
            if same is not None:
                old, new = same.get(old, old), same.get(new, new)
            if old != new:
                out.append(f"{_flag(PARTS[part], name)} {_shown(old)} → {_shown(new)}")
    return out
