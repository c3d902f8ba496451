"""`fitgpt export`: a checkpoint's weights as one safetensors file of whole parameters."""

from __future__ import annotations

import json
import os
from pathlib import Path

from fitgpt.errors import UserError


def register(sub) -> None:
    p = sub.add_parser(
        "export",
        help="write a checkpoint's weights as one safetensors file",
        description="Gather the fp32 master weights of a checkpoint (any engine, any "
        "world size) into whole parameters named as in fitgpt/model/gpt.py.",
    )
    p.add_argument("--ckpt", required=True, help="checkpoint folder, or a run folder (its newest)")
    p.add_argument("--out", required=True, help="output .safetensors path")
    p.add_argument(
        "--dtype", choices=["fp32", "bf16", "fp16"], default="fp32", help="(default: fp32)"
    )
    p.set_defaults(func=run)


def run(args) -> int:
    import torch
    from safetensors.torch import save_file

    from fitgpt.cli.outputs import check_writable_file
    from fitgpt.infer.generate import load_model

    if not Path(args.ckpt).exists():
        raise UserError(
            f"--ckpt {args.ckpt} does not exist; pass a run folder or a step_* checkpoint"
        )
    check_writable_file(args.out, "--out")  # [cli helper, issue 21] before loading anything
    model, meta = load_model(Path(args.ckpt), torch.device("cpu"))
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[args.dtype]
    tensors = {k: v.detach().to(dtype).contiguous() for k, v in model.state_dict().items()}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".tmp")
    # the model config travels in the header, so the file is self-describing
    save_file(
        tensors,
        str(tmp),
        metadata={
            "fitgpt_model": json.dumps(meta["config"]["model"]),
            "tokenizer": str(meta.get("tokenizer")),
        },
    )
    os.replace(tmp, out)
    n = sum(t.numel() for t in tensors.values())
    print(
        f"wrote {out}: {len(tensors)} tensors, {n:,} values in {args.dtype} (vocabulary padded to "
        f"{model.cfg.padded_vocab_size})"
    )
    return 0
