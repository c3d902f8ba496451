"""GPT samples from .bin/.idx: splits, epochs without end, determinism, resume, rank shares."""

from __future__ import annotations

import re

import numpy as np
import pytest
import torch

from fitgpt.data.config import DataConfig, open_data
from fitgpt.data.gpt_dataset import (
    GPTSamples,
    open_megatron_split,
    open_megatron_splits,
)
from fitgpt.data.indexed import IndexedDataset, IndexedWriter
from fitgpt.data.source import BatchLoader
from fitgpt.data.splits import split_ranges
from fitgpt.errors import UserError


def _corpus(path, n_docs=40, seed=0, vocab=1000, dtype=np.uint16) -> str:
    """Documents of 1..60 tokens; token values encode (document, position) for easy checking."""
    rng = np.random.default_rng(seed)
    lengths = rng.integers(1, 60, n_docs)
    tokens = np.concatenate([(d * 7 + np.arange(n)) % vocab for d, n in enumerate(lengths)])
    with IndexedWriter(str(path), dtype) as w:
        w.add(tokens, lengths)
    return str(path)


def _doc_ids(src: GPTSamples, epoch: int) -> np.ndarray:
    ep = src._epoch(epoch)
    starts = ep.shift + ep.cum[:-1]  # .bin token index where each document starts
    return np.searchsorted(src.data.pointers // src.data.dtype.itemsize, starts)


def test_samples_are_windows_of_the_shuffled_document_stream(tmp_path):
    src = open_megatron_split(_corpus(tmp_path / "c"), "1", "train", 16, seed=3)
    ids = _doc_ids(src, 0)
    assert sorted(ids.tolist()) == list(range(40))  # every document once per epoch
    assert ids.tolist() != list(range(40))  # in a shuffled order
    stream = np.concatenate([src.data[int(i)] for i in ids]).astype(np.int64)
    n = src.samples_per_epoch
    assert n == (len(stream) - 1) // 16
    got = src.get(np.arange(n))
    want = np.stack([stream[k * 16 : k * 16 + 17] for k in range(n)])
    order = src._epoch(0).shuffle
    assert np.array_equal(got, want[order])  # sample j of epoch 0 is window shuffle[j]
    assert sorted(order.tolist()) == list(range(n)) and order.tolist() != list(range(n))


def test_epochs_roll_over_reshuffled_without_stopiteration(tmp_path):
    src = open_megatron_split(_corpus(tmp_path / "c"), "1", "train", 16, seed=0)
    n = src.samples_per_epoch
    loader = BatchLoader(src, micro_batch=7)
    seen = [loader.next()[0] for _ in range(5 * n // 7 + 3)]  # five epochs and more
    assert all(x.shape == (7, 16) for x in seen)
    e0, e1 = src.get(np.arange(n)), src.get(np.arange(n, 2 * n))
    assert not np.array_equal(e0, e1)  # another document order and sample order
    # both epochs use every document: the same multiset of tokens up to the leftover tail
    assert abs(len(np.unique(e0[:, :-1])) - len(np.unique(e1[:, :-1]))) < 60
    assert src.get(np.array([10**12])).shape == (1, 17)  # any index at all


def test_deterministic_and_resumable(tmp_path):
    prefix = _corpus(tmp_path / "c")
    a, _ = open_megatron_splits(prefix, "8,2", 8, seed=5)
    b, _ = open_megatron_splits(prefix, "8,2", 8, seed=5)
    c, _ = open_megatron_splits(prefix, "8,2", 8, seed=6)
    idx = np.array([0, 3, 999, 12345, 2])
    assert np.array_equal(a.get(idx), b.get(idx)) and not np.array_equal(a.get(idx), c.get(idx))
    full = BatchLoader(a, 4)
    batches = [full.next() for _ in range(40)]
    resumed = BatchLoader(b, 4)
    resumed.load_state_dict({"position": 25})
    for k in range(25, 40):
        x, y, _ = resumed.next()
        assert torch.equal(x, batches[k][0]) and torch.equal(y, batches[k][1])


def test_each_rank_reads_its_share(tmp_path):
    src, _ = open_megatron_splits(_corpus(tmp_path / "c"), "9,1", 8, seed=0)
    one = BatchLoader(src, 4, rank=0, world=1)
    two = [BatchLoader(src, 2, rank=r, world=2) for r in range(2)]
    for _ in range(30):
        x = one.next()[0]
        assert torch.equal(x, torch.cat([two[0].next()[0], two[1].next()[0]]))


def test_split_ranges_megatron_semantics():
    assert split_ranges("969,30,1", 1000) == {
        "train": (0, 969),
        "valid": (969, 999),
        "test": (999, 1000),
    }
    assert split_ranges("1", 5) == {"train": (0, 5), "valid": (5, 5), "test": (5, 5)}
    assert split_ranges("2/1/1", 4) == {"train": (0, 2), "valid": (2, 3), "test": (3, 4)}
    assert split_ranges("100,0,0", 1)["train"] == (0, 1)


def test_tiny_corpus_split_error_names_sizes_and_suggests_weights():
    with pytest.raises(UserError) as e:
        split_ranges("949,50,1", 12)
    msg = str(e.value)
    assert (
        "over 12 documents gives train 11, valid 1, test 0" in msg and "test would be empty" in msg
    )
    suggestion = re.search(r"use e\.g\. --split (\d+,\d+,\d+),", msg).group(1)
    assert all(hi > lo for lo, hi in split_ranges(suggestion, 12).values())
    with pytest.raises(UserError, match=r"2 documents.*--split 1,1,0"):
        split_ranges("1,1,1", 2)
    with pytest.raises(UserError, match="holds no documents"):
        split_ranges("1", 0)
    for bad in ("", "a,b", "1,2,3,4", "-1,2", "0,0,0"):
        with pytest.raises(UserError, match="--split"):
            split_ranges(bad, 10)


def test_split_shorter_than_one_sample_and_weight_zero(tmp_path):
    prefix = _corpus(tmp_path / "c", n_docs=20)
    with pytest.raises(UserError, match=r"valid split .* shorter than one sample of 101 tokens"):
        open_megatron_splits(prefix, "19,1", 100, 0)
    with pytest.raises(UserError, match="valid split weight 0"):
        open_megatron_splits(prefix, "1,0,0", 8, 0)
    with pytest.raises(UserError, match="test split weight 0"):
        open_megatron_split(prefix, "9,1,0", "test", 8, 0)
    test = open_megatron_split(prefix, "8,1,1", "test", 4, 0)
    assert (test.lo, test.hi) == (18, 20) and test.get(np.arange(3)).shape == (3, 5)


def test_splits_are_disjoint_documents(tmp_path):
    prefix = _corpus(tmp_path / "c", n_docs=30)
    train, valid = open_megatron_splits(prefix, "2,1", 4, 0)
    assert (train.lo, train.hi, valid.lo, valid.hi) == (0, 20, 20, 30)
    assert set(_doc_ids(train, 0)) == set(range(20)) and set(_doc_ids(valid, 0)) == set(
        range(20, 30)
    )


def test_vocab_size_rule(tmp_path):
    prefix = _corpus(tmp_path / "c", vocab=1000)
    top = int(IndexedDataset(prefix).max_token())
    assert open_megatron_splits(prefix, "9,1", 8, 0)[0].vocab_size == top + 1
    assert open_megatron_splits(prefix, "9,1", 8, 0, vocab_size=50257)[0].vocab_size == 50257
    with pytest.raises(UserError, match=f"token id {top} but the tokenizer has 100 tokens"):
        open_megatron_splits(prefix, "9,1", 8, 0, vocab_size=100)


def test_index_cache_written_atomically_and_reused(tmp_path):
    prefix = _corpus(tmp_path / "c")
    data = IndexedDataset(prefix)
    src = GPTSamples(data, "1", "train", 8, 0, 1000, cache_min_entries=0)
    n = src.samples_per_epoch
    first = src.get(np.arange(n))
    files = src.cache_files(0)
    assert all(f.is_file() for f in files.values())
    assert not list(src.cache_dir.glob("*.tmp"))
    shuffle = np.load(files["shuffle"])
    assert sorted(shuffle.tolist()) == list(range(n))
    np.save(files["shuffle"], shuffle[::-1].copy())  # prove the next source reads the cache
    again = GPTSamples(data, "1", "train", 8, 0, 1000, cache_min_entries=0)
    assert np.array_equal(again.get(np.arange(n)), first[::-1])
    small = GPTSamples(data, "1", "train", 9, 0, 1000)  # under the threshold: nothing cached
    small.get(np.arange(3))
    assert not any(f.exists() for f in small.cache_files(0).values())


def test_open_data_plugs_into_the_trainer_interface(tmp_path):
    prefix = _corpus(tmp_path / "c", vocab=50000)
    cfg = DataConfig(data=prefix, tokenizer="gpt2", split="9,1,0")
    train, valid, tok = open_data(cfg, seq_len=8, vocab_size=123, seed=0)
    assert tok.name == "gpt2" and train.vocab_size == valid.vocab_size == 50257
    x = train.get(np.arange(4))
    assert x.dtype == np.int64 and x.shape == (4, 9)


def test_samples_with_empty_and_long_documents(tmp_path):
    # token value = its position in the .bin, so a sample shows exactly where it was read from
    rng = np.random.default_rng(1)
    lengths = rng.choice([0, 0, 1, 3, 40, 300], size=60)
    with IndexedWriter(str(tmp_path / "z"), np.int32) as w:
        w.add(np.arange(lengths.sum()), lengths)
    src = open_megatron_split(str(tmp_path / "z"), "1", "train", 32, seed=2)
    n = src.samples_per_epoch
    rows = src.get(np.arange(n))
    unshuffled = np.empty_like(rows)
    unshuffled[src._epoch(0).shuffle] = rows
    assert np.array_equal(unshuffled[1:, 0], unshuffled[:-1, -1])  # windows overlap by one token
    stream = np.concatenate([unshuffled[:, :-1].reshape(-1), unshuffled[-1:, -1]])
    cuts = np.flatnonzero(np.diff(stream) != 1) + 1
    starts, ends = set((np.cumsum(lengths) - lengths).tolist()), set(np.cumsum(lengths).tolist())
    pieces = np.split(stream, cuts)
    for piece in pieces[:-1]:  # each piece but the tail is whole documents (adjacent ones merge)
        assert int(piece[0]) in starts and int(piece[-1]) + 1 in ends
    assert int(pieces[-1][0]) in starts
    assert len(np.unique(stream)) == len(stream)  # no token, so no document, twice in an epoch
    assert len(stream) == n * 32 + 1 and n == (lengths.sum() - 1) // 32
