"""Megatron-LM compatibility of the data order: split boundaries and `--sample-order megatron`.

The references below are written from Megatron-LM's own steps (blended_megatron_dataset_config.py,
blended_megatron_dataset_builder.py, gpt_dataset.py and helpers.cpp's build_sample_idx loop),
one Python statement per step of theirs, slow and plain; fitgpt's code is vectorised.
"""

from __future__ import annotations

import functools
import itertools
import re

import numpy as np
import pytest
import torch

from fitgpt.data.config import DataConfig, open_data
from fitgpt.data.gpt_dataset import open_megatron_split
from fitgpt.data.indexed import IndexedDataset, IndexedWriter
from fitgpt.data.megatron_order import MegatronSamples, index_files
from fitgpt.data.source import BatchLoader
from fitgpt.data.splits import split_ranges
from fitgpt.errors import UserError

# ---- split boundaries -------------------------------------------------------------------------


def megatron_split_bounds(split: str, n: int) -> list[tuple[int, int] | None]:
    """parse_and_normalize_split -> convert_split_vector_to_split_matrix -> int(round(b · n))."""
    w = [float(x) for x in re.findall(r"[.0-9]+", split)]
    w = w + [0.0] * (3 - len(w))
    w = (np.array(w, dtype=np.float64) / np.sum(np.array(w, dtype=np.float64))).tolist()
    ends = functools.reduce(lambda a, b: [*a, a[len(a) - 1] + b], [[0], *w])
    out = []
    for lo, hi in itertools.pairwise(ends):
        out.append(None if hi <= lo else (round(lo * float(n)), round(hi * float(n))))
    return out


SPLIT_STRINGS = ["90,10,0", "969,30,1", "949,50,1", "98,2", "1,1", "1,1,1", "7,2,1", "0.3,0.3,0.4"]


@pytest.mark.parametrize("split", SPLIT_STRINGS)
def test_split_boundaries_equal_megatrons_on_1000_sizes(split):
    for n in range(1, 1001):
        want = megatron_split_bounds(split, n)
        try:
            got = split_ranges(split, n)
        except UserError:  # fitgpt refuses a weighted split that gets no document
            assert any(b is not None and b[0] == b[1] for b in want), (split, n)
            continue
        for name, bounds in zip(("train", "valid", "test"), want):
            if bounds is None:
                assert got[name][0] == got[name][1]  # weight 0: no such split
            else:
                assert got[name] == bounds, (split, n, name)


def test_split_rounds_half_to_even_as_megatron():
    r = split_ranges("90,10,0", 25)  # 22.5 -> 22 (half up would give 23)
    assert (r["train"], r["valid"]) == ((0, 22), (22, 25))
    assert split_ranges("1,1", 5)["train"] == (0, 2)  # 2.5 -> 2
    assert split_ranges("1,1", 7)["train"] == (0, 4)  # 3.5 -> 4
    with pytest.raises(UserError, match="gives train 0, valid 2, test 0"):  # 0.5 -> 0
        split_ranges("1,3", 2)


# ---- the sample order -------------------------------------------------------------------------


def megatron_reference(lengths, lo, hi, seq_len, seed, num_samples):
    """GPTDataset._build_document_sample_shuffle_indices with helpers.cpp's loop, step by step."""
    documents = np.arange(lo, hi, dtype=np.int32)
    tokens_per_epoch = int(np.sum(lengths[documents]))
    num_epochs, num_tokens = 1, tokens_per_epoch  # _get_num_epochs
    if num_samples is not None:
        while num_tokens < num_samples * seq_len + 1:
            num_epochs += 1
            num_tokens += tokens_per_epoch
    separate = False
    if num_epochs > 1:
        sans_final = ((num_epochs - 1) * tokens_per_epoch - 1) // seq_len
        from_final = num_samples - sans_final
        per_epoch = (tokens_per_epoch - 1) // seq_len
        assert 0 <= from_final <= per_epoch + 1
        separate = from_final < int(0.80 * per_epoch)
    rs = np.random.RandomState(seed)

    def document_index(epochs):  # _build_document_index, not separate
        d = np.mgrid[0:epochs, 0 : len(documents)][1]
        d[:] = documents
        d = d.reshape(-1).astype(np.int32)
        rs.shuffle(d)
        return d

    if separate:
        doc_idx = np.concatenate((document_index(num_epochs - 1), document_index(1)))
    else:
        doc_idx = document_index(num_epochs)

    # build_sample_idx (drop_last_partial_sequence, add_extra_token_to_sequence = 1)
    n = (num_epochs * tokens_per_epoch - 1) // seq_len
    sample_idx = [(0, 0)]
    k, offset = 0, 0
    while len(sample_idx) <= n:
        remaining = seq_len + 1
        while remaining != 0:
            doc_len = int(lengths[doc_idx[k]]) - offset
            remaining -= doc_len
            if remaining <= 0:
                offset += remaining + doc_len - 1
                remaining = 0
            else:
                if k == len(doc_idx) - 1:
                    offset = int(lengths[doc_idx[k]]) - 1
                    break
                k += 1
                offset = 0
        sample_idx.append((k, offset))

    def shuffled(a, b):  # _build_shuffle_index
        x = np.arange(a, b, dtype=np.uint32)
        rs.shuffle(x)
        return x

    shuffle = (
        np.concatenate((shuffled(0, sans_final), shuffled(sans_final, n)))
        if separate
        else (shuffled(0, n))
    )
    return doc_idx, np.array(sample_idx), shuffle, separate


def megatron_sample(data, doc_idx, sample_idx, shuffle, j):
    """_query_document_sample_shuffle_indices: the seq_len + 1 tokens of sample j."""
    i = shuffle[j]
    (k0, o0), (k1, o1) = sample_idx[i], sample_idx[i + 1]
    if k0 == k1:
        return data[int(doc_idx[k0])][o0 : o1 + 1]
    parts = [data[int(doc_idx[k0])][o0:]]
    parts += [data[int(doc_idx[k])] for k in range(k0 + 1, k1)]
    parts.append(data[int(doc_idx[k1])][: o1 + 1])
    return np.concatenate(parts)


def _corpus(path, n_docs, seed) -> str:
    """Documents of 0..120 tokens (empty ones included); each token is its own .bin position."""
    rng = np.random.default_rng(seed)
    lengths = rng.choice([0, 1, 2, 5, 17, 40, 120], size=n_docs)
    with IndexedWriter(str(path), np.int32) as w:
        w.add(np.arange(lengths.sum()), lengths)
    return str(path)


CASES = [  # split, name, seq_len, seed, num_samples in epochs, Megatron's separate final epoch
    ("1", "train", 16, 0, None, False),
    ("1", "train", 2, 1234, 0.5, False),
    ("9,1", "train", 7, 5, 1.0, False),
    ("9,1", "valid", 8, 5, 2.5, True),  # three epochs, the last one 50% used
    ("90,10,0", "train", 33, 99, 2.9, False),  # three epochs, the last one 90% used
    ("7,2,1", "test", 3, 7, 4.0, False),
    ("7,2,1", "train", 64, 2, 1.2, True),
    ("2,1", "valid", 5, 31337, 10.0, False),
]


@pytest.mark.parametrize("split, name, seq_len, seed, times, separate", CASES)
def test_megatron_order_equals_the_reference(tmp_path, split, name, seq_len, seed, times, separate):
    prefix = _corpus(tmp_path / "c", n_docs=60, seed=seed)
    data = IndexedDataset(prefix)
    lo, hi = split_ranges(split, data.num_sequences)[name]
    per_epoch = (int(data.lengths[lo:hi].sum()) - 1) // seq_len
    num_samples = None if times is None else int(times * per_epoch)
    src = MegatronSamples(data, split, name, seq_len, seed, 1 << 20, num_samples)
    doc_idx, sample_idx, shuffle, separated = megatron_reference(
        data.lengths, lo, hi, seq_len, seed, num_samples
    )
    assert separated == separate  # both branches are exercised
    assert np.array_equal(src.index.document_index, doc_idx)
    assert np.array_equal(src.index.sample_index, sample_idx)
    assert np.array_equal(src.index.shuffle_index, shuffle)
    assert src.index.document_index.dtype == np.int32 and shuffle.dtype == np.uint32
    assert len(src) == len(shuffle) >= (num_samples or 0)
    got = src.get(np.arange(len(src)))
    want = np.stack(
        [megatron_sample(data, doc_idx, sample_idx, shuffle, j) for j in range(len(src))]
    )
    assert got.dtype == np.int64 and np.array_equal(got, want)


def test_megatron_order_stream_and_epochs(tmp_path):
    """Independent of the reference: every sample is a window of the epochs' stream."""
    prefix = _corpus(tmp_path / "c", n_docs=50, seed=3)
    data = IndexedDataset(prefix)
    src = MegatronSamples(data, "1", "train", 16, 11, 1 << 20, num_samples=500)
    ix = src.index
    epochs = ix.num_epochs
    assert np.array_equal(np.bincount(ix.document_index, minlength=50), np.full(50, epochs))
    stream = np.concatenate([data[int(d)] for d in ix.document_index])
    assert len(stream) >= 500 * 16 + 1 > len(stream) - int(data.lengths.sum())
    in_order = np.empty((len(src), 17), dtype=np.int64)
    in_order[ix.shuffle_index] = src.get(np.arange(len(src)))
    want = np.stack([stream[i * 16 : i * 16 + 17] for i in range(len(src))])
    assert np.array_equal(in_order, want)


def test_past_the_built_samples_is_an_error(tmp_path):
    prefix = _corpus(tmp_path / "c", n_docs=40, seed=0)
    src = open_megatron_split(prefix, "1", "train", 8, 0, sample_order="megatron", num_samples=30)
    src.get(np.array([len(src) - 1]))
    with pytest.raises(UserError, match=f"past the {len(src)} samples .* num_samples=30"):
        src.get(np.array([0, len(src)]))


def test_megatron_index_cache(tmp_path):
    prefix = _corpus(tmp_path / "c", n_docs=40, seed=1)
    data = IndexedDataset(prefix)
    src = MegatronSamples(data, "9,1", "train", 8, 3, 1 << 20, 200, cache_min_entries=0)
    files = index_files(data, src.lo, src.hi, 8, 3, 200)
    assert all(f.is_file() for f in files.values())
    assert not list(files["shuffle_index"].parent.glob("*.tmp"))
    first = src.get(np.arange(len(src)))
    np.save(files["shuffle_index"], src.index.shuffle_index[::-1].copy())  # prove it is read
    again = MegatronSamples(data, "9,1", "train", 8, 3, 1 << 20, 200, cache_min_entries=0)
    assert isinstance(again.index.shuffle_index, np.memmap)
    assert np.array_equal(again.get(np.arange(len(src))), first[::-1])
    other = MegatronSamples(data, "9,1", "train", 8, 3, 1 << 20, 201, cache_min_entries=0)
    assert not np.array_equal(other.index.shuffle_index[:10], src.index.shuffle_index[::-1][:10])
    small = MegatronSamples(data, "9,1", "train", 9, 3, 1 << 20, 200)  # under the threshold
    assert not any(f.exists() for f in index_files(data, small.lo, small.hi, 9, 3, 200).values())


def test_open_data_megatron_order_feeds_the_loader(tmp_path):
    prefix = _corpus(tmp_path / "c", n_docs=60, seed=2)
    cfg = DataConfig(data=prefix, tokenizer="none", split="9,1,0", sample_order="megatron")
    train, valid, tok = open_data(cfg, seq_len=8, vocab_size=70000, seed=4, num_samples=(96, 16))
    assert tok is None and isinstance(train, MegatronSamples) and train.vocab_size == 70000
    assert (train.num_samples, valid.num_samples) == (96, 16)
    # micro-batch k of rank r is Megatron's samples k·b·W + r·b + [0, b), as its sampler gives
    two = [BatchLoader(train, 2, rank=r, world=2) for r in range(2)]
    for k in range(24):
        x = torch.cat([two[0].next()[0], two[1].next()[0]])
        assert torch.equal(x, torch.from_numpy(train.get(np.arange(4 * k, 4 * k + 4))[:, :-1]))
    with pytest.raises(UserError, match="--sample-order"):
        DataConfig(data=prefix, sample_order="random")
