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
    p.add_argument(
        "--tokenizer",
        default=None,
        help="the checkpoint's tokenizer from other files (refused if its vocabulary differs)",
    )
    p.add_argument("--device", default="auto", help="auto, cuda or cpu")
    from fitgpt.infer.generate import SampleConfig

    add_config_args(p, SampleConfig)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    import torch

    from fitgpt.dist import pick_device
    from fitgpt.dist.env import configure_process
    from fitgpt.infer.generate import SampleConfig, generate, load_model, strip_stop, tokenizer_for

    cfg = config_from_args(args, SampleConfig)
    path = Path(args.ckpt)
    if not path.exists():
        raise UserError(f"--ckpt {path} does not exist; pass a run folder or a step_* checkpoint")
    # the training command's thread rule: on a CPU shared with other jobs, torch's default of a
    # thread per core made `make demo`'s sample 6x slower than one thread (32.2 against 5.4 s)
    configure_process(0, args.device)
    device = pick_device(args.device)
    model, meta = load_model(path, device)
    tok = tokenizer_for(meta, args.tokenizer, model.cfg)
    told = False

    def once(prompt: str) -> None:
        nonlocal told
        ids = tok.encode(prompt)
        seeded = not ids  # an empty prompt starts from the end-of-document token (or a newline)
        if seeded:
            ids = [tok.eod_id if tok.eod_id is not None else 10]
        if len(ids) + cfg.max_new_tokens > model.cfg.seq_len and not told:
            told = True
            print(
                f"note: prompt and output exceed the model's context of {model.cfg.seq_len} "
                f"tokens; each new token sees the last {model.cfg.seq_len}",
                file=sys.stderr,
            )
        x = torch.tensor([ids], device=device)
        out = generate(model, x, cfg, stop_ids=tok.stop_ids, vocab_size=tok.vocab_size)
        new = strip_stop(out[0, len(ids) :].tolist(), tok.stop_ids, cfg)  # the stop not printed
        print(tok.decode((ids[1:] if seeded else ids) + new), flush=True)

    if not args.interactive:
        once(args.prompt)
        return 0
    print("type a prompt, or `stop` to quit", file=sys.stderr)
    for line in sys.stdin:
        if line.strip() == "stop":
            break
        once(line.rstrip("\n"))
    return 0
