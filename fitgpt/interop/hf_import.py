"""`fitgpt import hf`: a Hugging Face checkpoint (GPT-2, Llama, Qwen2, Qwen3, Mistral: the
mappings of hf.py) as a fitgpt run holding weights only.

The run gets one checkpoint, RUN/step_00000000/, in the engines' own state format (state_io: one
safetensors file per chunk, fp32 `master` only) and a meta.json like the trainer's with
`"optimizer_state": false`: whatever engine, ZeRO stage, placement and world size loads it
starts the optimizer fresh. The HF tokenizer files, generation_config.json and any chat
template are copied to RUN/tokenizer/.

Memory: the model is never held twice. Tensors are read one at a time (from safetensors by plain
file reads of that tensor's bytes, see safetensors_stream.py; a pytorch_model.bin is
memory-mapped, so its pages stay resident but reclaimable), and only one chunk's flat fp32
buffer is assembled at a time, written, and freed: peak host RAM is a small multiple of the
largest chunk (its buffer, the tensor being read, the copy safetensors makes while writing; the
previous chunk until the writer lets it go), never the model. A parameter fitgpt fuses (Llama's
k and v, gate and up) is assembled in the chunk's buffer from its HF tensors, one at a time.
Measured: 0.74 GiB peak RSS for a 204 M-parameter model
(0.81 GB of fp32 weights), 0.29 GiB of it torch itself.
"""

from __future__ import annotations

import json
import os
import resource
import shutil
import time
import zipfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor

from fitgpt.engine.layout import ChunkSpec, chunk_layout
from fitgpt.engine.state_io import Piece, write_pieces
from fitgpt.errors import UserError
from fitgpt.interop.hf import HFMapping, TensorMap, copy_to_fitgpt, hf_shape, mapping_for_hf
from fitgpt.interop.hf_tokenizer import copy_hf_tokenizer
from fitgpt.interop.safetensors_stream import SafetensorsError, SafetensorsReader
from fitgpt.model import DecoderLM, ModelConfig, build_model
from fitgpt.model.config import GPT2_VOCAB
from fitgpt.train.checkpoint import write_meta

# In the order they are looked for: one file, or an index over shards, safetensors first.
WEIGHT_FILES = (
    "model.safetensors",
    "model.safetensors.index.json",
    "pytorch_model.bin",
    "pytorch_model.bin.index.json",
)
CHECKPOINT_DIR = "step_00000000"
TOKENIZER_DIR = "tokenizer"


class HFWeights:
    """The tensors of an HF checkpoint by canonical name (the mapping's spelling), each read
    only when asked for."""

    def __init__(self, files: list[Path], mapping: HFMapping) -> None:
        self.mapping = mapping
        self._where: dict[str, tuple[SafetensorsReader | dict[str, Tensor], str]] = {}
        for f in files:
            h = _open_weights(f)
            for k in h:
                name = mapping.canonical(k)
                if name is not None:
                    self._where[name] = (h, k)

    def names(self) -> set[str]:
        return set(self._where)

    def shape(self, name: str) -> tuple[int, ...] | None:
        if name not in self._where:
            return None
        h, k = self._where[name]
        return tuple(h[k].shape) if isinstance(h, dict) else h.shape(k)

    def blocks(self) -> int:
        """How many transformer blocks the weights hold (the highest block index + 1)."""
        ids = [self.mapping.layer_of(n) for n in self._where]
        return max((i for i in ids if i is not None), default=-1) + 1

    def get(self, name: str) -> Tensor:
        h, k = self._where[name]
        return h[k] if isinstance(h, dict) else h.get(k)


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
    return h


def _load_bin(f: Path) -> dict[str, Tensor]:
    # mmap: the tensors stay in the page cache, read as they are copied, never all in RAM.
    try:
        return torch.load(f, map_location="cpu", weights_only=True, mmap=True)
    except RuntimeError as e:
        if "mmap" not in str(e):
            raise
        return torch.load(f, map_location="cpu", weights_only=True)  # the legacy (pre-1.6) format


# What a weight file given on the command line may be called: its format is told by its name.
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".index.json")


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
    weights: HFWeights, model: DecoderLM, cfg: ModelConfig, source: Path, maps: list[TensorMap]
) -> None:
    """Every tensor the model needs is there with the right shape, and none is left over (a
    bias or norm fitgpt's network lacks would be dropped silently), before anything is
    written."""
    shapes = {n: tuple(p.shape) for n, p in model.named_parameters()}
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
    # a tied model's stored lm_head is ignored, as transformers ignores it (the embedding wins)
    extra = sorted(weights.names() - {m.hf for m in maps} - {"lm_head.weight"})
    if extra:
        raise UserError(
            f"{source}: tensor {extra[0]}{f' and {len(extra) - 1} more' if len(extra) > 1 else ''}"
            f" has no place in a {arch} as config.json describes it; is config.json this "
            "checkpoint's own?"
        )


def chunk_pieces(
    weights: HFWeights,
    layout: list[ChunkSpec],
    cfg: ModelConfig,
    maps: list[TensorMap],
    progress: Callable[[int, int], None] | None = None,
) -> Iterator[Piece]:
    """Each chunk's fp32 flat buffer, assembled from HF tensors one at a time (a fused
    parameter from each of its HF tensors in turn)."""
    by_name: dict[str, list[TensorMap]] = {}
    for m in maps:
        if m.fitgpt is not None:
            by_name.setdefault(m.fitgpt, []).append(m)
    for c in layout:
        flat = torch.empty(c.numel, dtype=torch.float32)
        for s in c.slots:
            for m in by_name[s.name]:
                t = weights.get(m.hf)
                copy_to_fitgpt(m, t, flat[s.offset : s.offset + s.numel].view(s.shape))
                del t  # freed before the next tensor is read
        yield Piece(c.index, 0, c.numel, {"master": flat})
        if progress is not None:
            progress(c.index + 1, len(layout))


def check_output(out: Path, overwrite: bool, needed_bytes: int) -> None:
    if out.exists() and (not out.is_dir() or any(out.iterdir())) and not overwrite:
        raise UserError(f"--out {out} exists and is not empty; pass --overwrite or another --out")
    probe = out.parent if out.parent.exists() else Path.cwd()
    free = shutil.disk_usage(probe).free
    if free < needed_bytes:
        raise UserError(
            f"--out {out}: {free / 2**30:.1f} GiB free, the fp32 weights need "
            f"{needed_bytes / 2**30:.1f} GiB; free space or choose another disk"
        )


@dataclass(frozen=True)
class ImportResult:
    ckpt: Path
    cfg: ModelConfig
    tokenizer: str | None
    seconds: float
    peak_rss_bytes: int


def import_hf(
    src: Path,
    out: Path,
    overwrite: bool = False,
    progress: Callable[[int, int], None] | None = None,
) -> ImportResult:
    """Write the HF checkpoint `src` as the fitgpt run `out` (see the module docstring)."""
    t0 = time.perf_counter()
    config_path, files = locate(src)
    hf_cfg = read_config(config_path)
    mapping = mapping_for_hf(hf_cfg, str(config_path))
    cfg = mapping.config_from_hf(hf_cfg, str(config_path))
    check_output(out, overwrite, 4 * cfg.num_params() + 2**20)
    # headers only: cheap, and refuses damaged files before any work
    weights = HFWeights(files, mapping)
    if weights.blocks() != cfg.n_layer:  # before the model is built: n_layer may be absurd
        raise UserError(
            f"{config_path}: {mapping.layers_key}={cfg.n_layer}, but the weights hold "
            f"{weights.blocks()} blocks; the config and the weights are of different models"
        )
    with torch.device("meta"):
        model = build_model(cfg)
    maps = mapping.tensor_maps(cfg)
    check_tensors(weights, model, cfg, src, maps)
    layout = chunk_layout(model)

    tmp = out.parent / f".{out.name}.import.tmp"
    shutil.rmtree(tmp, ignore_errors=True)  # leftovers of a crashed import are never valid
    (tmp / CHECKPOINT_DIR).mkdir(parents=True)
    try:
        spec = _import_tokenizer(config_path.parent, tmp / TOKENIZER_DIR, out, cfg, hf_cfg)
        step = tmp / CHECKPOINT_DIR
        write_pieces(step, 0, chunk_pieces(weights, layout, cfg, maps, progress))
        meta = imported_meta(cfg, layout, spec, out, src, hf_cfg)
        meta["imported_from"]["format"] = mapping.import_format
        write_meta(step, meta)
        _swap_into_place(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB
    return ImportResult(out / CHECKPOINT_DIR, cfg, spec, time.perf_counter() - t0, peak)


def _import_tokenizer(
    src: Path, dest: Path, out: Path, cfg: ModelConfig, hf_cfg: dict
) -> str | None:
    """The run's tokenizer spec: its copied files, else GPT-2's for a GPT-2 of 50257 tokens.

    generation_config.json travels with the tokenizer files (export writes it back); where the
    checkpoint has none, one is written from config.json's bos/eos ids, so they are not lost."""
    if copy_hf_tokenizer(src, dest):
        gen = dest / "generation_config.json"
        ids = {k: hf_cfg[k] for k in ("bos_token_id", "eos_token_id") if hf_cfg.get(k) is not None}
        if not gen.is_file() and ids:
            gen.write_text(json.dumps(ids, indent=2))
        return str((out / TOKENIZER_DIR).resolve())
    gpt2 = cfg.family == "gpt2" and cfg.vocab_size == GPT2_VOCAB
    return "gpt2" if gpt2 else None


def _swap_into_place(tmp: Path, out: Path) -> None:
    """Rename the finished run into place; an old one is moved aside first, deleted after."""
    old = out.parent / f".{out.name}.import.old"
    if out.exists():
        os.replace(out, old)
    os.replace(tmp, out)
    shutil.rmtree(old, ignore_errors=True)


def imported_meta(
    cfg: ModelConfig,
    layout: list[ChunkSpec],
    tokenizer: str | None,
    out: Path,
    src: Path,
    hf_cfg: dict,
) -> dict:
    """meta.json as train/checkpoint.py writes it, for a weights-only checkpoint at step 0
    (write_meta adds the format, file sizes and checksums)."""
    from fitgpt.data.config import DataConfig
    from fitgpt.engine.config import EngineConfig, OptimConfig, PrecisionConfig
    from fitgpt.train.config import RunConfig, TrainConfig
    from fitgpt.train.schedule import default_lr, end_lr

    data = DataConfig(tokenizer=tokenizer) if tokenizer else DataConfig()
    lr = default_lr(cfg.n_embd)  # what `fitgpt train` would default to for this model
    train = TrainConfig(out=str(out), lr=lr, min_lr=end_lr(lr))
    run = RunConfig(cfg, data, train, EngineConfig(), PrecisionConfig(), OptimConfig())
    return {
        "step": 0,
        "world": 1,
        "layout": [c.to_dict() for c in layout],
        "engine_state": {"optimizer_step": 0},
        "optimizer_state": False,
        "config": run.to_dict(),
        "tokenizer": tokenizer,
        "trainer": {"step": 0, "skipped": 0, "data": {"position": 0}},
        "imported_from": {"format": "hf-gpt2", "path": str(src.resolve()), "config": hf_cfg},
    }
