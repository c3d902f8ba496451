"""A run folder describes itself: `--resume` takes the run's config from its checkpoint.

`fitgpt train --out runs/x --resume` continues runs/x with the model, data, tokenizer and
training settings it was started with; the command need not repeat them. Flags given again are
checked against the checkpoint:

- what the saved state or the data order depends on (model shape, data, tokenizer, split,
  seed) must agree, or the resume is refused in one line naming the field;
- what may legitimately change between two legs of a run (steps, learning rate and schedule,
  logging and checkpoint cadence, batch split, precision, optimizer settings, where state lives)
  is applied and listed in one line.

A setting fitgpt has since removed is dropped from the saved config; where the run had it on,
one line says what the run does instead.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

from fitgpt.data.config import BUILTIN, DataConfig
from fitgpt.engine.config import EngineConfig, OptimConfig, PrecisionConfig
from fitgpt.errors import UserError
from fitgpt.model import ModelConfig
from fitgpt.train import checkpoint as ckpt_io
from fitgpt.train.config import TrainConfig

PARTS = {
    "model": ModelConfig,
    "data": DataConfig,
    "train": TrainConfig,
    "engine": EngineConfig,
    "precision": PrecisionConfig,
    "optim": OptimConfig,
}
# Fields whose change would make the saved state or the data order mean something else.
FIXED = {"train": ("seed",)}
# Fields since removed, (part, name) -> what a run saved with the field on does now.
REMOVED = {
    ("engine", "delayed_update"): "--delayed-update, which was removed (docs/offload.md); it "
    "goes on with exact updates",
}


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


def from_saved(section: str, saved: dict):
    """A config part from a checkpoint's meta (fields added since it was written take their
    defaults; fields since removed are dropped)."""
    cls = PARTS[section]
    names = {f.name for f in dataclasses.fields(cls)}
    return cls(**{k: v for k, v in saved.items() if k in names})


def removed_settings(meta: dict, ckpt: Path) -> list[str]:
    """One note per removed setting (REMOVED) that the checkpoint's run had on."""
    return [
        f"resume: {ckpt} was trained with {now}"
        for (part, name), now in REMOVED.items()
        if meta["config"].get(part, {}).get(name)
    ]


def _same_data(cfg: DataConfig, field: str, asked) -> bool:
    saved = getattr(cfg, field)
    if field == "data" and saved not in BUILTIN and asked not in BUILTIN:
        return os.path.realpath(saved) == os.path.realpath(asked)
    if field == "tokenizer":  # "auto" and what auto means for this data are the same tokenizer
        return dataclasses.replace(cfg, tokenizer=asked).tokenizer_spec() == cfg.tokenizer_spec()
    return saved == asked


def resumed_config(meta: dict, ckpt: Path, explicit: dict[str, dict], preset: ModelConfig | None):
    """(the RunConfig of the resumed run, the changes applied as 'field old → new' strings).

    `explicit` holds, per part, the fields the user set on the command line; `preset` the
    --preset named explicitly, if any (its fields count as given, except the vocabulary, which
    comes from the data)."""
    from fitgpt.train.loop import RunConfig

    saved = {k: from_saved(k, meta["config"][k]) for k in PARTS}
    asked = {k: dict(v) for k, v in explicit.items()}
    if preset is not None:
        given = {k: v for k, v in preset.to_dict().items() if k != "vocab_size"}
        asked["model"] = {**given, **asked.get("model", {})}
    changes = []
    for part in ("data", "model"):  # the data first: it also decides the vocabulary
        for name, value in asked.get(part, {}).items():
            old = getattr(saved[part], name)
            same = _same_data(saved[part], name, value) if part == "data" else old == value
            if not same:
                flag = _flag(PARTS[part], name)
                raise UserError(
                    f"--resume: {ckpt} was trained with {flag} {old}, this command asks {flag} "
                    f"{value}; drop the flag to continue that run, or start a new run with "
                    "another --out"
                )
    for part in ("train", "engine", "precision", "optim"):
        for name, value in asked.get(part, {}).items():
            old = getattr(saved[part], name)
            if value == old:
                continue
            if name in FIXED.get(part, ()):
                raise UserError(
                    f"--resume: {ckpt} was trained with --{name.replace('_', '-')} {old}; "
                    f"resuming with {value} would change the data order. Drop the flag"
                )
            changes.append(f"{name} {old} → {value}")
    parts = {k: dataclasses.replace(saved[k], **asked.get(k, {})) for k in PARTS}
    if "profile" not in asked.get("train", {}):  # a look at one run's steps, not a setting of it
        parts["train"] = dataclasses.replace(parts["train"], profile=0)
    return RunConfig(**parts), changes
