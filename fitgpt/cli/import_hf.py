"""`fitgpt import hf`: a Hugging Face GPT-2 checkpoint as a fitgpt run (weights only)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


def register(sub) -> None:
    p = sub.add_parser(
        "import",
        help="bring a model in from another format (Hugging Face GPT-2)",
        description="Write another format's checkpoint as a fitgpt run whose one checkpoint "
        "holds the weights only: training from it starts the optimizer fresh.",
    )
    formats = p.add_subparsers(dest="format", metavar="FORMAT")
    h = formats.add_parser(
        "hf",
        help="a Hugging Face GPT-2 checkpoint (config.json + model.safetensors or "
        "pytorch_model.bin, sharded or not)",
        description="Read an HF GPT2LMHeadModel checkpoint tensor by tensor (never the whole "
        "model twice in RAM) into RUN/step_00000000/, in the engines' own state files, and copy "
        "its tokenizer files to RUN/tokenizer/. Fine-tune with `fitgpt train --init-from RUN --data "
        "PREFIX --out NEW`. See docs/interop.md.",
    )
    h.add_argument("source", metavar="DIR_OR_FILE", help="checkpoint folder, or its weight file")
    h.add_argument("--out", required=True, metavar="RUN", help="run folder to create")
    h.add_argument(
        "--overwrite", action="store_true", help="replace --out if it exists (once complete)"
    )
    h.set_defaults(func=run)
    p.set_defaults(func=lambda args: p.print_help() or 2)


def run(args: argparse.Namespace) -> int:
    from fitgpt.interop.hf_import import import_hf

    def progress(done: int, total: int) -> None:
        if sys.stderr.isatty():  # a long import shows which chunk it is on
            print(f"\rimporting chunk {done}/{total}", end="", file=sys.stderr, flush=True)
            if done == total:
                print(file=sys.stderr)

    r = import_hf(Path(args.source), Path(args.out), args.overwrite, progress)
    c = r.cfg
    head = "tied head" if c.tie_embeddings else "untied head"
    print(
        f"imported {args.source} -> {r.ckpt}: {c.num_params():,} parameters ({c.n_layer} layers, "
        f"hidden {c.n_embd}, {c.n_head} heads, {c.seq_len} positions, vocabulary {c.vocab_size} "
        f"padded to {c.padded_vocab_size}, {head}), tokenizer {r.tokenizer}; "
        f"{r.seconds:.1f} s, peak RSS {r.peak_rss_bytes / 2**30:.2f} GiB; "
        f"model flags: {model_flags(c)}"
    )
    return 0


def model_flags(cfg) -> str:
    """The `fitgpt train` flags that build this architecture: a preset's name if one matches."""
    from fitgpt.model import PRESETS

    for name, preset in PRESETS.items():
        if preset == cfg:
            return f"--preset {name}"
    flags = (
        f"--layers {cfg.n_layer} --hidden {cfg.n_embd} --heads {cfg.n_head} "
        f"--seq-len {cfg.seq_len} --vocab-size {cfg.vocab_size}"
    )
    return flags + ("" if cfg.tie_embeddings else " --no-tie-embeddings")
