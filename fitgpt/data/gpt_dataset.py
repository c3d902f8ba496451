"""GPT samples from a Megatron .bin/.idx pair: train/valid/test splits, any number of epochs.

Splits are contiguous document ranges, in file order, with Megatron's exact boundaries: with weights
w and D documents, split i holds documents [round(D·W_i), round(D·W_{i+1})) where W is the
cumulative weight fraction and round is Python's (half to even), see `splits.split_ranges`. A split with weight > 0 that gets no document is an error naming every count and
suggesting weights that work; weight 0 means "no such split". (For GPT, Megatron's unit is the
sequence; preprocessing writes one sequence per document, so the two agree.)

One epoch of a split: its documents in an order shuffled under (seed, split, epoch), joined into
one token stream; sample k is stream tokens [k·S, k·S + S + 1), so N = (T - 1) // S samples use T
tokens and cross document boundaries; the samples' order is shuffled too. Global sample j is
sample shuffle[j mod N] of epoch j // N: any j >= 0 is valid, each epoch reshuffles, and j alone
fixes the sample, so a run resumes exactly from a saved position and each data-parallel rank
reads only its own rows (memory-mapped).

Per epoch the index is three arrays: `shuffle_idx` (the N sample ids in epoch order), `doc_cum`
(stream tokens before each document of the shuffled order, D + 1) and `doc_shift` (where each
such document starts in the .bin minus where it starts in the stream, D). A sample is located at
read time by a binary search in `doc_cum`, so there is no per-sample table. Splits with at least
`cache_min_entries` entries (D + N) cache the arrays as .npy files in PREFIX.index-cache/, named
by split, document range, seq_len, seed, N and epoch, each written to a temporary name and
renamed, and memory-mapped when read; smaller splits are rebuilt in memory in milliseconds. A
read-only data directory only disables the cache.

Chat data (a PREFIX.loss_mask pair beside the tokens, from `fitgpt data preprocess --chat`) is
read by packed.PackedSamples instead: whole samples packed into rows, never a stream.

vocab_size is the tokenizer's when given (checked against the data), else the largest token + 1;
the largest token is found by one pass over the .bin and cached in PREFIX.index-cache/.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from fitgpt.data.chat import is_chat_data
from fitgpt.data.indexed import IndexedDataset
from fitgpt.data.megatron_order import MegatronSamples
from fitgpt.data.splits import SPLITS, cache_dir, parse_split, save_atomic, split_ranges
from fitgpt.errors import UserError

if TYPE_CHECKING:
    from fitgpt.data.source import SampleSource  # imports torch, which the data tools never need

EPOCHS_KEPT = 2  # a batch can straddle one epoch boundary: keep the two epochs it touches


def open_megatron_splits(
    prefix: str,
    split: str,
    seq_len: int,
    seed: int,
    *,
    vocab_size: int | None = None,
    vocab_source: str = "tokenizer",
    sample_order: str = "fitgpt",
    num_samples: tuple[int | None, int | None] = (None, None),
) -> tuple[SampleSource, SampleSource]:
    """(train, valid) sources of the .bin/.idx pair at `prefix`.

    vocab_source ("tokenizer" or "--vocab-size") only words the error when the data holds an id
    >= vocab_size. num_samples (train, valid) is used by sample_order "megatron" alone, which
    fixes the order for that many samples up front (None: one epoch).
    """
    if parse_split(split)[1] == 0:
        raise UserError(
            f"--split {split} gives the valid split weight 0, but training validates; "
            "give it a weight, e.g. --split 969,30,1"
        )
    data, chat = _open(prefix)
    vocab = _vocab_size(data, vocab_size, vocab_source)
    args = (data, chat, split, seq_len, seed, vocab, sample_order)
    return _samples(*args, "train", num_samples[0]), _samples(*args, "valid", num_samples[1])


def open_megatron_split(
    prefix: str,
    split: str,
    name: str,
    seq_len: int,
    seed: int,
    *,
    vocab_size: int | None = None,
    vocab_source: str = "tokenizer",
    sample_order: str = "fitgpt",
    num_samples: int | None = None,
) -> SampleSource:
    """One split ('train', 'valid' or 'test') of the .bin/.idx pair at `prefix`."""
    data, chat = _open(prefix)
    vocab = _vocab_size(data, vocab_size, vocab_source)
    return _samples(data, chat, split, seq_len, seed, vocab, sample_order, name, num_samples)


def _open(prefix: str) -> tuple[IndexedDataset, bool]:
    """The pair at `prefix`, and whether it is chat data (decided here, before the pass over
    the tokens that finds the largest id: chat data without its mask is refused first)."""
    return IndexedDataset(prefix), is_chat_data(prefix)


def _samples(
    data: IndexedDataset,
    chat: bool,
    split: str,
    seq_len: int,
    seed: int,
    vocab: int,
    order: str,
    name: str,
    num_samples: int | None,
) -> SampleSource:
    if chat:  # preprocess --chat: samples packed whole, packed.py
        if order != "fitgpt":
            raise UserError(
                f"--sample-order {order}: {data.prefix} is chat data with a loss mask, whose "
                "samples fitgpt packs whole (Megatron has no such order); use --sample-order fitgpt"
            )
        from fitgpt.data.packed import PackedSamples

        return PackedSamples(data, split, name, seq_len, seed, vocab)
    if order == "fitgpt":
        return GPTSamples(data, split, name, seq_len, seed, vocab)
    if order == "megatron":
        return MegatronSamples(data, split, name, seq_len, seed, vocab, num_samples)
    raise UserError(f"--sample-order {order!r}: use fitgpt or megatron")


@dataclass
class _Epoch:
    shuffle: np.ndarray  # int32/64 [N]: sample ids in this epoch's order
    cum: np.ndarray  # int64 [D + 1]: stream tokens before each document of this epoch's order
    shift: np.ndarray  # int64 [D]: .bin token index minus stream index, per document


class GPTSamples:
    """Samples of seq_len + 1 tokens from one split: any index >= 0, no end, no StopIteration."""

    def __init__(
        self,
        data: IndexedDataset,
        split: str,
        name: str,
        seq_len: int,
        seed: int,
        vocab_size: int,
        cache_min_entries: int = 1 << 20,
    ) -> None:
        if name not in SPLITS:
            raise UserError(f"split name {name!r} is not one of {', '.join(SPLITS)}")
        if seq_len < 1:
            raise UserError(f"seq_len {seq_len} must be at least 1")
        self.lo, self.hi = split_ranges(split, data.num_sequences)[name]
        if self.lo == self.hi:
            raise UserError(f"--split {split} gives the {name} split weight 0; give it a weight")
        self.data, self.name, self.seq_len, self.seed = data, name, seq_len, seed
        self.vocab_size = vocab_size
        self.num_documents = self.hi - self.lo
        self.num_tokens = int(data.lengths[self.lo : self.hi].sum(dtype=np.int64))
        self.samples_per_epoch = (self.num_tokens - 1) // seq_len
        if self.samples_per_epoch < 1:
            raise UserError(
                f"the {name} split of {data.prefix} ({self.num_documents} documents, "
                f"{self.num_tokens} tokens) is shorter than one sample of {seq_len + 1} tokens; "
                "give it more weight in --split or use a shorter --seq-len"
            )
        self.cache_dir = cache_dir(data.prefix)
        big = self.num_documents + self.samples_per_epoch >= cache_min_entries
        self._cache = self.cache_dir if big else None
        self._epochs: dict[int, _Epoch] = {}
        self._window = np.arange(seq_len + 1, dtype=np.int64)

    def get(self, idx: np.ndarray) -> np.ndarray:
        """Samples `idx` (int64 [n], any values >= 0) as int64 [n, seq_len + 1]."""
        idx = np.asarray(idx, dtype=np.int64).reshape(-1)
        if idx.size and idx.min() < 0:
            raise ValueError(f"sample indices must be >= 0, got {int(idx.min())}")
        epoch, k = np.divmod(idx, self.samples_per_epoch)
        out = np.empty((idx.size, self.seq_len + 1), dtype=np.int64)
        epochs = np.unique(epoch)
        for e in epochs:
            rows = epoch == e if len(epochs) > 1 else slice(None)  # usually one epoch
            ep = self._epoch(int(e))
            start = ep.shuffle[k[rows]].astype(np.int64) * self.seq_len  # [n] in the stream
            doc = self._documents(ep.cum, start)  # [n, S+1]: the document holding each token
            out[rows] = self.data.tokens[start[:, None] + self._window + ep.shift[doc]]
        return out

    def _documents(self, cum: np.ndarray, start: np.ndarray) -> np.ndarray:
        """Document (position in the epoch's order) of each token of the rows starting at `start`.

        Two binary searches per row find its first and last document; the documents in between
        begin at known columns, so a cumulative sum of +1 marks fills the [n, S+1] table. This
        costs O(n·S) adds instead of a binary search per token (8×1024 tokens: ~30 µs vs ~300).
        """
        n, width = len(start), self.seq_len + 1
        first = np.searchsorted(cum, start, side="right") - 1
        last = np.searchsorted(cum, start + self.seq_len, side="right") - 1
        if (last == first).all():  # every row inside one document: the common case
            return np.broadcast_to(first[:, None], (n, width))
        count = last - first  # documents beginning inside each row (zero-length ones included)
        row = np.repeat(np.arange(n), count)
        skip = np.repeat(np.cumsum(count) - count, count)
        d = np.repeat(first + 1, count) + np.arange(len(row)) - skip
        marks = np.bincount(row * width + (cum[d] - start[row]), minlength=n * width)
        return first[:, None] + np.cumsum(marks.reshape(n, width), axis=1)

    def _epoch(self, e: int) -> _Epoch:
        if e not in self._epochs:
            if len(self._epochs) >= EPOCHS_KEPT:
                self._epochs.pop(next(iter(self._epochs)))  # frees the oldest epoch's arrays
            self._epochs[e] = self._build(e)
        return self._epochs[e]

    def _build(self, e: int) -> _Epoch:
        cached = self._load(e)
        if cached is not None:
            return cached
        rng = np.random.default_rng([self.seed, SPLITS.index(self.name), e])
        order = self.lo + rng.permutation(self.num_documents)  # this epoch's document order
        shuffle = rng.permutation(self.samples_per_epoch).astype(
            _index_dtype(self.samples_per_epoch)
        )
        cum = np.zeros(len(order) + 1, dtype=np.int64)
        np.cumsum(self.data.lengths[order], out=cum[1:])
        shift = self.data.pointers[order] // self.data.dtype.itemsize - cum[:-1]
        epoch = _Epoch(shuffle, cum, shift)
        self._save(e, epoch)
        return epoch

    def cache_files(self, e: int) -> dict[str, Path]:
        """The .npy file of each _Epoch array (shuffle last: its presence means complete)."""
        stem = (
            f"{Path(self.data.prefix).name}.{self.name}.docs{self.lo}-{self.hi}.seq{self.seq_len}"
            f".seed{self.seed}.n{self.samples_per_epoch}.epoch{e}"
        )
        names = {"cum": "doc_cum", "shift": "doc_shift", "shuffle": "shuffle_idx"}
        return {k: self.cache_dir / f"{stem}.{v}.npy" for k, v in names.items()}

    def _load(self, e: int) -> _Epoch | None:
        if self._cache is None:
            return None
        D, N = self.num_documents, self.samples_per_epoch
        shapes = {"cum": (D + 1,), "shift": (D,), "shuffle": (N,)}
        arrays = {}
        for k, path in self.cache_files(e).items():
            try:
                arrays[k] = np.load(path, mmap_mode="r")  # page cache shared by a node's ranks
            except (OSError, ValueError):
                return None
            if arrays[k].shape != shapes[k]:
                return None
        return _Epoch(**arrays)

    def _save(self, e: int, epoch: _Epoch) -> None:
        if self._cache is None:
            return
        try:
            self._cache.mkdir(parents=True, exist_ok=True)
            for k, path in self.cache_files(e).items():
                save_atomic(path, getattr(epoch, k))
        except OSError:
            pass  # read-only data directory: the index stays in memory, rebuilt next run


def _index_dtype(n: int) -> type[np.integer]:
    return np.int32 if n < np.iinfo(np.int32).max else np.int64


def _vocab_size(data: IndexedDataset, vocab_size: int | None, source: str = "tokenizer") -> int:
    """The given vocabulary (checked against the data), else the largest token + 1."""
    top = max_token(data)
    if vocab_size is None:
        return top + 1
    if top < vocab_size:
        return vocab_size
    if source == "tokenizer":
        raise UserError(
            f"{data.prefix}.bin holds token id {top} but the tokenizer has {vocab_size} tokens; "
            "pass the --tokenizer the data was made with"
        )
    raise UserError(
        f"{data.prefix}.bin holds token id {top} but --vocab-size is {vocab_size}; "
        f"pass --vocab-size {top + 1} or more"
    )


def max_token(data: IndexedDataset) -> int:
    """The largest token id of the .bin, cached in PREFIX.index-cache/ by the file's size and time."""
    stat = Path(data.prefix + ".bin").stat()
    key = {"bin_bytes": stat.st_size, "mtime_ns": stat.st_mtime_ns}
    path = cache_dir(data.prefix) / f"{Path(data.prefix).name}.max_token.json"
    try:
        saved = json.loads(path.read_text())
        if {k: saved.get(k) for k in key} == key:
            return int(saved["max_token"])
    except (OSError, ValueError, KeyError):
        pass
    top = data.max_token()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps({**key, "max_token": top}))
        os.replace(tmp, path)
    except OSError:
        pass
    return top
