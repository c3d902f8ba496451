"""`fitgpt data`: preprocess JSON lines into Megatron .bin/.idx, make fake data, clean, merge,
inspect. Flag help comes from the configs' field metadata (fitgpt/data/preprocess.py, tools.py)."""

from __future__ import annotations

import argparse
import dataclasses

from fitgpt.data.packed import LONG_CHOICES
from fitgpt.data.preprocess import PreprocessConfig
from fitgpt.data.tools import CleanConfig, FakeConfig


def _help(cls: type, name: str) -> str:
    f = next(f for f in dataclasses.fields(cls) if f.name == name)
    default = "" if f.default is dataclasses.MISSING else f" (default: {f.default})"
    return f.metadata["help"] + default


def _flag(p: argparse.ArgumentParser, cls: type, name: str, **kw) -> None:
    """--name-with-dashes for config field `name`, help from its metadata."""
    f = next(f for f in dataclasses.fields(cls) if f.name == name)
    if f.default is dataclasses.MISSING:
        kw.setdefault("required", True)
    else:
        kw.setdefault("default", f.default)
    p.add_argument("--" + name.replace("_", "-"), dest=name, help=_help(cls, name), **kw)


def register(sub) -> None:
    p = sub.add_parser(
        "data",
        help="prepare training data (.bin/.idx, Megatron format)",
        description="Prepare training data in Megatron-LM's indexed format (docs/data.md).",
    )
    cmds = p.add_subparsers(dest="data_command", metavar="SUBCOMMAND", required=True)

    pre = cmds.add_parser(
        "preprocess",
        help="tokenize JSON lines into PREFIX_KEY_document.bin/.idx",
        description="Tokenize a JSON-lines file (optionally .gz) in parallel worker processes "
        "into OUTPUT_PREFIX_{json_key}_document.bin/.idx, byte-compatible with Megatron-LM. "
        "With --chat, each line is a conversation rendered by the tokenizer folder's chat "
        "template, written to OUTPUT_PREFIX_chat_document.bin/.idx with a loss mask beside it "
        "(.loss_mask.bin/.idx, 1 on the assistant's tokens); see docs/data.md.",
    )
    _flag(pre, PreprocessConfig, "input", metavar="FILE")
    _flag(pre, PreprocessConfig, "output_prefix", metavar="PREFIX")
    _flag(pre, PreprocessConfig, "json_key", metavar="KEY")
    _flag(pre, PreprocessConfig, "tokenizer", metavar="SPEC")
    _flag(pre, PreprocessConfig, "workers", type=int, metavar="N")
    _flag(pre, PreprocessConfig, "append_eod", action="store_true")
    _flag(pre, PreprocessConfig, "chat", action="store_true")
    _flag(pre, PreprocessConfig, "seq_len", type=int, metavar="N")
    _flag(pre, PreprocessConfig, "long", choices=list(LONG_CHOICES))
    _flag(pre, PreprocessConfig, "on_error", choices=["skip", "fail"])
    _flag(pre, PreprocessConfig, "on_bad_utf8", choices=["replace", "skip", "fail"])
    pre.add_argument("--quiet", action="store_true", help="no progress bar")
    pre.set_defaults(func=_preprocess)

    fk = cmds.add_parser(
        "fake",
        help="write synthetic tokens as a .bin/.idx pair",
        description="Write synthetic tokens (a learnable Markov chain, or uniform noise) cut "
        "into documents, as OUTPUT_PREFIX.bin/.idx.",
    )
    _flag(fk, FakeConfig, "output_prefix", metavar="PREFIX")
    _flag(fk, FakeConfig, "tokens", type=_count, metavar="N")
    _flag(fk, FakeConfig, "vocab", type=int, metavar="V")
    _flag(fk, FakeConfig, "structure", choices=["markov", "uniform"])
    _flag(fk, FakeConfig, "doc_len", type=int, metavar="N")
    _flag(fk, FakeConfig, "seed", type=int)
    fk.set_defaults(func=_fake)

    cl = cmds.add_parser(
        "clean",
        help="drop short documents; optionally fix unicode",
        description="Copy INPUT to OUTPUT_PREFIX without documents under --min-tokens tokens; "
        "with --fix-unicode, also drop documents whose text holds U+FFFD and NFC-normalise the "
        "rest. Prints what was dropped and why.",
    )
    _flag(cl, CleanConfig, "input", metavar="PREFIX")
    _flag(cl, CleanConfig, "output_prefix", metavar="PREFIX")
    _flag(cl, CleanConfig, "min_tokens", type=int, metavar="N")
    _flag(cl, CleanConfig, "fix_unicode", action="store_true")
    _flag(cl, CleanConfig, "tokenizer", metavar="SPEC")
    cl.set_defaults(func=_clean)

    mg = cmds.add_parser(
        "merge",
        help="concatenate several .bin/.idx pairs into one",
        description="Concatenate .bin/.idx pairs in the order given, keeping document boundaries. "
        "Inputs recorded with different tokenizers are refused (unless --force).",
    )
    mg.add_argument("inputs", nargs="+", metavar="PREFIX", help="input prefixes, in order")
    mg.add_argument("--output-prefix", required=True, metavar="PREFIX", help="the merged pair")
    mg.add_argument(
        "--force",
        action="store_true",
        help="merge inputs of different tokenizers anyway (16-bit and 32-bit ones into int32); "
        "the output then records no tokenizer",
    )
    mg.set_defaults(func=_merge)

    ins = cmds.add_parser(
        "inspect",
        help="describe a .bin/.idx pair",
        description="Documents, tokens, dtype, length statistics and histogram, and the decoded "
        "text of the first documents.",
    )
    ins.add_argument("prefix", metavar="PREFIX", help="prefix of the .bin/.idx pair")
    ins.add_argument(
        "--tokenizer",
        default="auto",
        metavar="SPEC",
        help="decode with this, or none; auto: the tokenizer recorded with the data, gpt2 if "
        "none is (default: auto)",
    )
    ins.add_argument("--docs", type=int, default=1, help="documents to decode, 0+ (default: 1)")
    ins.add_argument(
        "--chars", type=int, default=400, help="characters shown per document (default: 400)"
    )
    ins.set_defaults(func=_inspect)


def _count(text: str) -> int:
    """1000000, 1e6, 100M, 2G."""
    scale = {"k": 10**3, "m": 10**6, "g": 10**9}.get(text[-1:].lower(), 1)
    try:
        return int(float(text[:-1] if scale > 1 else text) * scale)
    except (ValueError, OverflowError) as e:  # 'x', 'nan'; 'inf'
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a count like 1000000, 1e6 or 100M"
        ) from e


def _preprocess(args: argparse.Namespace) -> None:
    from fitgpt.data.preprocess import preprocess
    from fitgpt.paths import check_readable_file

    # An empty file is the reader's to explain (it says what "no documents" means there).
    check_readable_file(args.input, "--input", "a .jsonl or .jsonl.gz file", allow_empty=True)
    names = [f.name for f in dataclasses.fields(PreprocessConfig) if hasattr(args, f.name)]
    cfg = PreprocessConfig(**{n: getattr(args, n) for n in names}, progress=not args.quiet)
    print(preprocess(cfg).summary())


def _fake(args: argparse.Namespace) -> None:
    from fitgpt.data.tools import fake

    names = [f.name for f in dataclasses.fields(FakeConfig)]
    data = fake(FakeConfig(**{n: getattr(args, n) for n in names}), progress=True)
    print(
        f"wrote {args.output_prefix}.bin/.idx: {data.num_documents:,} documents, "
        f"{data.num_tokens:,} {data.dtype.name} tokens ({args.structure})"
    )


def _clean(args: argparse.Namespace) -> None:
    from fitgpt.data.tools import clean
    from fitgpt.paths import check_input_prefix

    check_input_prefix(args.input, "--input")
    names = [f.name for f in dataclasses.fields(CleanConfig)]
    print(
        clean(CleanConfig(**{n: getattr(args, n) for n in names}), progress=True).summary(
            args.output_prefix
        )
    )


def _merge(args: argparse.Namespace) -> None:
    from fitgpt.data.tools import merge
    from fitgpt.paths import check_input_prefix

    for prefix in args.inputs:
        check_input_prefix(prefix, "")
    data = merge(args.inputs, args.output_prefix, force=args.force, progress=True)
    print(
        f"wrote {args.output_prefix}.bin/.idx: {data.num_documents:,} documents, "
        f"{data.num_tokens:,} {data.dtype.name} tokens from {len(args.inputs)} inputs"
    )


def _inspect(args: argparse.Namespace) -> None:
    from fitgpt.data.tools import inspect
    from fitgpt.paths import check_input_prefix

    check_input_prefix(args.prefix, "")
    print(inspect(args.prefix, args.tokenizer, args.docs, args.chars))
