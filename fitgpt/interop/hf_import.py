"""`fitgpt import hf`: a Hugging Face checkpoint (GPT-2, Llama, Qwen2, Qwen3, Mistral: the
mappings of hf.py) as a fitgpt run holding weights only.

The run gets one checkpoint, RUN/step_00000000/, in the engines' own state format (state_io: one
safetensors file per chunk, fp32 `master` only) and a meta.json like the trainer's with
`"optimizer_state": false`: whatever engine, ZeRO stage, placement and world size loads it
starts the optimizer fresh. The HF tokenizer files, generation_config.json and any chat
template are copied to RUN/tokenizer/.

Memory: the model is never held twice. The weights are read through hf_read.py's HFReader
(runs of rows by plain file reads, ~100 MiB at a time; a pytorch_model.bin is memory-mapped, its
pages resident but reclaimable), and only one chunk's flat fp32 buffer is assembled at a time,
written, and freed: peak host RAM is a small multiple of the largest chunk (its buffer, the
slice being read, the copy safetensors makes while writing; the previous chunk until the writer
lets it go), never the model. A parameter fitgpt fuses (Llama's k and v, gate and up) is
assembled in the chunk's buffer from its HF tensors, one at a time.
Measured: 0.74 GiB peak RSS for a 204 M-parameter model
(0.81 GB of fp32 weights), 0.29 GiB of it torch itself.
"""

from __future__ import annotations

import json
import resource
import shutil
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from fitgpt.engine.layout import ChunkSpec
from fitgpt.engine.state_io import Piece, write_pieces
from fitgpt.errors import UserError
from fitgpt.interop.hf_read import HFCheckpoint, HFReader, open_hf
from fitgpt.interop.hf_tokenizer import copy_hf_tokenizer, holds_vocabulary
from fitgpt.model import ModelConfig
from fitgpt.model.config import GPT2_VOCAB
from fitgpt.paths import folder_in_place
from fitgpt.train.checkpoint import write_meta

CHECKPOINT_DIR = "step_00000000"
TOKENIZER_DIR = "tokenizer"


def chunk_pieces(
    ckpt: HFCheckpoint, progress: Callable[[int, int], None] | None = None
) -> Iterator[Piece]:
    """Each chunk's fp32 flat buffer, read through the HF reader (hf_read.py: the same
    conversion `--init-from` loads through), one chunk at a time."""
    reader = HFReader(ckpt)
    for c in ckpt.layout:
        yield Piece(c.index, 0, c.numel, {"master": reader.read(c.index, "master", 0, c.numel)})
        if progress is not None:
            progress(c.index + 1, len(ckpt.layout))


def check_output(out: Path, overwrite: bool, needed_bytes: int) -> None:
    if out.exists() and (not out.is_dir() or any(out.iterdir())) and not overwrite:
        raise UserError(f"--out {out} exists and is not empty; pass --overwrite or another --out")
    from fitgpt.train.rundir import check_overwritable

    check_overwritable(out)  # --overwrite replaces it whole: a run folder only
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
    # where the model read differs from what config.json says, in words (transformers warns)
    note: str | None = None


def import_hf(
    src: Path,
    out: Path,
    overwrite: bool = False,
    progress: Callable[[int, int], None] | None = None,
) -> ImportResult:
    """Write the HF checkpoint `src` as the fitgpt run `out` (see the module docstring)."""
    t0 = time.perf_counter()
    ckpt = open_hf(src)  # headers only: cheap, and refuses a damaged source before any work
    cfg, hf_cfg, config_path = ckpt.cfg, ckpt.hf_cfg, ckpt.config_path
    from fitgpt.paths import check_apart  # --overwrite would replace the model it reads

    check_apart(
        "--out", out, [("the model it imports", config_path.parent)], "the run would replace it"
    )
    check_output(out, overwrite, 4 * cfg.num_params() + 2**20)
    layout = ckpt.layout

    with folder_in_place(out, "import") as tmp:
        (tmp / CHECKPOINT_DIR).mkdir()
        spec = _import_tokenizer(config_path.parent, tmp / TOKENIZER_DIR, out, cfg, hf_cfg)
        step = tmp / CHECKPOINT_DIR
        write_pieces(step, 0, chunk_pieces(ckpt, progress))
        meta = imported_meta(cfg, layout, spec, out, src, hf_cfg)
        meta["imported_from"]["format"] = ckpt.mapping.import_format
        write_meta(step, meta)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB
    note = None
    if cfg.tie_embeddings != ckpt.mapping.config_from_hf(hf_cfg, str(config_path)).tie_embeddings:
        note = (
            f"{config_path} says tie_word_embeddings=true, but the weights hold an lm_head.weight "
            "other than the embedding: kept untied, as transformers keeps it"
        )
    return ImportResult(out / CHECKPOINT_DIR, cfg, spec, time.perf_counter() - t0, peak, note)


def hf_tokenizer_spec(folder: Path, cfg: ModelConfig) -> str | None:
    """The tokenizer an HF checkpoint folder carries, as a spec: the folder when it holds a
    vocabulary (hf_tokenizer.py holds_vocabulary), else GPT-2's for a GPT-2 of 50257 tokens
    (openai-community/gpt2's weights), else None (unknown). What `fitgpt import hf` records,
    and what `--init-from FOLDER` checks the data's tokenizer against."""
    if holds_vocabulary(folder):
        return str(folder.resolve())
    return "gpt2" if cfg.family == "gpt2" and cfg.vocab_size == GPT2_VOCAB else None


def _import_tokenizer(
    src: Path, dest: Path, out: Path, cfg: ModelConfig, hf_cfg: dict
) -> str | None:
    """The run's tokenizer spec: its copied files, else hf_tokenizer_spec's.

    generation_config.json travels with the tokenizer files (export writes it back); where the
    checkpoint has none, one is written from config.json's bos/eos ids, so they are not lost."""
    if copy_hf_tokenizer(src, dest):
        gen = dest / "generation_config.json"
        ids = {k: hf_cfg[k] for k in ("bos_token_id", "eos_token_id") if hf_cfg.get(k) is not None}
        if not gen.is_file() and ids:
            gen.write_text(json.dumps(ids, indent=2))
        return str((out / TOKENIZER_DIR).resolve())
    return hf_tokenizer_spec(src, cfg)


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
