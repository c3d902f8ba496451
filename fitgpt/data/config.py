"""What to train on: one small config, and the function that opens it."""

from __future__ import annotations

import glob
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Literal

import numpy as np

from fitgpt.data import sidecar
from fitgpt.data.tokenizer import Tokenizer, load_tokenizer, same_vocabulary
from fitgpt.errors import UserError

if TYPE_CHECKING:  # source.py imports torch (~4 s on a busy 2-core box): not for `fitgpt --help`
    from fitgpt.data.source import SampleSource

BUILTIN = ("stdlib", "synthetic", "uniform")
# Megatron-LM's usual train,valid,test weights: what --split auto means on any corpus where they
# give every split a document (see `resolve_split`).
MEGATRON_SPLIT = "969,30,1"


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
            "auto: for a PREFIX the one recorded with the data (none for `data fake` ids, gpt2 "
            "without a record), bytes for stdlib"
        },
    )
    split: str = field(
        default="auto",
        metadata={
            "help": "train,valid,test weights for a Megatron dataset; auto: 969,30,1, or on a "
            "corpus too small for it, 30 in 1000 documents (at least 1) to validate and no test"
        },
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
            from fitgpt.paths import check_input_prefix

            check_input_prefix(self.data, "--data")  # a folder is named as one
            near = _preprocessed_from(self.data)
            if near:  # the --output-prefix given to preprocess, not the prefix it wrote
                raise UserError(
                    f"--data {self.data}: no {self.data}.bin/.idx pair; `fitgpt data preprocess "
                    f"--output-prefix {self.data}` wrote {' and '.join(near)}: pass --data {near[0]}"
                )
            raise UserError(
                f"--data {self.data}: not one of {', '.join(BUILTIN)} and no {self.data}.bin/.idx "
                "pair exists; run `fitgpt data preprocess` first or fix the prefix"
            )

    def tokenizer_spec(self) -> str:
        """The tokenizer spec this data trains with: --tokenizer when given; for auto, a
        Megatron PREFIX's recorded tokenizer (fitgpt/data/sidecar.py: its absolute spec if that
        loads with the recorded fingerprint, else the spec as given), else bytes for stdlib and
        none for a PREFIX recorded without one (`fitgpt data fake`: its ids are no tokenizer's
        text), bytes for stdlib and gpt2 for the rest (a PREFIX without a record)."""
        if self.tokenizer != "auto":
            return self.tokenizer
        if self.data not in BUILTIN:
            if sidecar.recorded_vocabulary(self.data) is not None:
                return "none"
            recorded = sidecar.recorded_tokenizer(self.data)
            if recorded is not None:
                return recorded.name
        return "bytes" if self.data == "stdlib" else "gpt2"


def _prefix_exists(prefix: str) -> bool:
    return Path(prefix + ".bin").is_file() and Path(prefix + ".idx").is_file()


def _preprocessed_from(prefix: str) -> list[str]:
    """The prefixes `fitgpt data preprocess --output-prefix PREFIX` writes that exist
    (PREFIX_{json key}_document, PREFIX_chat_document), sorted: Megatron's naming adds the
    suffix, so the prefix a user typed for preprocess is the likeliest wrong --data."""
    found = sorted(p[: -len(".idx")] for p in glob.glob(glob.escape(prefix) + "_*_document.idx"))
    return [f for f in found if _prefix_exists(f)]


def data_tokenizer(cfg: DataConfig) -> Tokenizer | None:
    """The tokenizer of a run on this data (checked against the one recorded with a PREFIX);
    None for synthetic and pre-tokenized data, whose vocabulary is the model's own. Its
    vocabulary decides the model's embedding, so it is resolved before planning.

    Data made by `fitgpt data fake` (tokenizer auto) gets its recorded vocabulary, a
    sidecar.RecordedVocabulary that holds no text: `--vocab 512` data trains a 512-token model,
    not one of GPT-2's 50,257, and nothing decodes its ids as some tokenizer's text."""
    if cfg.data in ("synthetic", "uniform"):
        return None
    if cfg.tokenizer_spec() == "none":
        # an explicit none keeps the model's --vocab-size as the bound of the ids
        return sidecar.recorded_vocabulary(cfg.data) if cfg.tokenizer == "auto" else None
    tok = load_tokenizer(cfg.tokenizer_spec())
    if cfg.data not in BUILTIN:
        sidecar.check(cfg.data, tok, "cannot train on it")  # an explicit --tokenizer must match
    return tok


def model_for_data(model, data, keep_rows: bool = False, whose: str = "the model"):
    """The model config with the vocabulary of the data's tokenizer (synthetic data keeps the
    model's own); see vocab_for."""
    return vocab_for(model, data_tokenizer(data), keep_rows, whose)


def vocab_for(model, tok, keep_rows: bool = False, whose: str = "the model"):
    """`model` sized for tokenizer `tok` (None: no tokenizer, the model's own vocabulary).

    A model trained from scratch gets the tokenizer's vocabulary. A model whose embedding comes
    from weights (`keep_rows`: a run's train.finetune, set by --init-from) keeps its rows: they
    are the model's, and a released model often has more rows than its tokenizer has ids
    (Qwen2.5: 152,064 for 151,665; Qwen3: 151,936 for 151,669), which HF computes logits for as
    for any row, so the fine-tune and its export keep them. The rule there is that the data's
    ids lie below the rows: a tokenizer of more ids is refused in one line."""
    if tok is None:
        return model
    if not keep_rows and tok.vocab_size != model.vocab_size:
        return model.replace(vocab_size=tok.vocab_size)
    if keep_rows and tok.vocab_size > model.vocab_size:
        raise UserError(
            f"{whose} has {model.vocab_size} embedding rows, the data's tokenizer {tok.name} "
            f"{tok.vocab_size} ids: its ids must lie below the rows; train on data made with "
            "the model's own tokenizer (fitgpt data preprocess --tokenizer)"
        )
    return model


def check_data_tokenizer(tok, spec: str | None, data: DataConfig, whose: str) -> None:
    """Refuse, in one line, data made with a tokenizer other than `spec`, the one `whose` model
    was trained with (an --init-from source's): its ids would be trained as other tokens (a
    tokenizer of the same size passes every size check). The test is `fitgpt generate`'s for
    --tokenizer (tokenizer.py same_vocabulary: size, end of document, every token's text),
    skipped where the model records no tokenizer or the data has no text (`fitgpt data fake`
    ids), and where both name the same files."""
    if spec is None or tok is None or isinstance(tok, sidecar.RecordedVocabulary):
        return
    if _same_spec(tok.name, spec) or same_vocabulary(tok, spec):
        return
    raise UserError(
        f"{whose}: the data {data.data} is made with tokenizer {tok.name} ({tok.vocab_size} "
        f"tokens), another vocabulary than the model's ({spec}); make the data with the "
        f"model's tokenizer (fitgpt data preprocess --tokenizer {spec})"
    )


def _same_spec(a: str, b: str) -> bool:
    """Two tokenizer specs naming the same files (or the same built-in name)."""
    return [os.path.realpath(p) for p in a.split(",")] == [
        os.path.realpath(p) for p in b.split(",")
    ]


def resolve_split(split: str, num_docs: int, validates: bool = True) -> str:
    """The train,valid,test weights `--split` means over `num_docs` documents.

    An explicit split is taken as given: Megatron's arithmetic, refused (splits.split_ranges)
    where a weighted split gets no document. auto is MEGATRON_SPLIT wherever that gives every
    split a document, so a large corpus splits exactly as Megatron-LM would. A smaller corpus
    (under ~1,500 documents, where 1 in 1,000 rounds to no test document) keeps no test split,
    which training never reads, and validates on its 3% share of the documents, at least 1:
    400 documents give 388,12,0. A run that does not validate (--eval-every 0) on a single
    document trains on it (1,0,0)."""
    if split != "auto":
        return split
    from fitgpt.data.splits import split_ranges

    try:
        split_ranges(MEGATRON_SPLIT, num_docs)
        return MEGATRON_SPLIT
    except UserError:
        pass
    if num_docs < 2:  # nothing to hold out: the strict split's error says what to do
        return "1,0,0" if not validates and num_docs == 1 else MEGATRON_SPLIT
    valid = min(max(1, round(num_docs * 30 / 1000)), num_docs - 1)
    return f"{num_docs - valid},{valid},0"


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
    from fitgpt.data.gpt_dataset import open_megatron_split, open_megatron_splits
    from fitgpt.data.indexed import IndexedDataset
    from fitgpt.data.splits import parse_split

    # A run that draws no validation sample (--eval-every 0) opens no validation split: it
    # needs no weight, and a weighted one is not read.
    validates = num_samples[1] != 0
    split = cfg.split
    if split == "auto":  # the count costs a second open of the index: only for auto
        split = resolve_split(split, IndexedDataset(cfg.data).num_sequences, validates)
    if validates and parse_split(split)[1] == 0:
        raise UserError(
            f"--split {cfg.split} gives validation weight 0, but the run validates every "
            "--eval-every steps; give validation a weight (e.g. --split 969,30,1) or pass "
            "--eval-every 0"
        )
    kw = dict(
        vocab_size=vocab_size if tok is None else tok.vocab_size,
        vocab_source="--vocab-size" if tok is None else "tokenizer",
        sample_order=cfg.sample_order,
    )
    if validates:
        train, valid = open_megatron_splits(
            cfg.data, split, seq_len, seed, num_samples=num_samples, **kw
        )
    else:
        train = open_megatron_split(
            cfg.data, split, "train", seq_len, seed, num_samples=num_samples[0], **kw
        )
        valid = None
    # a recorded vocabulary sized the model; it is no tokenizer to record with the run
    return train, valid, None if isinstance(tok, sidecar.RecordedVocabulary) else tok
