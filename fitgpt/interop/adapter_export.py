"""An adapter run's checkpoints out of fitgpt: PEFT's adapter folder (`fitgpt export --format
peft`), and the base with the adapters merged in (`--format hf --merge`, and `generate`).

A checkpoint of an adapter run holds the adapters (A and B by their names in the model, in the
chunks of its meta.json's layout) and names its base by the run's --init-from source, which is
opened again here (interop/init_source.py: a Hugging Face folder read in place, or a fitgpt
checkpoint) and must still hold the model the run trained. The merge reads the base chunk by
chunk with the updates added (adapters/merge.py MergedReader), so it needs about one chunk of
host RAM, as the plain export does.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor

from fitgpt.adapters import AdapterConfig, lora_targets
from fitgpt.adapters.merge import MergedReader
from fitgpt.engine.layout import ChunkSpec, chunk_layout
from fitgpt.engine.state_io import Reader, StateReader, open_reader
from fitgpt.errors import UserError
from fitgpt.interop.hf_read import open_hf
from fitgpt.interop.init_source import find_source
from fitgpt.model import ModelConfig, build_model
from fitgpt.train import checkpoint as ckpt_io
from fitgpt.train.init_from import free_fields
from fitgpt.train.resume import same_base

DTYPES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}


def adapter_of(meta: dict) -> AdapterConfig | None:
    """The adapter a checkpoint's run trained, None for a run that trained the whole model."""
    a = AdapterConfig(**meta["config"].get("adapter", {}))
    return a if a.active else None


def adapter_tensors(ckpt: Path, meta: dict) -> dict[str, Tensor]:
    """The adapters of checkpoint `ckpt` by their names in the model, fp32 (CRC-checked)."""
    reader = StateReader(ckpt)
    out = {}
    with ckpt_io.pointing_back(ckpt):
        for c in (ChunkSpec.from_dict(d) for d in meta["layout"]):
            flat = reader.read(c.index, "master", 0, c.numel)
            for s in c.slots:
                out[s.name] = flat[s.offset : s.offset + s.numel].view(s.shape).clone()
    return out


@dataclass(frozen=True)
class Merged:
    """The base of an adapter checkpoint with its adapters merged in, read by chunk."""

    reader: Reader  # read(chunk, "master", lo, hi) of `layout`
    layout: list[ChunkSpec]  # the whole model's chunks
    dtype: str  # the base's: fp32, bf16 or fp16


def merged(ckpt: Path, meta: dict, cfg: ModelConfig) -> Merged:
    """Checkpoint `ckpt`'s base (its --init-from source, opened again and checked to hold the
    model the run trained) with its adapters merged in."""
    adapter = adapter_of(meta)
    path = meta.get("init_from")
    if adapter is None or not path:
        raise UserError(f"{ckpt} holds no LoRA adapters over a base; there is nothing to merge")
    if not Path(path).exists():  # find_source's line would name --init-from, which we lack
        raise UserError(
            f"{ckpt}: its base {path} (the run's --init-from) is gone, and the adapters merge "
            "into it; put that model back there, or export the adapters alone (--format peft)"
        )
    source = find_source(path)
    kept = {k: getattr(cfg, k) for k in free_fields(source.model)}
    if dataclasses.replace(source.model, **kept) != cfg:
        raise UserError(
            f"{ckpt}: its base {path} holds another model now; put the base the adapters were "
            "trained on back there"
        )
    if not same_base(meta, path):
        raise UserError(
            f"{ckpt}: its base {path} holds other weights now than the adapters were trained "
            "on (a model of the same shape saved there); put that base back, or export the "
            "adapters alone (--format peft)"
        )
    with torch.device("meta"):
        layout = chunk_layout(build_model(cfg))
    if source.weights is not None:  # a Hugging Face folder, read in place in its dtype
        base, dtype = open_reader(source.weights), DTYPES.get(_hf_dtype(source.path), "fp32")
    else:  # a fitgpt checkpoint: fp32 weights, its layout the model's
        base_meta = ckpt_io.load_meta(source.path)
        ckpt_io.check_layout(base_meta, layout, source.path)
        base, dtype = StateReader(source.path), "fp32"
    tensors = adapter_tensors(ckpt, meta)
    reader = MergedReader(base, layout, lora_targets(cfg, adapter), tensors, adapter.scale)
    return Merged(reader, layout, dtype)


def merged_base(path: Path) -> Merged | None:
    """The run or checkpoint at `path` merged (`merged`) when it is an adapter run's; None for
    one that trained the whole model (generate and export --format fitgpt read it as it is)."""
    ckpt = ckpt_io.resolve_held(path)
    meta = ckpt_io.load_meta(ckpt)
    if adapter_of(meta) is None:
        return None
    return merged(ckpt, meta, ModelConfig.from_dict(meta["config"]["model"]))


def _hf_dtype(path: Path) -> torch.dtype:
    """The dtype a Hugging Face folder stores its weights in (its embedding's)."""
    ckpt = open_hf(path)
    first = next(m.hf for m in ckpt.maps if m.fitgpt is not None)
    return ckpt.weights.dtype(first)
