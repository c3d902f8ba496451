"""`fitgpt generate`: sample text from a checkpoint, once or interactively."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from fitgpt.cli.args import add_config_args, config_from_args
from fitgpt.errors import UserError


def register(sub) -> None:
    p = sub.add_parser("generate", help="sample text from a checkpoint")
    p.add_argument("--ckpt", required=True, help="checkpoint folder, or a run folder (its newest)")
    p.add_argument("--prompt", default="", help="text to continue")
    p.add_argument("--interactive", action="store_true", help="read prompts until you type `stop`")
    p.add_argument("--tokenizer", default=None, help="override the checkpoint's tokenizer")
    p.add_argument("--device", default="auto", help="auto, cuda or cpu")
    from fitgpt.infer.generate import SampleConfig

    add_config_args(p, SampleConfig)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    import torch

    from fitgpt.dist import pick_device
    from fitgpt.infer.generate import SampleConfig, generate, load_model, tokenizer_for

    cfg = config_from_args(args, SampleConfig)
    path = Path(args.ckpt)
    if not path.exists():
        raise UserError(f"--ckpt {path} does not exist; pass a run folder or a step_* checkpoint")
    device = pick_device(args.device)
    model, meta = load_model(path, device)
    tok = tokenizer_for(meta, args.tokenizer)

    def once(prompt: str) -> None:
        ids = tok.encode(prompt) or ([tok.eod_id] if tok.eod_id is not None else [10])
        out = generate(model, torch.tensor([ids], device=device), cfg)
        print(tok.decode(out[0].tolist()), flush=True)

    if not args.interactive:
        once(args.prompt)
        return 0
    print("type a prompt, or `stop` to quit", file=sys.stderr)
    for line in sys.stdin:
        if line.strip() == "stop":
            break
        once(line.rstrip("\n"))
    return 0
