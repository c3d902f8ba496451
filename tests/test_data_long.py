"""The loaders at long context: seq_len 262,144 over a few million int32 tokens.

Token value = its position in the .bin (int32: past uint16's 65,535), so every sample shows where
it was read from. Both orders are compared with a plain reference: the fitgpt order with the
shuffled document stream cut into windows, the Megatron order with its own loop
(tests/test_data_megatron_order.py megatron_reference); the packed loader with its pieces.
"""

from __future__ import annotations

import numpy as np
import pytest
from test_data_megatron_order import megatron_reference, megatron_sample

from fitgpt.data.gpt_dataset import GPTSamples
from fitgpt.data.indexed import IndexedDataset, IndexedWriter
from fitgpt.data.megatron_order import MegatronSamples, build_sample_index

S = 262_144


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> IndexedDataset:
    """~3.2 M tokens in 64 documents of 1 to 150,000 tokens (some far shorter than a sample,
    none longer than one), int32."""
    rng = np.random.default_rng(7)
    lengths = rng.integers(1, 100_000, 64)
    lengths[::9] = rng.integers(100_000, 150_000, len(lengths[::9]))
    path = str(tmp_path_factory.mktemp("long") / "c")
    with IndexedWriter(path, np.int32) as w:
        w.add(np.arange(lengths.sum(), dtype=np.int64), lengths)
    return IndexedDataset(path)


def test_fitgpt_order_samples_are_exact_windows_of_the_stream(corpus):
    assert corpus.dtype == np.int32 and corpus.num_tokens > 3_000_000
    src = GPTSamples(corpus, "1", "train", S, seed=5, vocab_size=2**31 - 1)
    for epoch in (0, 1):
        ep = src._epoch(epoch)
        starts = ep.shift + ep.cum[:-1]  # .bin token of each document of this epoch's order
        doc = np.searchsorted(corpus.pointers // 4, starts)
        stream = np.concatenate([corpus[int(d)] for d in doc]).astype(np.int64)
        n = src.samples_per_epoch
        assert n == (len(stream) - 1) // S and n >= 10
        got = src.get(epoch * n + np.arange(n))
        assert got.shape == (n, S + 1) and got.dtype == np.int64
        want = np.stack([stream[k * S : k * S + S + 1] for k in range(n)])
        assert np.array_equal(got, want[ep.shuffle])
        # contiguous: inside a sample a token follows the one before it, except where a
        # document of the shuffled order begins
        jumps = np.flatnonzero(np.diff(want[:, :S].reshape(-1)) != 1) + 1
        assert set(jumps.tolist()) <= set(ep.cum.tolist())
    # the index: D + 1 and D int64 offsets, N int32 sample ids; nothing per token
    assert ep.shuffle.dtype == np.int32 and ep.cum.nbytes + ep.shift.nbytes < 2_000


def test_megatron_order_equals_megatrons_loop_at_long_context(corpus):
    # 2 epochs asked for: Megatron's separate last epoch and its two shuffles
    n_wanted = (corpus.num_tokens // S) + 3
    src = MegatronSamples(corpus, "1", "train", S, 1234, 2**31 - 1, n_wanted)
    lengths = corpus.lengths.astype(np.int64)
    doc_idx, sample_idx, shuffle, _ = megatron_reference(
        lengths, 0, len(lengths), S, 1234, n_wanted
    )
    idx = src.index
    assert idx.num_epochs == 2
    assert np.array_equal(idx.document_index, doc_idx)
    assert np.array_equal(idx.sample_index, sample_idx)
    assert np.array_equal(idx.shuffle_index, shuffle)
    # dtypes as Megatron's: int32 offsets (a document is far shorter than 2^31), uint32 ids
    assert idx.sample_index.dtype == np.int32 and idx.shuffle_index.dtype == np.uint32
    j = np.arange(len(src))
    got = src.get(j)
    for i in j:
        want = megatron_sample(corpus, doc_idx, sample_idx, shuffle, int(i))
        assert np.array_equal(got[i], want)


def test_sample_offsets_past_int32_are_kept_in_int64():
    """A document longer than 2^31 tokens (a 16 GiB int64 .bin, not written here: the index is
    built from the lengths alone) needs int64 offsets; int32 would wrap negative."""
    lengths = np.array([5, 2**31 + 10, 7], dtype=np.int64)
    doc_index = np.array([0, 1, 2], dtype=np.int32)
    seq = 2**29
    index = build_sample_index(lengths, doc_index, seq, int(lengths.sum()))
    assert index.dtype == np.int64
    cum = np.concatenate([[0], np.cumsum(lengths)])
    for i, (k, offset) in enumerate(index[1:].tolist(), start=1):
        assert cum[k] + offset == i * seq and 0 <= offset < lengths[k]


def test_packed_rows_at_long_context_hold_every_piece_whole(tmp_path):
    """Chat data packed into rows of S + 1 tokens: samples shorter than a row are placed whole,
    longer ones (up to 2.3 rows here) cut into pieces of S + 1 overlapping by one; every piece
    read back is the exact, contiguous slice of the .bin the plain rule names."""
    from fitgpt.data.chat import mask_prefix
    from fitgpt.data.packed import PackedSamples

    rng = np.random.default_rng(3)
    lengths = rng.integers(1, 40_000, 80)
    lengths[[5, 40]] = (S + 1, 2 * S + 77)  # one exactly a row, one cut into 3 pieces
    path = str(tmp_path / "chat")
    with IndexedWriter(path, np.int32) as w:
        w.add(np.arange(lengths.sum(), dtype=np.int64), lengths)
    with IndexedWriter(mask_prefix(path), np.uint8) as w:
        w.add(np.ones(lengths.sum(), dtype=np.uint8), lengths)
    src = PackedSamples(
        IndexedDataset(path), "1", "train", S, seed=1, vocab_size=2**31 - 1, long="split"
    )
    assert src.cut_samples == 1
    tokens, keep, seg = src.get_packed(np.arange(src.samples_per_epoch))
    assert tokens.shape == (src.samples_per_epoch, S + 1) and keep.dtype == np.uint8
    got = []
    for row_t, row_s, row_k in zip(tokens, seg, keep):
        for s in range(int(row_s.max()) + 1):
            piece = row_t[row_s == s]
            if row_k[row_s == s].any():  # a sample's piece (padding keeps nothing)
                assert (np.diff(piece) == 1).all()  # contiguous in the .bin
                got.append((int(piece[0]), len(piece)))
    starts = np.cumsum(lengths) - lengths
    want = []
    for first, n in zip(starts.tolist(), lengths.tolist()):
        count = max(1, -(-(n - 1) // S))
        want += [(first + k * S, min(S + 1, n - k * S)) for k in range(count)]
    assert sorted(got) == sorted(want)
