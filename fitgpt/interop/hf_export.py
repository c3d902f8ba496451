"""`fitgpt export --format hf`: a checkpoint as a folder that transformers loads offline.

The folder holds config.json (the family's HF class, hf.py's registry; the fields of the HF
model the run came from that fitgpt's model kept carried back: carried.py), the weights in HF names
and layout (the vocabulary cut back to the tokenizer's size, fused parameters cut into HF's
tensors) as model.safetensors, or as shards model-0000i-of-0000n.safetensors with
model.safetensors.index.json once they exceed the shard size (5 GB by default, as
transformers' save_pretrained), generation_config.json (the ids generation starts and stops at:
_special_ids) and the tokenizer files (hf_tokenizer.py), so
that `AutoModelForCausalLM.from_pretrained(DIR)` and `AutoTokenizer.from_pretrained(DIR)` work
offline. It is written into a temporary folder that is renamed into place when complete.

Memory: the weights stream from the checkpoint's chunk files into the safetensors files one
chunk at a time (safetensors_stream.py), so exporting needs about one chunk of host RAM,
whatever the size of the model.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

from fitgpt.adapters import AdapterConfig, lora_targets
from fitgpt.adapters.peft import write_peft
from fitgpt.data.chat import end_of_turn_id
from fitgpt.data.tokenizer import load_tokenizer
from fitgpt.engine.layout import ChunkSpec
from fitgpt.engine.state_io import StateReader
from fitgpt.errors import UserError
from fitgpt.interop.adapter_export import adapter_of, adapter_tensors, merged
from fitgpt.interop.carried import carry_source, source_of
from fitgpt.interop.hf import mapping_for_model
from fitgpt.interop.hf_tokenizer import write_hf_tokenizer
from fitgpt.interop.safetensors_stream import SafetensorsWriter
from fitgpt.model import ModelConfig
from fitgpt.model.hf_map import HFMapping, TensorMap, hf_shape, to_hf
from fitgpt.paths import folder_in_place
from fitgpt.train import checkpoint as ckpt_io

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
HF_DTYPE_NAMES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}
MAX_SHARD_BYTES = 5 * 10**9  # transformers' own "5GB" (decimal, as its save_pretrained counts)
SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
SPECIAL_IDS = ("bos_token_id", "eos_token_id")


@dataclass(frozen=True)
class ExportResult:
    out: Path
    cfg: ModelConfig
    params: int  # values written, biases of a bias-free model (zeros) included
    tokenizer: str | None  # what was written, in words; None when the run has no tokenizer
    architecture: str  # the transformers class, e.g. LlamaForCausalLM
    files: int  # safetensors files written (1, or the number of shards)
    zeros: int  # HF tensors written as zeros (the biases of a bias-free GPT-2)
    dtype: str  # fp32, bf16 or fp16


def check_output(out: Path, overwrite: bool) -> None:
    """--out free, or --overwrite of a folder an export wrote (it is replaced whole)."""
    if out.exists() and not overwrite:
        raise UserError(f"--out {out} already exists; pass --overwrite to replace it")
    from fitgpt.paths import check_replaceable

    marks = ("config.json", "adapter_config.json", "*.safetensors")
    check_replaceable("--out", out, marks, "a model folder")


def export_hf(
    ckpt_path: Path,
    out: Path,
    dtype: str | None = None,
    overwrite: bool = False,
    tokenizer: str | None = None,
    max_shard_bytes: int = MAX_SHARD_BYTES,
    merge: bool = False,
) -> ExportResult:
    """Write checkpoint (or newest of run) `ckpt_path` as the HF folder `out`, in `dtype`
    (default fp32). `merge`: an adapter run's checkpoint, its base with the adapters merged in
    (interop/adapter_export.py), by default in the base's dtype."""

    ckpt = ckpt_io.resolve_held(ckpt_path)
    meta = ckpt_io.load_meta(ckpt)
    cfg = ModelConfig.from_dict(meta["config"]["model"])
    adapter = adapter_of(meta)
    if adapter is not None and not merge:
        raise UserError(
            f"--ckpt {ckpt} holds LoRA adapters, not a model: add --merge (the base with them "
            "merged in), or use --format peft"
        )
    if merge and adapter is None:
        raise UserError(f"--merge: {ckpt} trained the whole model, no adapters; drop --merge")
    mapping = mapping_for_model(cfg)
    mapping.check_exportable(cfg)
    check_out_apart(out, ckpt_path, tokenizer)
    check_output(out, overwrite)
    if max_shard_bytes < 1:
        raise UserError(f"max shard size {max_shard_bytes} bytes must be positive")
    spec = tokenizer or meta.get("tokenizer")
    source = source_of(meta, cfg)  # what the export carries from the HF model it came from
    ids, carried = _special_ids(spec, cfg, meta, source.generation)
    base = merged(ckpt, meta, cfg) if merge else None
    dtype = dtype or (base.dtype if base is not None else "fp32")
    with folder_in_place(out, "export") as tmp:
        n, files = write_weights(
            tmp, ckpt, meta, cfg, mapping, DTYPES[dtype], max_shard_bytes, base
        )
        names = {"dtype": HF_DTYPE_NAMES[dtype], "torch_dtype": HF_DTYPE_NAMES[dtype]}
        config = carry_source(mapping.hf_config(cfg, ids), source.config, mapping, str(ckpt))
        config |= ids | names  # torch_dtype: transformers 4's key
        (tmp / "config.json").write_text(json.dumps(config, indent=2))
        written = write_hf_tokenizer(spec, tmp, cfg.seq_len)
        # the carried file's other settings (temperature, top_p) stay as they were
        if ids or carried:
            (tmp / "generation_config.json").write_text(json.dumps(carried | ids, indent=2))
    zeros = sum(m.fitgpt is None for m in mapping.tensor_maps(cfg))
    return ExportResult(out, cfg, n, written, mapping.architecture(cfg), files, zeros, dtype)


def check_out_apart(out: Path, ckpt_path: Path, tokenizer: str | None = None) -> None:
    """Refuse, before any work, an --out that is, lies inside or holds what the export reads:
    the run (or the checkpoint) --ckpt names, the models it came from (its --init-from source
    and the folder `import hf` read, through every fine-tune between) and the tokenizer files it
    copies (`tokenizer`, else the checkpoint's). Writing there would put the export among them,
    and --overwrite would delete them: the run's checkpoints and metrics, or the user's own
    model folder."""
    from fitgpt.paths import check_apart

    ckpt = ckpt_io.resolve_held(ckpt_path)
    meta = ckpt_io.load_meta(ckpt)
    kept: list[tuple[str, str | Path]] = [("the run --ckpt reads", ckpt_path)]
    if ckpt in ckpt_io.step_dirs(ckpt.parent):  # a checkpoint of a run: the whole run
        kept.append(("the run --ckpt reads", ckpt.parent))
    kept.append(("the checkpoint --ckpt reads", ckpt))
    kept += [(f"a model {ckpt} came from", p) for p in ckpt_io.sources(meta)]
    spec = tokenizer or meta.get("tokenizer")
    if spec is not None and spec not in ("gpt2", "bytes"):
        kept += [("the tokenizer the export copies", p) for p in spec.split(",")]
    why = "the export would write there, and --overwrite replace it whole"
    check_apart("--out", out, kept, why)


def _special_ids(
    spec: str | None, cfg: ModelConfig, meta: dict, source_generation: dict
) -> tuple[dict, dict]:
    """(bos_token_id and eos_token_id for config.json and generation_config.json, the
    generation_config.json carried: the one beside the tokenizer, else `source_generation`,
    the source folder's (carried.py), else {}); a tokenizer with more tokens than the model
    has is refused.

    The export stops generating where transformers' own files for the model say, and where a
    chat fine-tune learnt to end its turn. eos_token_id: the carried generation_config.json's
    (an import's: the model authors' list), else the source's (the Hugging Face folder the run
    came from: its generation_config.json, else its config.json), then the tokenizer's declared
    eos_token (AutoTokenizer's eos_token_id), its chat template's end of turn, and where fitgpt's
    generate stops (the end of document): one id as an int, several as a list, as Llama 3.1
    writes them. bos_token_id: the carried's, the source's, the tokenizer's bos_token, else the
    end of document (GPT-2's habit). Without this, a folder that tokenizer.save_pretrained wrote
    (no generation_config.json) exported its end of document as the only eos, and generate ran
    past the template's <|im_end|>."""
    if spec is None:  # no tokenizer to write: the source's ids, where it names them
        known = source_generation if "eos_token_id" in source_generation else _source_ids(meta)
        return {k: v for k, v in known.items() if k in SPECIAL_IDS}, source_generation
    tok = load_tokenizer(spec)
    if tok.vocab_size > cfg.vocab_size:
        raise UserError(
            f"tokenizer {spec} has {tok.vocab_size} tokens, the model's vocabulary "
            f"{cfg.vocab_size}; pass --tokenizer with the one the model was trained with"
        )
    carried = {}
    gen = Path(spec) / "generation_config.json"
    if gen.is_file():
        try:
            carried = json.loads(gen.read_text())
        except (OSError, ValueError) as e:
            raise UserError(f"{gen} is not valid JSON ({e}); fix or remove it") from None
        carried = carried if isinstance(carried, dict) else {}
    carried = carried or source_generation
    known = carried if "eos_token_id" in carried else _source_ids(meta)
    eos = _ids(known.get("eos_token_id"))
    eos += [getattr(tok, "eos_id", None), end_of_turn_id(tok), *tok.stop_ids]
    eos = [i for i in dict.fromkeys(eos) if i is not None]
    bos = [carried.get("bos_token_id"), known.get("bos_token_id"), getattr(tok, "bos_id", None)]
    bos = next((i for i in [*bos, tok.eod_id] if isinstance(i, int)), None)
    ids = {"bos_token_id": bos, "eos_token_id": eos[0] if len(eos) == 1 else eos or None}
    return {k: v for k, v in ids.items() if v is not None}, carried


def _ids(value) -> list[int]:
    """A config's token id or list of ids, as a list (anything else: none)."""
    value = value if isinstance(value, list) else [value]
    return [i for i in value if isinstance(i, int) and not isinstance(i, bool)]


def _source_ids(meta: dict) -> dict:
    """bos_token_id and eos_token_id of the nearest Hugging Face model the checkpoint came from
    (train/checkpoint.py lineage): its folder's generation_config.json over its config.json,
    else, where the folder is gone, what `import hf` recorded of its config.json; {} when none
    names an eos."""
    folders, recorded = [], []
    for path, source_meta in ckpt_io.lineage(meta):
        if source_meta is None:
            folders.append(_folder_ids(path if path.is_dir() else path.parent))
        else:
            imported = (source_meta.get("imported_from") or {}).get("config") or {}
            recorded.append({k: imported[k] for k in SPECIAL_IDS if k in imported})
    return next((ids for ids in [*folders, *recorded] if _ids(ids.get("eos_token_id"))), {})


def _folder_ids(folder: Path) -> dict:
    """The special ids of an HF model folder: generation_config.json's over config.json's."""
    found = {}
    for name in ("config.json", "generation_config.json"):
        try:
            cfg = json.loads((folder / name).read_text())
        except (OSError, ValueError):
            continue
        if isinstance(cfg, dict):
            found |= {k: cfg[k] for k in SPECIAL_IDS if k in cfg}
    return found


def _hf_shapes(
    cfg: ModelConfig, layout: list[ChunkSpec], maps: list[TensorMap]
) -> dict[str, tuple[int, ...]]:
    """Every HF tensor's shape; a zero bias (bias=False) takes its weight's output size."""
    fit_shapes = {s.name: s.shape for c in layout for s in c.slots}
    shapes: dict[str, tuple[int, ...]] = {}
    for m in maps:
        if m.fitgpt is not None:
            if m.fitgpt not in fit_shapes:
                raise UserError(f"checkpoint lacks parameter {m.fitgpt}; is it damaged?")
            shapes[m.hf] = hf_shape(m, fit_shapes[m.fitgpt], cfg)
            continue
        w = shapes[m.hf.removesuffix(".bias") + ".weight"]  # maps list each weight first
        shapes[m.hf] = (w[-1],)  # Conv1D [in, out] and LayerNorm [H] alike: the last dim
    return shapes


def shard_plan(
    entries: list[tuple[str, tuple[int, ...]]], itemsize: int, max_bytes: int
) -> list[list[tuple[str, tuple[int, ...]]]]:
    """The tensors in order, cut into files of at most `max_bytes` each (a tensor larger than
    that alone in its own), as save_pretrained cuts them."""
    shards: list[list[tuple[str, tuple[int, ...]]]] = [[]]
    size = 0
    for name, shape in entries:
        nbytes = itemsize * int(torch.Size(shape).numel())
        if shards[-1] and size + nbytes > max_bytes:
            shards.append([])
            size = 0
        shards[-1].append((name, shape))
        size += nbytes
    return shards


def write_weights(
    folder: Path,
    ckpt: Path,
    meta: dict,
    cfg: ModelConfig,
    mapping: HFMapping,
    dtype: torch.dtype,
    max_shard_bytes: int = MAX_SHARD_BYTES,
    merged=None,
) -> tuple[int, int]:
    """The safetensors file(s) in HF names and layout, streamed chunk by chunk; (values
    written, files written). `merged`: an adapter checkpoint's base with the adapters merged
    in (interop/adapter_export.py Merged), read instead of the checkpoint's own chunks."""
    layout = [ChunkSpec.from_dict(d) for d in meta["layout"]]
    reader = StateReader(ckpt)
    if merged is not None:
        layout, reader = merged.layout, merged.reader
    where = {s.name: (c, s) for c in layout for s in c.slots}
    maps = mapping.tensor_maps(cfg)
    by_hf = {m.hf: m for m in maps}
    shapes = _hf_shapes(cfg, layout, maps)
    itemsize = torch.empty((), dtype=dtype).element_size()
    shards = shard_plan([(m.hf, shapes[m.hf]) for m in maps], itemsize, max_shard_bytes)
    n = len(shards)
    names = (
        [SINGLE_FILE]
        if n == 1
        else [f"model-{i:05d}-of-{n:05d}.safetensors" for i in range(1, n + 1)]
    )
    held, flat = -1, torch.empty(0)
    for name, entries in zip(names, shards, strict=True):
        with SafetensorsWriter(folder / name, entries, dtype, {"format": "pt"}) as writer:
            for hf, shape in entries:  # HF order = chunk order: each chunk read once, dropped
                m = by_hf[hf]
                if m.fitgpt is None:
                    writer.write(hf, torch.zeros(shape))
                    continue
                c, s = where[m.fitgpt]
                if c.index != held:
                    flat = torch.empty(0)  # free the previous chunk before reading the next
                    held, flat = c.index, reader.read(c.index, "master", 0, c.numel)
                writer.write(hf, to_hf(m, flat[s.offset : s.offset + s.numel].view(s.shape), cfg))
    if n > 1:
        total = sum(itemsize * int(torch.Size(s).numel()) for s in shapes.values())
        index = {
            "metadata": {"total_size": total},
            "weight_map": {hf: f for f, entries in zip(names, shards) for hf, _ in entries},
        }
        (folder / INDEX_FILE).write_text(json.dumps(index, indent=2))
    return sum(int(torch.Size(s).numel()) for s in shapes.values()), n


@dataclass(frozen=True)
class PeftExport:
    out: Path
    adapter: AdapterConfig
    modules: int  # the HF linears adapted
    values: int  # the A and B values written
    base: str


def export_peft(ckpt_path: Path, out: Path, dtype: str = "fp32", overwrite: bool = False):
    """Checkpoint (or newest of run) `ckpt_path`'s adapters as PEFT's folder `out`, written
    into a temporary folder renamed into place when complete."""
    ckpt = ckpt_io.resolve_held(ckpt_path)
    meta = ckpt_io.load_meta(ckpt)
    adapter = adapter_of(meta)
    if adapter is None:
        raise UserError(
            f"--format peft: {ckpt} trained the whole model, not LoRA adapters; use --format hf"
        )
    check_out_apart(out, ckpt_path)
    check_output(out, overwrite)
    cfg = ModelConfig.from_dict(meta["config"]["model"])
    targets = lora_targets(cfg, adapter)
    tensors = adapter_tensors(ckpt, meta)
    base = peft_base(meta)
    with folder_in_place(out, "export") as tmp:
        n = write_peft(tmp, adapter, targets, tensors, DTYPES[dtype], base)
    return PeftExport(out, adapter, len(targets), n, base)


def peft_base(meta: dict) -> str | None:
    """The base an exported adapter names (adapter_config.json's base_model_name_or_path, what
    AutoPeftModelForCausalLM loads): the run's --init-from, or, where that is `fitgpt import
    hf`'s checkpoint of a Hugging Face folder (the same weights, which peft cannot load), that
    folder. A checkpoint trained since keeps its own path: no Hugging Face folder holds its
    weights, and naming the one it started from would load the wrong base without a word."""
    chain = ckpt_io.lineage(meta, hops=1)
    if chain and chain[0][1] is not None:
        imported = (chain[0][1].get("imported_from") or {}).get("path")
        if imported:
            return imported
    return meta.get("init_from")
