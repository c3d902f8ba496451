"""What `fitgpt export --format hf` carries over from the Hugging Face model a checkpoint came
from: the fields of its config.json that fitgpt's model did not change, and its
generation_config.json.

The rule, one decision: fitgpt writes the whole config.json of the model it holds (the family's
hf_config: shapes, vocabulary, rotary settings, the tied head, architectures, the dtype it
writes, the bos/eos ids hf_export.py decides), then puts back each field of the source's
config.json wherever the result still reads, through the family's own config_from_hf, as the
same model. So pad_token_id, initializer_range, use_cache, a Qwen sliding_window that
use_sliding_window turns off, task_specific_params and any key fitgpt never reads come back as
they were, and a field a fine-tune did change (a router_aux_loss_coef given by flag) stays
fitgpt's. The config.json read back is, by construction, the model fitgpt exports: a source
field that would change it is never carried, nor one the family owns (HFMapping.owned: GPT-2's
activation_function, where import takes gelu_new for the tanh GELU fitgpt runs and export names
that kernel). STORAGE keys are never carried: they describe the source's files (MXFP4 experts,
its dtype, the transformers that wrote it), not the model.

The source's config.json is, nearest first along the checkpoint's lineage
(train/checkpoint.py), the one `fitgpt import hf` recorded in meta.json (imported_from.config),
else the folder `--init-from` read, still there and still describing this model (its reading
equals the checkpoint's up to the fields a fine-tune may change: train/init_from.py
free_fields). A run trained from a preset has none: the export is fitgpt's defaults alone.
That folder's generation_config.json, where the config was read from a folder, is carried when
the tokenizer's folder holds none (hf_export.py _special_ids). Cost: one config_from_hf per
source field that differs, pure Python on a few dozen keys.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from fitgpt.errors import UserError
from fitgpt.model import ModelConfig
from fitgpt.model.hf_map import HFMapping
from fitgpt.train import checkpoint as ckpt_io
from fitgpt.train.init_from import free_fields, table_pinned

# how the source stored its weights and which program wrote the file: the export's own
STORAGE = ("dtype", "torch_dtype", "quantization_config", "transformers_version", "_name_or_path")
MISSING = object()
CONFIG = "config.json"


def carry_source(written: dict, source: dict, mapping: HFMapping, where: str) -> dict:
    """`written` (fitgpt's config.json) with each field of `source` (the source's) put back
    where `mapping` reads the result as the same model (see the module docstring)."""
    if not source:  # a model trained from a preset: fitgpt's config alone
        return written
    out = dict(written)
    want = mapping.config_from_hf(out, where)
    for key, value in source.items():
        if key in STORAGE or key in mapping.owned or out.get(key, MISSING) == value:
            continue
        trial = out | {key: value}
        try:
            same = mapping.config_from_hf(trial, where) == want
        except UserError:  # a value fitgpt's reading refuses describes no model it holds
            same = False
        if same:
            out = trial
    return out


@dataclasses.dataclass(frozen=True)
class Source:
    """The Hugging Face model a checkpoint came from, as far as the export carries it."""

    config: dict  # its config.json; {} when there is none
    generation: dict  # its folder's generation_config.json; {} when none or no folder


def source_of(meta: dict, cfg: ModelConfig) -> Source:
    """The nearest Hugging Face model checkpoint `meta` (of model `cfg`) came from: its
    config.json recorded or read again (see the module docstring), and the generation_config.json
    of its folder when that is where it was read."""
    from fitgpt.interop.hf import mapping_for_hf

    links: list[tuple[dict | None, Path | None]] = [(_recorded(meta), None)]
    for path, link_meta in ckpt_io.lineage(meta):
        folder = path if path.is_dir() else path.parent
        links.append(
            (_recorded(link_meta), None)
            if link_meta is not None
            else (_json(folder, CONFIG), folder)
        )
    for hf, folder in links:
        if hf is None:
            continue
        try:
            model = mapping_for_hf(hf, CONFIG).config_from_hf(hf, CONFIG)
        except UserError:
            continue
        if _describes(model, cfg):
            generation = _json(folder, "generation_config.json") if folder else None
            return Source(hf, generation or {})
    return Source({}, {})


def _recorded(meta: dict) -> dict | None:
    """The config.json `fitgpt import hf` recorded in meta.json, if any."""
    found = (meta.get("imported_from") or {}).get("config")
    return found if isinstance(found, dict) else None


def _describes(model: ModelConfig, cfg: ModelConfig) -> bool:
    """Whether a source config's reading `model` is the model `cfg` up to what a fine-tune may
    set (free_fields) and the head the weights hold (an import keeps a head untied where
    config.json says tied but the weights hold their own: hf_read.py stored_head)."""
    model, cfg = table_pinned(model), table_pinned(cfg)
    kept = {k: getattr(cfg, k) for k in (*free_fields(model), "tie_embeddings")}
    return dataclasses.replace(model, **kept) == cfg


def _json(folder: Path, name: str) -> dict | None:
    try:
        found = json.loads((folder / name).read_text())
    except (OSError, ValueError, RecursionError):
        return None
    return found if isinstance(found, dict) else None
