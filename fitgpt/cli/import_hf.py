"""`fitgpt import hf`: a Hugging Face checkpoint as a fitgpt run (weights only)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


def register(sub) -> None:
    p = sub.add_parser(
        "import",
        help="bring a model in from another format (Hugging Face)",
        description="Write another format's checkpoint as a fitgpt run whose one checkpoint "
        "holds the weights only: training from it starts the optimizer fresh.",
    )
    formats = p.add_subparsers(dest="format", metavar="FORMAT")
    h = formats.add_parser(
        "hf",
        help="a Hugging Face checkpoint of GPT-2, Llama, Qwen2, Qwen3 or Mistral (config.json + "
        "model.safetensors or pytorch_model.bin, sharded or not)",
        description="Read an HF GPT2LMHeadModel, LlamaForCausalLM, Qwen2ForCausalLM, "
        "Qwen3ForCausalLM or MistralForCausalLM checkpoint tensor by tensor (never the whole "
        "model twice in RAM) into RUN/step_00000000/, in the engines' own state files, and copy "
        "its tokenizer files, generation_config.json and chat template to RUN/tokenizer/. "
        "Fine-tune with `fitgpt train --init-from RUN --data PREFIX --out NEW`. See "
        "docs/interop.md.",
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
    heads = f"{c.n_head} heads" + (f" ({c.kv_heads} key/value)" if c.kv_heads != c.n_head else "")
    print(
        f"imported {args.source} -> {r.ckpt}: {c.family}, {c.num_params():,} parameters "
        f"({c.n_layer} layers, hidden {c.n_embd}, {heads}, {c.seq_len} positions, vocabulary "
        f"{c.vocab_size} padded to {c.padded_vocab_size}, {head}), tokenizer {r.tokenizer}; "
        f"{r.seconds:.1f} s, peak RSS {r.peak_rss_bytes / 2**30:.2f} GiB; "
        f"model flags: {model_flags(c)}"
    )
    if r.note:
        print(f"note: {r.note}")
    return 0


def model_flags(cfg) -> str:
    """The `fitgpt train` flags that build this architecture: a preset's name if one matches."""
    from fitgpt.model import PRESETS, ModelConfig

    for name, preset in PRESETS.items():
        if preset == cfg:
            return f"--preset {name}"
    shape = dict(n_layer=cfg.n_layer, n_embd=cfg.n_embd, n_head=cfg.n_head, seq_len=cfg.seq_len)
    if ModelConfig(**shape, vocab_size=cfg.vocab_size, tie_embeddings=cfg.tie_embeddings) != cfg:
        # fields without a flag (the family, rotary and norm settings): the run carries them
        return "none rebuild it; train with --init-from on the imported run"
    flags = (
        f"--layers {cfg.n_layer} --hidden {cfg.n_embd} --heads {cfg.n_head} "
        f"--seq-len {cfg.seq_len} --vocab-size {cfg.vocab_size}"
    )
    return flags + ("" if cfg.tie_embeddings else " --no-tie-embeddings")
