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
    p.add_argument("--prompt", default="", help="text to continue (with --chat: the user's turn)")
    p.add_argument(
        "--chat",
        action="store_true",
        help="the prompt as a user turn of the tokenizer's chat template (with the generation "
        "prompt, as transformers' apply_chat_template(add_generation_prompt=True)); prints "
        "the reply, which stops at the template's end of turn",
    )
    p.add_argument(
        "--interactive",
        action="store_true",
        help="read prompts (with --chat: one conversation each) from stdin until `stop`",
    )
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
    from fitgpt.infer.generate import (
        SampleConfig,
        chat_prompt,
        checkpoint_meta,
        generate,
        generation_context,
        load_model,
        strip_stop,
        tokenizer_for,
    )

    cfg = config_from_args(args, SampleConfig)
    prompt = utf8(args.prompt, "--prompt")
    path = Path(args.ckpt)
    if not path.exists():
        raise UserError(f"--ckpt {path} does not exist; pass a run folder or a step_* checkpoint")
    # the training command's thread rule: on a CPU shared with other jobs, torch's default of a
    # thread per core made `make demo`'s sample 6x slower than one thread (32.2 against 5.4 s)
    configure_process(0, args.device)
    device = pick_device(args.device)
    _, meta, model_cfg = checkpoint_meta(path)  # the tokenizer and chat checks before the weights
    tok = tokenizer_for(meta, args.tokenizer, model_cfg)
    if args.chat:
        chat_prompt(tok, "")  # no template, or one that refuses a turn: refused here
    from fitgpt.interop.adapter_export import merged_base

    context = generation_context(model_cfg)  # a rotary model's whole, as transformers reads it
    model, _ = load_model(path, device, merged_base(path), context)  # an adapter run's: merged
    told = []

    def note(line: str) -> None:  # the context note once, not once per interactive prompt
        if not told:
            told.append(line)
            print(f"note: {line}", file=sys.stderr)

    def once(text: str) -> None:
        stops = tok.stop_ids
        if args.chat:
            ids, stops = chat_prompt(tok, text)
        else:
            ids = tok.encode(text)
        seeded = not ids  # an empty prompt starts from the end-of-document token (or a newline)
        if seeded:
            ids = [tok.eod_id if tok.eod_id is not None else 10]
        x = torch.tensor([ids], device=device)
        out = generate(model, x, cfg, stop_ids=stops, vocab_size=tok.vocab_size, note=note)
        new = strip_stop(out[0, len(ids) :].tolist(), stops, cfg)  # the stop not printed
        shown = [] if args.chat else ids[1:] if seeded else ids  # chat: the reply alone
        print(tok.decode(shown + new), flush=True)

    if not args.interactive:
        once(prompt)
        return 0
    print("type a prompt, or `stop` to quit", file=sys.stderr)
    lines = getattr(sys.stdin, "buffer", sys.stdin)  # bytes: a bad line is named, no traceback
    for n, raw in enumerate(lines, 1):
        line = utf8(raw, f"stdin line {n}").rstrip("\r\n")
        if line.strip() == "stop":
            break
        once(line)
    return 0


def utf8(text: str | bytes, what: str) -> str:
    """`text` as UTF-8 text, or a one-line refusal naming the first bad byte. argv holds bytes
    that are not UTF-8 as lone surrogates (Python's surrogateescape), which no tokenizer can
    encode; stdin is read as bytes."""
    if isinstance(text, str):
        try:  # argv's undecodable bytes come back as the bytes they were
            raw = text.encode("utf-8", "surrogateescape")
        except UnicodeEncodeError:  # a surrogate no byte made (a caller's own str)
            raw = text.encode("utf-8", "surrogatepass")
    else:
        raw = text
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise UserError(
            f"{what} is not UTF-8 text (byte 0x{raw[e.start]:02x} at offset {e.start}); "
            "convert it to UTF-8 (e.g. iconv -t UTF-8)"
        ) from None
