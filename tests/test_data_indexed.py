"""The .bin/.idx format, checked byte by byte against the table in docs/data.md."""

from __future__ import annotations

import struct

import numpy as np
import pytest

from fitgpt.data.indexed import DTYPES, IndexedDataset, IndexedWriter, token_dtype
from fitgpt.errors import UserError


def _write(prefix, docs, dtype=np.uint16):
    with IndexedWriter(str(prefix), dtype) as w:
        w.add(np.concatenate(docs), np.array([len(d) for d in docs]))
    return IndexedDataset(str(prefix))


def test_header_and_arrays_match_documented_layout(tmp_path):
    docs = [np.array([5, 6, 7]), np.array([8]), np.array([9, 10])]
    _write(tmp_path / "d", docs)
    raw = (tmp_path / "d.idx").read_bytes()
    # offset 0: magic; 9: version u64; 17: dtype code u8; 18: N u64; 26: M u64
    assert raw[:9] == b"MMIDIDX\x00\x00"
    assert struct.unpack_from("<Q", raw, 9)[0] == 1
    assert raw[17] == 8  # uint16
    n, m = struct.unpack_from("<QQ", raw, 18)
    assert (n, m) == (3, 4)
    assert np.frombuffer(raw, np.int32, n, 34).tolist() == [3, 1, 2]  # lengths
    assert np.frombuffer(raw, np.int64, n, 34 + 4 * n).tolist() == [0, 6, 8]  # byte pointers
    assert np.frombuffer(raw, np.int64, m, 34 + 12 * n).tolist() == [0, 1, 2, 3]  # documents
    assert len(raw) == 34 + 12 * n + 8 * m
    assert (tmp_path / "d.bin").read_bytes() == np.arange(5, 11, dtype="<u2").tobytes()


def test_dtype_codes_and_rule():
    assert {c: np.dtype(t).name for c, t in DTYPES.items()} == {
        1: "uint8",
        2: "int8",
        3: "int16",
        4: "int32",
        5: "int64",
        6: "float64",
        7: "float32",
        8: "uint16",
    }
    assert token_dtype(50257) == np.uint16 and token_dtype(65500) == np.int32


def test_reader_multi_sequence_documents_and_int32(tmp_path):
    with IndexedWriter(str(tmp_path / "m"), np.int32) as w:
        w.add(np.arange(10) + 70000, np.array([2, 3, 5]), doc_ends=np.array([2, 3]))
    d = IndexedDataset(str(tmp_path / "m"))
    assert (d.num_sequences, d.num_documents, d.num_tokens) == (3, 2, 10)
    assert d.doc_idx.tolist() == [0, 2, 3] and d.dtype == np.int32
    assert d[2].tolist() == list(range(70005, 70010)) and d.max_token() == 70009


def test_empty_dataset(tmp_path):
    with IndexedWriter(str(tmp_path / "e"), np.uint16):
        pass
    d = IndexedDataset(str(tmp_path / "e"))
    assert (d.num_sequences, d.num_documents, d.num_tokens) == (0, 0, 0)


def test_exception_leaves_no_files(tmp_path):
    with pytest.raises(KeyboardInterrupt), IndexedWriter(str(tmp_path / "x"), np.uint16) as w:
        w.add(np.arange(3), np.array([3]))
        raise KeyboardInterrupt
    assert list(tmp_path.iterdir()) == []


def test_rewrite_replaces_old_pair(tmp_path):
    _write(tmp_path / "r", [np.arange(4)])
    _write(tmp_path / "r", [np.arange(2), np.arange(3)])
    assert IndexedDataset(str(tmp_path / "r")).lengths.tolist() == [2, 3]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["r.bin", "r.idx"]


def test_narrowing_checks_range(tmp_path):
    with (
        pytest.raises(UserError, match="do not fit uint16"),
        IndexedWriter(str(tmp_path / "n"), np.uint16) as w,
    ):
        w.add(np.array([70000]), np.array([1]))
    assert list(tmp_path.iterdir()) == []


def test_corrupt_files_are_named(tmp_path):
    _write(tmp_path / "c", [np.arange(4), np.arange(5)])
    idx = (tmp_path / "c.idx").read_bytes()
    with pytest.raises(UserError, match="does not exist"):
        IndexedDataset(str(tmp_path / "nothing"))
    (tmp_path / "c.idx").write_bytes(b"XXXXXXXXX" + idx[9:])
    with pytest.raises(UserError, match="not a Megatron indexed dataset"):
        IndexedDataset(str(tmp_path / "c"))
    (tmp_path / "c.idx").write_bytes(idx[:17] + b"\x09" + idx[18:])
    with pytest.raises(UserError, match="dtype code 9"):
        IndexedDataset(str(tmp_path / "c"))
    (tmp_path / "c.idx").write_bytes(idx[:-8])
    with pytest.raises(UserError, match="truncated or corrupt"):
        IndexedDataset(str(tmp_path / "c"))
    (tmp_path / "c.idx").write_bytes(idx)
    (tmp_path / "c.bin").write_bytes((tmp_path / "c.bin").read_bytes()[:-2])
    with pytest.raises(UserError, match="truncated"):
        IndexedDataset(str(tmp_path / "c"))
