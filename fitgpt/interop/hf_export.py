"""`fitgpt export --format hf`: a checkpoint as a folder that transformers loads offline.

The folder holds config.json (GPT2LMHeadModel), model.safetensors (HF names and Conv1D layout,
the vocabulary cut back to the tokenizer's size), generation_config.json (the end-of-document
token as eos) and the tokenizer files (hf_tokenizer.py), so that
`GPT2LMHeadModel.from_pretrained(DIR)` and `AutoTokenizer.from_pretrained(DIR)` work offline.
It is written into a temporary folder that is renamed into place when complete.

Memory: the weights stream from the checkpoint's chunk files into the safetensors file one chunk
at a time (safetensors_stream.py), so exporting needs about one chunk of host RAM, whatever the
size of the model.
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch

from fitgpt.data.tokenizer import load_tokenizer
from fitgpt.engine.layout import ChunkSpec
from fitgpt.engine.state_io import StateReader
from fitgpt.errors import UserError
from fitgpt.interop.hf import check_exportable, hf_config, hf_shape, tensor_maps, to_hf
from fitgpt.interop.hf_tokenizer import write_hf_tokenizer
from fitgpt.interop.safetensors_stream import SafetensorsWriter
from fitgpt.model import ModelConfig
from fitgpt.train import checkpoint as ckpt_io

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
HF_DTYPE_NAMES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}


@dataclass(frozen=True)
class ExportResult:
    out: Path
    cfg: ModelConfig
    params: int  # values written, biases of a bias-free model (zeros) included
    tokenizer: str | None  # what was written, in words; None when the run has no tokenizer


def check_output(out: Path, overwrite: bool) -> None:
    if out.exists() and not overwrite:
        raise UserError(f"--out {out} already exists; pass --overwrite to replace it")


def export_hf(
    ckpt_path: Path,
    out: Path,
    dtype: str = "fp32",
    overwrite: bool = False,
    tokenizer: str | None = None,
) -> ExportResult:
    """Write checkpoint (or newest of run) `ckpt_path` as the HF folder `out`."""
    ckpt = ckpt_io.resolve(ckpt_path)
    meta = ckpt_io.load_meta(ckpt)
    cfg = ModelConfig.from_dict(meta["config"]["model"])
    check_exportable(cfg)
    check_output(out, overwrite)
    spec = tokenizer or meta.get("tokenizer")
    eos_id = _check_tokenizer(spec, cfg)
    tmp = out.parent / f".{out.name}.export.tmp"
    shutil.rmtree(tmp, ignore_errors=True)  # leftovers of a crashed export are never valid
    tmp.mkdir(parents=True)
    try:
        n = write_weights(tmp / "model.safetensors", ckpt, meta, cfg, DTYPES[dtype])
        config = hf_config(cfg, eos_id) | {"dtype": HF_DTYPE_NAMES[dtype]}
        (tmp / "config.json").write_text(json.dumps(config, indent=2))
        if eos_id is not None:
            gen = {"bos_token_id": eos_id, "eos_token_id": eos_id}
            (tmp / "generation_config.json").write_text(json.dumps(gen, indent=2))
        written = write_hf_tokenizer(spec, tmp, cfg.seq_len)
        old = out.parent / f".{out.name}.export.old"
        if out.exists():  # --overwrite: the old output goes only once the new one is complete
            os.replace(out, old)
        os.replace(tmp, out)
        shutil.rmtree(old, ignore_errors=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return ExportResult(out, cfg, n, written)


def _check_tokenizer(spec: str | None, cfg: ModelConfig) -> int | None:
    """The tokenizer's end-of-document id; refuse one with more tokens than the model has."""
    if spec is None:
        return None
    tok = load_tokenizer(spec)
    if tok.vocab_size > cfg.vocab_size:
        raise UserError(
            f"tokenizer {spec} has {tok.vocab_size} tokens, the model's vocabulary "
            f"{cfg.vocab_size}; pass --tokenizer with the one the model was trained with"
        )
    return tok.eod_id


def _hf_shapes(cfg: ModelConfig, layout: list[ChunkSpec]) -> dict[str, tuple[int, ...]]:
    """Every HF tensor's shape; a zero bias (bias=False) takes its weight's output size."""
    fit_shapes = {s.name: s.shape for c in layout for s in c.slots}
    shapes: dict[str, tuple[int, ...]] = {}
    for m in tensor_maps(cfg):
        if m.fitgpt is not None:
            if m.fitgpt not in fit_shapes:
                raise UserError(f"checkpoint lacks parameter {m.fitgpt}; is it damaged?")
            shapes[m.hf] = hf_shape(m, fit_shapes[m.fitgpt], cfg)
            continue
        w = shapes[m.hf.removesuffix(".bias") + ".weight"]  # maps list each weight first
        shapes[m.hf] = (w[-1],)  # Conv1D [in, out] and LayerNorm [H] alike: the last dim
    return shapes


def write_weights(path: Path, ckpt: Path, meta: dict, cfg: ModelConfig, dtype: torch.dtype) -> int:
    """model.safetensors in HF names and layout, streamed chunk by chunk; values written."""
    layout = [ChunkSpec.from_dict(d) for d in meta["layout"]]
    where = {s.name: (c, s) for c in layout for s in c.slots}
    shapes = _hf_shapes(cfg, layout)
    maps = tensor_maps(cfg)
    reader = StateReader(ckpt)
    held, flat = -1, torch.empty(0)
    entries = [(m.hf, shapes[m.hf]) for m in maps]
    with SafetensorsWriter(path, entries, dtype, {"format": "pt"}) as writer:
        for m in maps:  # HF order = chunk order, so each chunk is read once and then dropped
            if m.fitgpt is None:
                writer.write(m.hf, torch.zeros(shapes[m.hf]))
                continue
            c, s = where[m.fitgpt]
            if c.index != held:
                flat = torch.empty(0)  # free the previous chunk before reading the next
                held, flat = c.index, reader.read(c.index, "master", 0, c.numel)
            writer.write(m.hf, to_hf(m, flat[s.offset : s.offset + s.numel].view(s.shape), cfg))
    return sum(int(torch.Size(s).numel()) for s in shapes.values())
