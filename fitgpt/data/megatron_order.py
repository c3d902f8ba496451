"""Megatron-LM's GPT sample order, index for index: `--sample-order megatron`.

Megatron's GPTDataset (megatron/core/datasets/gpt_dataset.py, `_build_document_sample_shuffle_
indices`, with `build_sample_idx` from helpers.cpp) fixes the whole run's order up front, from the
number of samples the run will draw (train_iters × global batch size). With the split's D
documents of T tokens in all, sequence length S and seed:

1. Epochs E: the fewest whole passes whose tokens cover num_samples·S + 1 (one pass when
   num_samples is not given).
2. Document index: the split's document ids repeated E times and shuffled as one array by
   `numpy.random.RandomState(seed)`, so epochs mix. When E > 1 and the last pass is needed for
   fewer than 80% of an epoch's samples, the last epoch is "separate": the first E - 1 copies
   are shuffled together, then the last copy on its own, so every document is seen E - 1 times
   before the partly used last epoch begins.
3. Sample index: the documents in that order are one token stream of E·T tokens; sample i is
   stream tokens [i·S, i·S + S + 1) (Megatron's add_extra_token_to_sequence, its default), and
   N = (E·T - 1) // S samples are built (drop_last_partial_sequence, its default). Row i of the
   index is (position in the document index, offset in that document) of stream token i·S.
4. Shuffle index: a permutation of the N samples drawn from the same RandomState right after
   the document index; with a separate last epoch, the samples before it and those from it
   are shuffled apart. Sample j of the run is sample shuffle[j].

Only the seed, not the split, seeds the RandomState: Megatron gives every split the same seed.
Everything is vectorised numpy; `MegatronSamples` reads a batch with one gather from the
memory-mapped .bin. Building costs what Megatron's does, the RandomState shuffles dominating: a
split of 10M documents with 2.4M samples takes 1.7 s of CPU (Megatron's own code, C++ sample
index included: 1.8 s), 2 epochs of it with 9.8M samples 4.7 s. So, like Megatron, large indices
are cached: as .npy files in PREFIX.index-cache/, named by everything they depend on, written
under temporary names and memory-mapped when read (a node's ranks share the pages).

Samples past N do not exist in Megatron (its dataset has N samples and an index past them is an
error), so `get` raises a UserError for them instead of wrapping into another epoch.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from fitgpt.data.indexed import IndexedDataset
from fitgpt.data.splits import SPLITS, cache_dir, save_atomic, split_ranges
from fitgpt.errors import UserError

SEPARATE_FINAL_EPOCH_BELOW = 0.80  # Megatron's threshold, as a fraction of an epoch's samples


@dataclass
class MegatronIndex:
    """Megatron's three arrays, same values and dtypes as its GPTDataset's."""

    document_index: np.ndarray  # int32 [E·D]: sequence ids of the .bin in stream order
    sample_index: np.ndarray  # int32 (int64 if huge) [N + 1, 2]: where stream token i·S lies
    shuffle_index: np.ndarray  # uint32 (int64 if huge) [N]: sample ids in the run's order
    num_epochs: int


def num_epochs(tokens_per_epoch: int, seq_len: int, num_samples: int | None) -> int:
    """Megatron's `_get_num_epochs`: passes needed for num_samples·S + 1 tokens (at least 1)."""
    if num_samples is None:
        return 1
    wanted = num_samples * seq_len + 1
    return max(1, -(-wanted // tokens_per_epoch))


def build_index(
    lengths: np.ndarray, lo: int, hi: int, seq_len: int, seed: int, num_samples: int | None
) -> MegatronIndex:
    """The index of the split holding sequences [lo, hi) of a dataset with these lengths."""
    tokens = int(lengths[lo:hi].sum(dtype=np.int64))
    epochs = num_epochs(tokens, seq_len, num_samples)
    separate, before_last = False, 0
    if epochs > 1:
        before_last = ((epochs - 1) * tokens - 1) // seq_len  # samples of the first E-1 passes
        from_last = num_samples - before_last  # type: ignore[operator]
        per_epoch = (tokens - 1) // seq_len
        separate = from_last < int(SEPARATE_FINAL_EPOCH_BELOW * per_epoch)
    rng = np.random.RandomState(seed)  # shared: the document shuffles draw first, then samples
    documents = np.arange(lo, hi, dtype=np.int32)
    if separate:
        doc_index = np.concatenate(
            [_shuffled_copies(documents, epochs - 1, rng), _shuffled_copies(documents, 1, rng)]
        )
    else:
        doc_index = _shuffled_copies(documents, epochs, rng)
    sample_index = build_sample_index(lengths, doc_index, seq_len, epochs * tokens)
    total = len(sample_index) - 1
    shuffle = build_shuffle_index(before_last if separate else total, total, rng)
    return MegatronIndex(doc_index, sample_index, shuffle, epochs)


def _shuffled_copies(documents: np.ndarray, copies: int, rng: np.random.RandomState) -> np.ndarray:
    """`copies` copies of the document ids, shuffled as one int32 array (`_build_document_index`)."""
    out = np.tile(documents.astype(np.int32), copies)
    rng.shuffle(out)  # the legacy Fisher-Yates: its draws depend only on the length
    return out


def build_sample_index(
    lengths: np.ndarray, doc_index: np.ndarray, seq_len: int, stream_tokens: int
) -> np.ndarray:
    """helpers.cpp `build_sample_idx`, vectorised: (k, offset) of stream token i·S, i = 0..N.

    Its loop walks the documents S + 1 tokens at a time and stops in the document holding the
    sample's last token, which is the next sample's first token i·S; so row i (i >= 1) is the
    non-empty document k with cum[k] <= i·S < cum[k + 1], found by one binary search per row.
    Row 0 is (0, 0) even if document 0 is empty, as in the loop. Costs a temporary int64 copy
    of the stream's document offsets (8 bytes per document-index entry).
    """
    n = (stream_tokens - 1) // seq_len
    big = max(len(doc_index), int(lengths.max(initial=0))) > np.iinfo(np.int32).max
    cum = np.zeros(len(doc_index) + 1, dtype=np.int64)
    np.cumsum(lengths[doc_index], out=cum[1:])
    start = np.arange(1, n + 1, dtype=np.int64) * seq_len
    k = np.searchsorted(cum, start, side="right") - 1
    out = np.zeros((n + 1, 2), dtype=np.int64 if big else np.int32)
    out[1:, 0], out[1:, 1] = k, start - cum[k]
    return out


def build_shuffle_index(first: int, total: int, rng: np.random.RandomState) -> np.ndarray:
    """[0, first) shuffled, then [first, total) shuffled (`_build_shuffle_index`)."""
    dtype = np.int64 if total >= np.iinfo(np.uint32).max - 1 else np.uint32
    head = np.arange(first, dtype=dtype)
    rng.shuffle(head)
    if first == total:
        return head
    tail = np.arange(first, total, dtype=dtype)
    rng.shuffle(tail)
    return np.concatenate([head, tail])


def index_files(
    data: IndexedDataset, lo: int, hi: int, seq_len: int, seed: int, num_samples: int | None
) -> dict[str, Path]:
    """The cache file of each MegatronIndex array (shuffle last: its presence means complete)."""
    tokens = int(data.lengths[lo:hi].sum(dtype=np.int64))
    stem = (
        f"{Path(data.prefix).name}.megatron.docs{lo}-{hi}.tokens{tokens}.seq{seq_len}.seed{seed}"
        f".samples{'-epoch' if num_samples is None else num_samples}"
    )
    names = ("document_index", "sample_index", "shuffle_index")
    return {k: cache_dir(data.prefix) / f"{stem}.{k}.npy" for k in names}


def cached_index(
    data: IndexedDataset,
    lo: int,
    hi: int,
    seq_len: int,
    seed: int,
    num_samples: int | None,
    cache_min_entries: int = 1 << 20,
) -> MegatronIndex:
    """build_index, through PREFIX.index-cache/ when the index has >= cache_min_entries entries.

    The entry count is known before building: E·D document-index entries and N samples follow
    from the lengths alone. A missing, partial or misshapen cache is rebuilt; a read-only data
    directory only disables the cache.
    """
    tokens = int(data.lengths[lo:hi].sum(dtype=np.int64))
    epochs = num_epochs(tokens, seq_len, num_samples)
    n = (epochs * tokens - 1) // seq_len
    if epochs * (hi - lo) + n < cache_min_entries:
        return build_index(data.lengths, lo, hi, seq_len, seed, num_samples)
    files = index_files(data, lo, hi, seq_len, seed, num_samples)
    shapes = {"document_index": (epochs * (hi - lo),), "sample_index": (n + 1, 2)}
    shapes["shuffle_index"] = (n,)
    try:
        arrays = {k: np.load(f, mmap_mode="r") for k, f in files.items()}
        if all(arrays[k].shape == shapes[k] for k in files):
            return MegatronIndex(**arrays, num_epochs=epochs)
    except (OSError, ValueError):
        pass
    index = build_index(data.lengths, lo, hi, seq_len, seed, num_samples)
    try:
        files["shuffle_index"].parent.mkdir(parents=True, exist_ok=True)
        for k, f in files.items():
            save_atomic(f, getattr(index, k))
    except OSError:
        pass  # read-only data directory: the index stays in memory, rebuilt next run
    return index


class MegatronSamples:
    """Samples of seq_len + 1 tokens in Megatron's order: sample j is Megatron's GPTDataset[j].

    num_samples is what Megatron calls the split's size: train_iters × global batch size for
    train. Indices 0 .. len(self) - 1 exist (len(self) >= num_samples: the last epoch is built
    whole); a larger index is an error.
    """

    def __init__(
        self,
        data: IndexedDataset,
        split: str,
        name: str,
        seq_len: int,
        seed: int,
        vocab_size: int,
        num_samples: int | None,
        cache_min_entries: int = 1 << 20,
    ) -> None:
        if name not in SPLITS:
            raise UserError(f"split name {name!r} is not one of {', '.join(SPLITS)}")
        if seq_len < 1:
            raise UserError(f"seq_len {seq_len} must be at least 1")
        if num_samples is not None and num_samples < 0:
            raise UserError(f"num_samples {num_samples} must be >= 0")
        self.lo, self.hi = split_ranges(split, data.num_sequences)[name]
        if self.lo == self.hi:
            raise UserError(f"--split {split} gives the {name} split weight 0; give it a weight")
        self.data, self.name, self.seq_len, self.seed = data, name, seq_len, seed
        self.vocab_size, self.num_samples = vocab_size, num_samples
        self.num_tokens = int(data.lengths[self.lo : self.hi].sum(dtype=np.int64))
        if self.num_tokens - 1 < seq_len:
            raise UserError(
                f"the {name} split of {data.prefix} ({self.hi - self.lo} documents, "
                f"{self.num_tokens} tokens) is shorter than one sample of {seq_len + 1} tokens; "
                "give it more weight in --split or use a shorter --seq-len"
            )
        self.index = cached_index(
            data, self.lo, self.hi, seq_len, seed, num_samples, cache_min_entries
        )
        self._starts = data.pointers // data.dtype.itemsize  # int64 [sequences]: .bin token index

    def __len__(self) -> int:
        return len(self.index.shuffle_index)

    def get(self, idx: np.ndarray) -> np.ndarray:
        """Samples `idx` (int64 [n], 0 <= idx < len(self)) as int64 [n, seq_len + 1]."""
        idx = np.asarray(idx, dtype=np.int64).reshape(-1)
        if idx.size and idx.min() < 0:
            raise ValueError(f"sample indices must be >= 0, got {int(idx.min())}")
        if idx.size and idx.max() >= len(self):
            raise UserError(
                f"sample {int(idx.max())} is past the {len(self)} samples of Megatron's order for "
                f"the {self.name} split (built for num_samples={self.num_samples}); Megatron "
                "fixes a run's length up front: build it for the whole run, or use "
                "--sample-order fitgpt, which has no end"
            )
        s = self.index.shuffle_index[idx].astype(np.int64)
        rows = self._positions(s).reshape(len(idx), self.seq_len + 1)
        return self.data.tokens[rows].astype(np.int64)

    def _positions(self, s: np.ndarray) -> np.ndarray:
        """.bin token index of every token of samples `s`, row after row (int64 [n·(S+1)]).

        A sample runs from (k0, o0) = sample_index[s] through (k1, o1) = sample_index[s + 1],
        the last token included: pieces of documents k0..k1 of the document index, as Megatron's
        `_query_document_sample_shuffle_indices` reads them, gathered without a Python loop.
        """
        k0, o0 = self.index.sample_index[s].astype(np.int64).T
        k1, o1 = self.index.sample_index[s + 1].astype(np.int64).T
        count = k1 - k0 + 1  # [n] pieces per sample (empty documents give empty pieces)
        row = np.repeat(np.arange(len(s)), count)
        k = np.arange(len(row)) - np.repeat(np.cumsum(count) - count, count) + k0[row]
        doc = self.index.document_index[k]
        first = np.where(k == k0[row], o0[row], 0)  # piece bounds inside the document
        end = np.where(k == k1[row], o1[row] + 1, self.data.lengths[doc])
        size = end - first
        offset = np.repeat(np.cumsum(size) - size, size)  # tokens before the piece
        return np.repeat(self._starts[doc] + first, size) + np.arange(int(size.sum())) - offset
