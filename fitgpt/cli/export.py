"""`fitgpt export`: a checkpoint's weights as one safetensors file, or as a Hugging Face folder."""

from __future__ import annotations

import argparse
import errno
import json
import os
from pathlib import Path

from fitgpt.errors import UserError


def register(sub) -> None:
    p = sub.add_parser(
        "export",
        help="write a checkpoint's weights as one safetensors file or a Hugging Face folder",
        description="Gather the fp32 master weights of a checkpoint (any engine, any world "
        "size). --format fitgpt (default): one .safetensors file of whole parameters named as "
        "in the model's own parameter names. --format hf: a folder that "
        "AutoModelForCausalLM.from_pretrained and AutoTokenizer.from_pretrained load offline "
        "(GPT-2, Llama, Qwen2, Qwen3, Mistral; see docs/interop.md). A LoRA run's checkpoint "
        "(docs/adapters.md): --format peft, PEFT's adapter folder; --format hf --merge, its "
        "base with the adapters merged in.",
    )
    p.add_argument("--ckpt", required=True, help="checkpoint folder, or a run folder (its newest)")
    p.add_argument("--out", required=True, help="output .safetensors path (fitgpt) or folder (hf)")
    p.add_argument(
        "--format",
        choices=["fitgpt", "hf", "peft"],
        default="fitgpt",
        help="fitgpt: one safetensors file, fitgpt names; hf: a Hugging Face folder; peft: a "
        "LoRA run's adapters as PEFT's folder, which peft.PeftModel.from_pretrained loads over "
        "the base (default: fitgpt)",
    )
    p.add_argument(
        "--merge",
        action="store_true",
        help="hf and fitgpt: a LoRA run's base (its --init-from source) with the adapters "
        "merged in, by default in the base's dtype",
    )
    p.add_argument(
        "--max-shard-size",
        default="5GB",
        metavar="SIZE",
        help="hf: the largest safetensors file, e.g. 5GB, 500MB, 2GiB; more weights are "
        "written as shards with model.safetensors.index.json (default: 5GB, as transformers)",
    )
    p.add_argument(
        "--dtype",
        choices=["fp32", "bf16", "fp16"],
        default=None,
        help="(default: fp32; with --merge the base's)",
    )
    p.add_argument(
        "--tokenizer",
        default=None,
        help="hf: the tokenizer to write, when the checkpoint records none or its files moved",
    )
    p.add_argument(
        "--overwrite", action="store_true", help="replace --out if it exists (once complete)"
    )
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from fitgpt.interop.hf_export import check_out_apart

    if not Path(args.ckpt).exists():
        raise UserError(
            f"--ckpt {args.ckpt} does not exist; pass a run folder or a step_* checkpoint"
        )
    # before "already exists": --overwrite must not be the advice for the run it reads
    check_out_apart(Path(args.out), Path(args.ckpt), args.tokenizer)
    if Path(args.out).exists() and not args.overwrite:
        raise UserError(f"--out {args.out} already exists; pass --overwrite to replace it")
    if args.merge and args.format == "peft":
        raise UserError("--merge writes a whole model: use it with --format hf (or fitgpt)")
    if args.format == "peft":
        return run_peft(args)
    if args.format == "hf":
        return run_hf(args)
    return run_fitgpt(args)


# a LoRA run of a --preset without --init-from (plan/adapter.py RANDOM_BASE): its adapters fit
# the preset's seeded weights, which no folder holds; its PEFT folder names no base
RANDOM_BASE = "--preset without --init-from: base_model_name_or_path is null"


def run_peft(args: argparse.Namespace) -> int:
    from fitgpt.interop.hf_export import export_peft

    r = export_peft(Path(args.ckpt), Path(args.out), args.dtype or "fp32", args.overwrite)
    a = r.adapter
    print(
        f"wrote {r.out}: LoRA rank {a.lora_rank}, alpha {a.alpha:g}, on {r.modules} modules "
        f"({r.values:,} values in {args.dtype or 'fp32'}), over "
        + (f"the base {r.base}" if r.base else f"a random base ({RANDOM_BASE})")
    )
    return 0


UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12}
UNITS |= {"KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}


def shard_bytes(text: str) -> int:
    """'5GB' -> 5·10^9 (decimal units, as transformers' max_shard_size; KiB/MiB/GiB binary)."""
    import re

    m = re.fullmatch(r"\s*(\d+(?:\.\d*)?)\s*([A-Za-z]*)\s*", text)
    unit = m.group(2).upper() if m else ""
    if m is None or unit not in UNITS or float(m.group(1)) * UNITS[unit] < 1:
        raise UserError(
            f"--max-shard-size {text}: not a size; pass e.g. 5GB, 500MB or 2GiB (bytes: 1000000)"
        )
    return int(float(m.group(1)) * UNITS[unit])


def run_hf(args: argparse.Namespace) -> int:
    from fitgpt.interop.hf_export import export_hf

    limit = shard_bytes(args.max_shard_size)
    r = export_hf(
        Path(args.ckpt), Path(args.out), args.dtype, args.overwrite, args.tokenizer, limit,
        args.merge,
    )  # fmt: skip
    c = r.cfg
    tok = f"tokenizer {r.tokenizer}" if r.tokenizer else "no tokenizer (the run recorded none)"
    files = "one safetensors file" if r.files == 1 else f"{r.files} safetensors shards"
    print(
        f"wrote {r.out}: {r.architecture}, {r.params:,} values in {r.dtype} in {files} "
        f"({c.n_layer} layers, hidden {c.n_embd}, vocabulary {c.vocab_size} cut from "
        f"{c.padded_vocab_size}{f', {r.zeros} zero biases' if r.zeros else ''}), "
        f"{tok}"
    )
    return 0


def run_fitgpt(args: argparse.Namespace) -> int:
    import torch
    from safetensors.torch import save_file

    from fitgpt.infer.generate import load_model
    from fitgpt.interop.adapter_export import merged_base
    from fitgpt.paths import check_writable_file, file_in_place
    from fitgpt.train.checkpoint import is_disk_full

    check_writable_file(args.out, "--out")  # before loading anything
    base = merged_base(Path(args.ckpt)) if args.merge else None
    if args.merge and base is None:
        raise UserError(f"--merge: {args.ckpt} trained the whole model, no adapters; drop --merge")
    name = args.dtype or (base.dtype if base is not None else "fp32")
    model, meta = load_model(Path(args.ckpt), torch.device("cpu"), base)
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[name]
    tensors = {k: v.detach().to(dtype).contiguous() for k, v in model.state_dict().items()}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    # the model config travels in the header, so the file is self-describing
    header = {
        "fitgpt_model": json.dumps(meta["config"]["model"]),
        "tokenizer": str(meta.get("tokenizer")),
    }
    with file_in_place(out, "export") as tmp:
        try:
            save_file(tensors, str(tmp), metadata=header)
        except Exception as e:  # safetensors wraps the OS's error in its own type
            if not is_disk_full(e):
                raise
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(out)) from None
    n = sum(t.numel() for t in tensors.values())
    print(
        f"wrote {out}: {len(tensors)} tensors, {n:,} values in {name} (vocabulary padded to "
        f"{model.cfg.padded_vocab_size})"
    )
    return 0
