"""What to train on: one small config, and the function that opens it."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

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
            "help": "bytes, gpt2, VOCAB.json,MERGES.txt, or a DIR; auto: for a PREFIX the one "
            "recorded with the data (gpt2 if none), bytes for stdlib, gpt2 else"
        },
    )
    split: str = field(
        default="969,30,1", metadata={"help": "train,valid,test weights for a Megatron dataset"}
    )

    def __post_init__(self) -> None:
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


def open_data(
    cfg: DataConfig, seq_len: int, vocab_size: int, seed: int
) -> tuple[SampleSource, SampleSource, Tokenizer | None]:
    """(train, valid, tokenizer). `vocab_size` is the model's, used only by synthetic data."""
    from fitgpt.data.synthetic import synthetic_splits
    from fitgpt.data.text import stdlib_text, text_splits

    if cfg.data == "stdlib":
        tok = load_tokenizer(cfg.tokenizer_spec())
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

    tok = load_tokenizer(cfg.tokenizer_spec())
    sidecar.check(cfg.data, tok, "cannot train on it")  # an explicit --tokenizer must match
    train, valid = open_megatron_splits(
        cfg.data, cfg.split, seq_len, seed, vocab_size=tok.vocab_size
    )
    return train, valid, tok
