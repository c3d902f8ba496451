"""What to train on: one small config, and the function that opens it."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Literal

import numpy as np

from fitgpt.data import sidecar
from fitgpt.data.tokenizer import Tokenizer, load_tokenizer
from fitgpt.errors import UserError

if TYPE_CHECKING:  # source.py imports torch (~4 s on a busy 2-core box): not for `fitgpt --help`
    from fitgpt.data.source import SampleSource

BUILTIN = ("stdlib", "synthetic", "uniform")


@dataclass(frozen=True)
class DataConfig:
    data: str = field(
        default="synthetic",
        metadata={
            "help": "stdlib (Python's own source as text), synthetic (a learnable Markov chain), "
            "uniform (random tokens, for speed runs), or PREFIX of a Megatron .bin/.idx pair"
        },
    )
    tokenizer: str = field(
        default="auto",
        metadata={
            "help": "bytes, gpt2, VOCAB.json,MERGES.txt, a tokenizer.json or a directory holding "
            "one (or vocab.json + merges.txt); none: pre-tokenized data, ids < --vocab-size; "
            "auto: for a PREFIX the one recorded with the data (gpt2 if none), bytes for stdlib"
        },
    )
    split: str = field(
        default="969,30,1", metadata={"help": "train,valid,test weights for a Megatron dataset"}
    )
    sample_order: Literal["fitgpt", "megatron"] = field(
        default="fitgpt",
        metadata={
            "help": "order of a Megatron dataset's samples: fitgpt (epochs reshuffled, no end) or "
            "megatron (Megatron-LM GPTDataset's order for the same seed, split and seq_len)"
        },
    )

    def __post_init__(self) -> None:
        if self.sample_order not in ("fitgpt", "megatron"):
            raise UserError(f"--sample-order {self.sample_order!r}: use fitgpt or megatron")
        if self.tokenizer == "none" and self.data == "stdlib":
            raise UserError(
                "--tokenizer none is for pre-tokenized .bin/.idx data; stdlib is text and needs "
                "a tokenizer (bytes, gpt2, ...)"
            )
        if self.data not in BUILTIN and not _prefix_exists(self.data):
            raise UserError(
                f"--data {self.data}: not one of {', '.join(BUILTIN)} and no {self.data}.bin/.idx "
                "pair exists; run `fitgpt data preprocess` first or fix the prefix"
            )

    def tokenizer_spec(self) -> str:
        """The tokenizer spec this data trains with: --tokenizer when given; for auto, a
        Megatron PREFIX's recorded tokenizer (fitgpt/data/sidecar.py: its absolute spec if that
        loads with the recorded fingerprint, else the spec as given), else bytes for stdlib and
        gpt2 for the rest (a PREFIX without a record, or one of fake data)."""
        if self.tokenizer != "auto":
            return self.tokenizer
        if self.data not in BUILTIN:
            recorded = sidecar.recorded_tokenizer(self.data)
            if recorded is not None:
                return recorded.name
        return "bytes" if self.data == "stdlib" else "gpt2"


def _prefix_exists(prefix: str) -> bool:
    return Path(prefix + ".bin").is_file() and Path(prefix + ".idx").is_file()


def data_tokenizer(cfg: DataConfig) -> Tokenizer | None:
    """The tokenizer of a run on this data (checked against the one recorded with a PREFIX);
    None for synthetic and pre-tokenized data, whose vocabulary is the model's own. Its
    vocabulary decides the model's embedding, so it is resolved before planning."""
    if cfg.data in ("synthetic", "uniform") or cfg.tokenizer_spec() == "none":
        return None  # none: pre-tokenized data, the model's vocabulary bounds the ids
    tok = load_tokenizer(cfg.tokenizer_spec())
    if cfg.data not in BUILTIN:
        sidecar.check(cfg.data, tok, "cannot train on it")  # an explicit --tokenizer must match
    return tok


def open_data(
    cfg: DataConfig,
    seq_len: int,
    vocab_size: int,
    seed: int,
    *,
    num_samples: tuple[int | None, int | None] = (None, None),
) -> tuple[SampleSource, SampleSource, Tokenizer | None]:
    """(train, valid, tokenizer). `vocab_size` is the model's: synthetic data uses it, and with
    `--tokenizer none` it is the vocabulary the .bin is checked against (the tokenizer is None).
    `num_samples` (train, valid) are the samples the run will draw; only `--sample-order
    megatron` uses them, since Megatron fixes its order for the run's length (None: one epoch).
    """
    from fitgpt.data.synthetic import synthetic_splits
    from fitgpt.data.text import stdlib_text, text_splits

    tok = data_tokenizer(cfg)
    if cfg.data == "stdlib":
        tokens = np.asarray(tok.encode(stdlib_text()), dtype=np.int32)
        return (*text_splits(tokens, seq_len, tok.vocab_size, seed), tok)
    if cfg.data in ("synthetic", "uniform"):
        return (
            *synthetic_splits(
                seq_len, vocab_size, seed, structure=cfg.data.replace("synthetic", "markov")
            ),
            None,
        )
    from fitgpt.data.gpt_dataset import open_megatron_splits

    train, valid = open_megatron_splits(
        cfg.data,
        cfg.split,
        seq_len,
        seed,
        vocab_size=vocab_size if tok is None else tok.vocab_size,
        vocab_source="--vocab-size" if tok is None else "tokenizer",
        sample_order=cfg.sample_order,
        num_samples=num_samples,
    )
    return train, valid, tok
