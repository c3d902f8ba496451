"""`fitgpt train --init-from SRC`: a new run that starts from another model's weights.

SRC is a fitgpt run or checkpoint, or a Hugging Face GPT-2 checkpoint (a folder with
config.json, or its weight file). The architecture is SRC's; the data, schedule, placement and
world size are this command's; the optimizer, step count and data position start fresh. A
Hugging Face source is imported first (fitgpt/interop/hf_import.py, tensor by tensor) into a
scratch folder under --out, loaded through the engines' normal state files like any checkpoint,
and removed once loaded, so any engine, stage, placement and world size can train it.
"""

from __future__ import annotations

import dataclasses
import shutil
from dataclasses import dataclass
from pathlib import Path

from fitgpt.errors import UserError
from fitgpt.model import ModelConfig
from fitgpt.train import checkpoint as ckpt_io

SCRATCH = ".init-from"  # under --out: where a Hugging Face source is imported for loading
FREE = ("dropout",)  # model fields a fine-tune may set differently from its source


@dataclass(frozen=True)
class InitSource:
    path: Path
    kind: str  # "fitgpt" or "hf"
    model: ModelConfig


def find_source(src: str) -> InitSource:
    """What --init-from names, with its architecture, read without loading any weights."""
    path = Path(src)
    if not path.exists():
        raise UserError(
            f"--init-from {src} does not exist; pass a fitgpt run or checkpoint, or a Hugging Face GPT-2 folder"
        )
    if (path / "meta.json").is_file() or ckpt_io.step_dirs(path):
        ckpt = ckpt_io.resolve(path)
        meta = ckpt_io.load_meta(ckpt)
        return InitSource(ckpt, "fitgpt", ModelConfig.from_dict(meta["config"]["model"]))
    from fitgpt.interop.hf import model_config_from_hf
    from fitgpt.interop.hf_import import locate, read_config

    config, _ = locate(path)
    return InitSource(path, "hf", model_config_from_hf(read_config(config), str(path)))


def model_from_source(source: InitSource, asked: dict, data) -> ModelConfig:
    """The run's model: the source's architecture, with the fields a fine-tune may change from
    `asked` (the model flags given); any other difference, the data's vocabulary included, is
    refused in one line."""
    from fitgpt.train.setup import model_for_data

    model = source.model
    for name, value in asked.items():
        if name in FREE:
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
    import into out/.init-from, which every rank then reads."""
    if source.kind == "fitgpt":
        return source.path
    scratch = out / SCRATCH
    if ctx.is_main:
        from fitgpt.interop.hf_import import import_hf

        import_hf(source.path, scratch, overwrite=True)
    ctx.barrier()
    return ckpt_io.resolve(scratch)


def drop_scratch(out: Path, ctx) -> None:
    ctx.barrier()  # every rank has read it
    if ctx.is_main:
        shutil.rmtree(out / SCRATCH, ignore_errors=True)
