"""A Hugging Face checkpoint read where it lies: opened and checked whole before any weight is
read (`open_hf`), then read range by range in fitgpt's layout (`HFReader`), so that
`fitgpt train --init-from HF_FOLDER` loads it like a fitgpt checkpoint (`HFSource`, a
WeightSource: engine/state_io.py) and `fitgpt import hf` writes one from it (hf_import.py).

The way in, for any range [lo, hi) of a chunk's flat buffer in the loading rank's layout:

  chunk range ─> the parameters (slots) it crosses ─> each one's rows (and, under tensor
  parallelism, the rank's rows or columns of the full parameter: its Split) ─> the HF tensors
  those rows come from (model/hf_map.py TensorMap: fused parts, vocabulary rows, Conv1D transposes)

A run of rows of an HF tensor (row-major) is one contiguous byte range of its safetensors file,
read with plain file reads into a buffer of its own (safetensors_stream.py rows): a ZeRO-3 or
TP rank reads its share of the bytes and no more, and the vocabulary rows fitgpt pads are zeros,
never read. Rows are read SLICE elements at a time, so the transient per read is SLICE × (HF
itemsize + 4) bytes (~24 MiB), whatever the tensor's size. The exceptions hold one HF tensor:
GPT-2's Conv1D weights (stored transposed, so a fitgpt row is an HF column; the last one read is
kept for the next slice) and a pytorch_model.bin (memory-mapped by torch.load: its pages stay
resident but reclaimable).

Cost against a checkpoint: none written, none read back (a Llama-3.1-70B's fp32 copy is 282 GB);
bf16 bytes are read where a checkpoint has fp32, and under TP each rank reads its rows of the
column-parallel weights alone (q, k/v, gate/up, the vocabulary), where a checkpoint's TPReader
reads every chunk whole on every rank. A row-parallel weight (o_proj, down_proj: split by
columns) is read by whole rows and its columns kept: T times its bytes over the TP group, from
the page cache after the first rank (a rank's columns of a row are no contiguous bytes; reading
them row by row would be one small read per row).
"""

from __future__ import annotations

import json
import math
import zipfile
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor

from fitgpt.engine.layout import ChunkSpec, ParamSlot, chunk_layout
from fitgpt.engine.state_io import WeightSource
from fitgpt.errors import UserError
from fitgpt.interop.hf import mapping_for_hf
from fitgpt.interop.safetensors_stream import SafetensorsError, SafetensorsReader
from fitgpt.model import ModelConfig, Split, build_model
from fitgpt.model.hf_map import HFMapping, TensorMap, hf_shape

# In the order they are looked for: one file, or an index over shards, safetensors first.
WEIGHT_FILES = (
    "model.safetensors",
    "model.safetensors.index.json",
    "pytorch_model.bin",
    "pytorch_model.bin.index.json",
)
# What a weight file given on the command line may be called: its format is told by its name.
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".index.json")
SLICE = 1 << 22  # elements per read: 8 MiB of bf16 read, 16 MiB of fp32 made from it


class HFWeights:
    """The tensors of an HF checkpoint by canonical name (the mapping's spelling), each read
    only when asked for, whole or by rows, and refused (file and tensor named) if what is read
    holds NaN or inf: at import, or while `--init-from` loads, before the first step."""

    def __init__(self, files: list[Path], mapping: HFMapping) -> None:
        self.mapping = mapping
        self._where: dict[str, tuple[SafetensorsReader | dict[str, Tensor], str]] = {}
        self._file: dict[str, Path] = {}  # the file each tensor is in, for the errors
        for f in files:
            h = _open_weights(f)
            for k in h:
                name = mapping.canonical(k)
                if name is not None:
                    self._where[name] = (h, k)
                    self._file[name] = f

    def names(self) -> set[str]:
        return set(self._where)

    def shape(self, name: str) -> tuple[int, ...] | None:
        if name not in self._where:
            return None
        h, k = self._where[name]
        return tuple(h[k].shape) if isinstance(h, dict) else h.shape(k)

    def dtype(self, name: str) -> torch.dtype:
        h, k = self._where[name]
        return h[k].dtype if isinstance(h, dict) else h.dtype(k)

    def blocks(self) -> int:
        """How many transformer blocks the weights hold (the highest block index + 1)."""
        ids = [self.mapping.layer_of(n) for n in self._where]
        return max((i for i in ids if i is not None), default=-1) + 1

    def get(self, name: str) -> Tensor:
        h, k = self._where[name]
        return _finite(h[k] if isinstance(h, dict) else h.get(k), self._file[name], k, 0)

    def rows(self, name: str, r0: int, r1: int) -> Tensor:
        """Rows [r0, r1) along dim 0, in the file's dtype; refused in one line naming the file
        and the tensor if any value is NaN or infinite."""
        return _finite(self._rows(name, r0, r1), self._file[name], self._where[name][1], r0)

    def _rows(self, name: str, r0: int, r1: int) -> Tensor:
        h, k = self._where[name]
        return h[k][r0:r1] if isinstance(h, dict) else h.rows(k, r0, r1)

    def equal(self, a: str, b: str) -> bool:
        """Whether tensors `a` and `b` hold the same values (torch.equal, as transformers
        compares two tied weights it finds both stored; here on fp32 copies), read SLICE
        elements at a time and stopped at the first rows that differ: distinct tensors differ
        in their first slice, equal ones cost one read of both. For matrices (an embedding and
        a head)."""
        shape = self.shape(a)
        if shape != self.shape(b):
            return False
        step = max(1, SLICE // max(1, math.prod(shape[1:])))
        for r0 in range(0, shape[0], step):
            r1 = min(r0 + step, shape[0])
            if not torch.equal(self._rows(a, r0, r1).float(), self._rows(b, r0, r1).float()):
                return False
        return True


def _finite(t: Tensor, file: Path, key: str, r0: int) -> Tensor:
    """`t` (rows r0.. of tensor `key` of `file`), or one UserError line if a value is NaN or
    infinite: such weights would make every training step's loss NaN, and every step be
    skipped. One pass over what was just read (a bool per element, ~4 MiB per slice)."""
    bad = ~torch.isfinite(t)
    if bad.any():
        row = r0 + int(bad.reshape(t.shape[0], -1).any(1).nonzero()[0]) if t.dim() else 0
        raise UserError(
            f"{file}: tensor {key} holds NaN or infinite values (first in row {row}); the "
            "weights are damaged: download or convert the checkpoint again"
        )
    return t


def _open_weights(f: Path) -> SafetensorsReader | dict[str, Tensor]:
    """One weight file, its header (safetensors) or its pickle (torch) checked; one UserError
    line naming the file when it is damaged, truncated or of another format."""
    if f.suffix == ".safetensors":
        try:
            return SafetensorsReader(f)
        except SafetensorsError as e:
            raise UserError(f"{f}: {e}") from None
    try:
        h = _load_bin(f)
    except Exception as e:  # a truncated zip, a foreign pickle: torch raises several kinds
        why = (str(e).strip().splitlines() or [type(e).__name__])[0][:120]  # its first line
        if why.startswith("Weights only load failed"):
            why = "it holds objects other than tensors, or is no pickle at all"
        elif not zipfile.is_zipfile(f):  # torch.save writes a zip; a cut one has no directory
            why = "not a complete zip archive: truncated, or not written by torch.save"
        raise UserError(
            f"{f}: not a readable PyTorch checkpoint ({why}); copy or download it again"
        ) from None
    if not isinstance(h, dict) or not all(isinstance(t, Tensor) for t in h.values()):
        raise UserError(f"{f}: holds no state dict of tensors; is it a model checkpoint?")
    bad = [k for k, t in h.items() if not t.is_floating_point()]
    if bad:
        raise UserError(f"{f}: tensor {bad[0]} is {h[bad[0]].dtype}; fitgpt imports float weights")
    return h


def _load_bin(f: Path) -> dict[str, Tensor]:
    # mmap: the tensors stay in the page cache, read as they are copied, never all in RAM.
    try:
        return torch.load(f, map_location="cpu", weights_only=True, mmap=True)
    except RuntimeError as e:
        if "mmap" not in str(e):
            raise
        return torch.load(f, map_location="cpu", weights_only=True)  # the legacy (pre-1.6) format


def locate(src: Path) -> tuple[Path, list[Path]]:
    """config.json and the weight files of an HF checkpoint folder, or of one weight file.

    Every error names `src` as the user typed it (a file's folder is named as its folder)."""
    if not src.exists():
        raise UserError(f"{src} does not exist; pass an HF checkpoint folder or its weight file")
    if src.is_file() and not src.name.endswith(WEIGHT_SUFFIXES):
        raise UserError(
            f"{src} is not a weight file (model.safetensors, pytorch_model.bin or an "
            "*.index.json); pass the checkpoint folder or its weight file"
        )
    folder = src if src.is_dir() else src.parent
    config = folder / "config.json"
    if not config.is_file():
        where = f"{src}" if src.is_dir() else f"{src}: its folder {folder.resolve()}"
        raise UserError(f"{where} has no config.json; an HF checkpoint needs one beside it")
    if src.is_file():
        weights = src
    else:
        found = [folder / n for n in WEIGHT_FILES if (folder / n).is_file()]
        if not found:
            raise UserError(f"{src} holds none of {', '.join(WEIGHT_FILES)}; not a checkpoint")
        weights = found[0]
    if weights.name.endswith(".index.json"):
        return config, _shards(weights, folder)
    return config, [weights]


def _shards(index: Path, folder: Path) -> list[Path]:
    """The shard files an index names, each checked to be there (before any is read)."""
    try:
        names = set(json.loads(index.read_text())["weight_map"].values())
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        raise UserError(f"{index}: not a valid shard index ({type(e).__name__}: {e})") from None
    if not names or not all(isinstance(n, str) and n and Path(n).name == n for n in names):
        raise UserError(f"{index}: weight_map must name shard files of its own folder; fix it")
    missing = sorted(n for n in names if not (folder / n).is_file())
    if missing:
        raise UserError(
            f"{index} names {len(missing)} shard(s) missing from {folder.resolve()} "
            f"({', '.join(missing[:3])}); download every shard"
        )
    return [folder / n for n in sorted(names)]


def read_config(path: Path) -> dict:
    try:
        cfg = json.loads(path.read_text())
    except (OSError, ValueError, RecursionError) as e:  # bad UTF-8 is a ValueError too
        raise UserError(f"{path} is not valid JSON ({e}); fix the file") from None
    if not isinstance(cfg, dict):
        raise UserError(f"{path} is not a JSON object; is it an HF config.json?")
    return cfg


def check_tensors(
    weights: HFWeights, shapes: dict[str, tuple[int, ...]], cfg: ModelConfig, source: Path,
    maps: list[TensorMap],
) -> None:  # fmt: skip
    """Every tensor the model needs is there with the right shape, and none is left over (a
    bias or norm fitgpt's network lacks would be dropped silently), before anything is read."""
    arch = weights.mapping.architecture(cfg)
    for m in maps:
        want = hf_shape(m, shapes[m.fitgpt], cfg)
        got = weights.shape(m.hf)
        if got is None:
            hint = " (config.json says tie_word_embeddings=false)" if "lm_head" in m.hf else ""
            raise UserError(f"{source}: tensor {m.hf} is missing{hint}; not a {arch} checkpoint?")
        if got != want:
            raise UserError(
                f"{source}: tensor {m.hf} has shape {list(got)}, config.json implies {list(want)}"
            )
    # a tied model's stored lm_head equals its embedding (stored_head): nothing is lost
    extra = sorted(weights.names() - {m.hf for m in maps} - {"lm_head.weight"})
    if extra:
        raise UserError(
            f"{source}: tensor {extra[0]}{f' and {len(extra) - 1} more' if len(extra) > 1 else ''}"
            f" has no place in a {arch} as config.json describes it; is config.json this "
            "checkpoint's own?"
        )


def stored_head(cfg: ModelConfig, weights: HFWeights) -> ModelConfig:
    """`cfg`, untied where config.json says tie_word_embeddings=true but the weights hold an
    lm_head.weight other than the embedding: transformers 5 then keeps both and does not tie
    them (modeling_utils tie_weights: "both are present in the checkpoints with different
    values"), so the model computes with the stored head, and so must fitgpt's. A stored head
    equal to the embedding (a .bin saves both) stays tied. Costs reading the first slice of
    each, or both whole when they are equal."""
    if not cfg.tie_embeddings or "lm_head.weight" not in weights.names():
        return cfg
    embed = next(m.hf for m in weights.mapping.tensor_maps(cfg) if m.fitgpt == "wte.weight")
    if embed not in weights.names() or weights.equal(embed, "lm_head.weight"):
        return cfg  # a missing embedding is named by check_tensors
    return cfg.replace(tie_embeddings=False)


@dataclass
class HFCheckpoint:
    """An HF checkpoint opened and checked: config, mapping, headers, the maps of its tensors
    and fitgpt's chunk layout of the model (unsplit)."""

    src: Path
    config_path: Path
    hf_cfg: dict
    mapping: HFMapping
    cfg: ModelConfig
    weights: HFWeights
    maps: list[TensorMap]
    layout: list[ChunkSpec]


def open_hf(src: Path, cfg: ModelConfig | None = None) -> HFCheckpoint:
    """The checkpoint at `src`, refused in one line before any weight is read when a shard is
    missing, a file is damaged or of a dtype other than float, the layer count or any tensor's
    shape disagrees with config.json, or a tensor has no place. Headers only: a few hundred
    bytes per tensor (and the embedding's and a stored head's first rows where config.json
    ties them: stored_head). `cfg`: the model to read it as (a fine-tune's; by default
    config.json's, as transformers reads it); it must differ from that in fields no weight
    depends on only."""
    config_path, files = locate(src)
    hf_cfg = read_config(config_path)
    mapping = mapping_for_hf(hf_cfg, str(config_path))
    weights = HFWeights(files, mapping)  # every header checked whole
    given, cfg = cfg, cfg or mapping.config_from_hf(hf_cfg, str(config_path))
    if weights.blocks() != cfg.n_layer:  # before the model is built: n_layer may be absurd
        raise UserError(
            f"{config_path}: {mapping.layers_key}={cfg.n_layer}, but the weights hold "
            f"{weights.blocks()} blocks; the config and the weights are of different models"
        )
    if given is None:  # a given config (HFSource's) was read from this folder already
        cfg = stored_head(cfg, weights)
    with torch.device("meta"):
        model = build_model(cfg)
    shapes = {n: tuple(p.shape) for n, p in model.named_parameters()}
    maps = mapping.tensor_maps(cfg)
    check_tensors(weights, shapes, cfg, src, maps)
    return HFCheckpoint(src, config_path, hf_cfg, mapping, cfg, weights, maps, chunk_layout(model))


# ---- fitgpt's ranges from HF's rows ---------------------------------------------------------
def _runs(split: Split | None, full: int, dim: int, rank: int, tp: int) -> list[tuple[int, int]]:
    """(first, count) of each run of the full parameter's indices along `dim` that rank `rank`
    holds, in its local order (parallel/shard.py shard_of: each of the split's parts cut in tp)."""
    if split is None or split.dim != dim or tp == 1:
        return [(0, full)]
    part = full // split.parts
    return [(k * part + rank * part // tp, part // tp) for k in range(split.parts)]


class HFReader:
    """StateReader's read() of an HF checkpoint, `master` only, in the layout of this rank:
    `local` (its tensor-parallel split, rank `tp_rank` of `tp`) or the unsplit model's."""

    def __init__(
        self, ckpt: HFCheckpoint, local: list[ChunkSpec] | None = None, tp_rank: int = 0,
        tp: int = 1,
    ) -> None:  # fmt: skip
        self.w, self.tp_rank, self.tp = ckpt.weights, tp_rank, tp
        self.local = local if local is not None else ckpt.layout
        self.full: dict[str, ParamSlot] = {s.name: s for c in ckpt.layout for s in c.slots}
        self.maps: dict[str, list[TensorMap]] = {}
        for m in ckpt.maps:
            if m.fitgpt is not None:
                self.maps.setdefault(m.fitgpt, []).append(m)
        self.vocab = ckpt.cfg.vocab_size
        self._whole: tuple[str, Tensor] | None = None  # the last transposed tensor read

    def read(self, chunk: int, kind: str, lo: int, hi: int, out: Tensor | None = None) -> Tensor:
        """Elements [lo, hi) of chunk `chunk`'s flat fp32 buffer (this rank's layout)."""
        if kind != "master":  # engines ask for moments only of checkpoints that hold them
            raise UserError(f"a Hugging Face checkpoint holds weights only, no {kind}")
        if out is None:
            out = torch.empty(hi - lo, dtype=torch.float32)
        for s in self.local[chunk].slots:
            a, b = max(lo, s.offset), min(hi, s.offset + s.numel)
            if a < b:
                self._slot(s, a - s.offset, b - s.offset, out[a - lo : b - lo])
        return out

    def _slot(self, s: ParamSlot, a: int, b: int, dst: Tensor) -> None:
        """Elements [a, b) of local parameter `s` (row-major, as [rows, cols]) into `dst`."""
        f = self.full[s.name]
        full_cols = math.prod(f.shape[1:])
        cols = math.prod(s.shape[1:])
        col_runs = _runs(f.split, full_cols, 1, self.tp_rank, self.tp) if f.shape[1:] else None
        step = max(1, SLICE // full_cols)  # full rows per read
        local_row = 0
        for first, count in _runs(f.split, f.shape[0], 0, self.tp_rank, self.tp):
            # local rows [local_row, local_row + count) are full rows [first, first + count)
            r0 = max(local_row, a // cols)
            r1 = min(local_row + count, -(-b // cols))
            for x in range(r0, r1, step):
                y = min(x + step, r1)
                rows = self._full_rows(s.name, first + x - local_row, first + y - local_row)
                if col_runs is not None and cols != full_cols:
                    rows = torch.cat([rows[:, c0 : c0 + n] for c0, n in col_runs], dim=1)
                flat = rows.reshape(-1)  # local elements [x·cols, y·cols)
                e0, e1 = max(a, x * cols), min(b, y * cols)
                dst[e0 - a : e1 - a].copy_(flat[e0 - x * cols : e1 - x * cols])
                del rows, flat  # freed before the next slice is read
            local_row += count

    def _full_rows(self, name: str, r0: int, r1: int) -> Tensor:
        """Rows [r0, r1) of full fitgpt parameter `name`, fp32 [r1 - r0, cols]: each from the HF
        tensor whose part holds it, vocabulary rows beyond HF's zero."""
        shape = self.full[name].shape
        out = torch.zeros(r1 - r0, math.prod(shape[1:]), dtype=torch.float32)
        for m in self.maps[name]:
            i, n = m.part or (0, 1)
            base = i * shape[0] // n  # the part's first row in the fitgpt parameter
            h0, h1 = max(r0, base) - base, min(r1, base + shape[0] // n) - base
            if m.vocab_rows:
                h1 = min(h1, self.vocab)  # the padded rows stay zero
            if h0 >= h1:
                continue
            if m.transpose:  # Conv1D [in, out]: fitgpt's rows are its columns
                src = self._whole_tensor(m.hf)[:, h0:h1].t()
            else:
                src = self.w.rows(m.hf, h0, h1)
            at = base + h0 - r0
            out[at : at + h1 - h0].copy_(src.reshape(h1 - h0, -1))  # bf16/fp16 -> fp32 exactly
        return out

    def _whole_tensor(self, name: str) -> Tensor:
        if self._whole is None or self._whole[0] != name:
            self._whole = None  # the previous one freed before the next is read
            self._whole = (name, self.w.get(name))
        return self._whole[1]


@dataclass(frozen=True)
class HFSource(WeightSource):
    """`--init-from HF_FOLDER`: each rank opens the checkpoint (headers, checked again: cheap)
    and reads its own ranges of it. Holds paths and a config only, so it travels to spawned
    ranks."""

    path: Path
    cfg: ModelConfig

    def reader(self, local: list[ChunkSpec] | None, tp_rank: int, tp: int) -> HFReader:
        return HFReader(open_hf(self.path, self.cfg), local, tp_rank, tp)
