"""`fitgpt train --init-from SRC`: a new run that starts from another model's weights.

SRC is a fitgpt run or checkpoint, or a Hugging Face GPT-2 checkpoint (a folder with
config.json, or its weight file). The architecture is SRC's; the data, schedule, placement and
world size are this command's; the optimizer, step count and data position start fresh. A
source in another format carries its own conversion (`InitSource.convert`, supplied by the layer
that recognised it: interop/init_source.py for Hugging Face): rank 0 writes a fitgpt checkpoint
of it into a scratch folder under --out, every rank loads it through the engines' normal state
files like any checkpoint, and it is removed once loaded, so any engine, stage, placement and
world size can train it. This module never imports the formats it is handed.
"""

from __future__ import annotations

import dataclasses
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from fitgpt.errors import UserError
from fitgpt.model import ModelConfig
from fitgpt.train import checkpoint as ckpt_io
from fitgpt.train.setup import model_for_data

SCRATCH = ".init-from"  # under --out: where a Hugging Face source is imported for loading
FREE = ("dropout",)  # model fields a fine-tune may set differently from its source


def free_fields(cfg: ModelConfig) -> tuple[str, ...]:
    """FREE, and the context length where no weight depends on it (rotary or ALiBi positions:
    no position table), so a Llama fine-tune picks its own --seq-len."""
    return FREE if cfg.position == "learned" else (*FREE, "seq_len")


@dataclass(frozen=True)
class InitSource:
    path: Path
    model: ModelConfig
    # a source in another format (a Hugging Face folder): writes a fitgpt checkpoint of it into
    # the folder given (rank 0); None for a fitgpt checkpoint, which is loaded where it lies
    convert: Callable[[Path], object] | None = None


def fitgpt_source(path: Path) -> InitSource | None:
    """The fitgpt run or checkpoint at `path` with its architecture, read without loading any
    weights; None when `path` holds neither."""
    if (path / "meta.json").is_file() or ckpt_io.step_dirs(path):
        ckpt = ckpt_io.resolve(path)
        meta = ckpt_io.load_meta(ckpt)
        return InitSource(ckpt, ModelConfig.from_dict(meta["config"]["model"]))
    return None


def check_same_architecture(meta: dict, model_cfg: ModelConfig, ckpt: Path) -> None:
    """Refuse, in one line naming the fields, a checkpoint (a resume's or an --init-from
    source's) whose model differs from `model_cfg` in more than the FREE fields."""
    saved = ModelConfig.from_dict(meta["config"]["model"])
    free = {k: getattr(model_cfg, k) for k in free_fields(saved)}  # not in the weights' shape
    if dataclasses.replace(saved, **free) != model_cfg:
        diff = {
            k: (v, getattr(model_cfg, k))
            for k, v in saved.to_dict().items()
            if getattr(model_cfg, k) != v and k not in free_fields(saved)
        }
        raise UserError(
            f"{ckpt} holds another architecture (saved vs asked: {diff}); "
            "resume with the same --preset/--layers/--hidden/--heads/--seq-len"
        )


def model_from_source(source: InitSource, asked: dict, data) -> ModelConfig:
    """The run's model: the source's architecture, with the fields a fine-tune may change from
    `asked` (the model flags given); any other difference, the data's vocabulary included, is
    refused in one line."""
    model = source.model
    for name, value in asked.items():
        if name in free_fields(source.model):
            model = dataclasses.replace(model, **{name: value})
        elif getattr(model, name) != value:
            raise UserError(
                f"--init-from {source.path}: its model has {name}={getattr(model, name)!r}, this "
                f"command asks {value!r}; drop the flag (the architecture is the source's)"
            )
    if model_for_data(model, data).vocab_size != model.vocab_size:
        tok = model_for_data(model, data).vocab_size
        raise UserError(
            f"--init-from {source.path}: its vocabulary has {model.vocab_size} tokens, the data's "
            f"tokenizer {tok}; train on data made with the source's tokenizer (--tokenizer)"
        )
    return model


def checkpoint_of(source: InitSource, out: Path, ctx) -> Path:
    """A fitgpt checkpoint holding the source's weights: the source itself, or (rank 0) its
    conversion into out/.init-from, which every rank then reads."""
    if source.convert is None:
        return source.path
    scratch = out / SCRATCH
    if ctx.is_main:
        source.convert(scratch)
    ctx.barrier()
    return ckpt_io.resolve(scratch)


def drop_scratch(out: Path, ctx) -> None:
    ctx.barrier()  # every rank has read it
    if ctx.is_main:
        shutil.rmtree(out / SCRATCH, ignore_errors=True)
