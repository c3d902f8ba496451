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


def _corrupt(tmp_path, edit) -> str:
    """A 3-sequence, 2-document pair whose .idx arrays (or .bin) `edit` changes in place."""
    with IndexedWriter(str(tmp_path / "v"), np.uint16) as w:
        w.add(np.arange(9), np.array([4, 3, 2]), doc_ends=np.array([2, 3]))
    raw = bytearray((tmp_path / "v.idx").read_bytes())
    arrays = {
        "lengths": np.frombuffer(raw, np.int32, 3, 34),
        "pointers": np.frombuffer(raw, np.int64, 3, 46),
        "docs": np.frombuffer(raw, np.int64, 3, 70),
    }
    edit(arrays, raw, tmp_path / "v.bin")
    (tmp_path / "v.idx").write_bytes(bytes(raw))
    return str(tmp_path / "v")


def _set(name, i, value):
    def edit(a, raw, bin_path):
        a[name][i] = value

    return edit


@pytest.mark.parametrize(
    "edit, message",
    [
        (_set("lengths", 1, -1), "v.idx: sequence 1 has length -1, negative"),
        (
            _set("lengths", 2, 2**31 - 1),
            r"v.idx: sequence 2 \(2147483647 tokens from byte 14\) runs",
        ),
        (_set("lengths", 0, 5), "v.idx: sequence 1 starts at byte 8, but the sequences before it"),
        (_set("pointers", 0, 2), "v.idx: sequence 0 starts at byte 2, but .* end at byte 0"),
        (_set("pointers", 2, -8), "v.idx: sequence 2 starts at byte -8"),
        (_set("docs", 0, 1), "v.idx: document index entry 0 is 1, not 0"),
        (_set("docs", 1, 9), r"v.idx: document index entry 1 is 9, outside 0\.\.3"),
        (_set("docs", 1, -1), r"v.idx: document index entry 1 is -1, outside 0\.\.3"),
        (_set("docs", 2, 2), r"v.idx: document index entry 2 \(the last\) is 2, not the seq"),
        (
            lambda a, raw, b: a["docs"].__setitem__(slice(1, 3), [3, 2]),
            r"v.idx: document index entry 2 is 2, below entry 1 \(3\)",
        ),
        (
            lambda a, raw, b: b.write_bytes(b.read_bytes() + b"\0\0"),
            "v.bin has 20 bytes but .*v.idx describes 18",
        ),
        (
            lambda a, raw, b: raw.__setitem__(slice(18, 34), struct.pack("<QQ", 5, 1)),
            r"v.idx has 94 bytes but its header promises 5 sequences and 1 document entries \(102",
        ),
        (  # 12·5 + 8·0 = 12·3 + 8·3: the size matches, the contents do not
            lambda a, raw, b: raw.__setitem__(slice(18, 34), struct.pack("<QQ", 5, 0)),
            "v.idx: sequence 0 starts at byte 8",
        ),
    ],
)
def test_every_rule_names_the_file_and_first_bad_entry(tmp_path, edit, message):
    prefix = _corrupt(tmp_path, edit)
    with pytest.raises(UserError, match=message) as e:
        IndexedDataset(prefix)
    assert "\n" not in str(e.value)


def test_megatron_multimodal_modes_are_read_past(tmp_path):
    prefix = _corrupt(tmp_path, lambda a, raw, b: None)
    with open(prefix + ".idx", "ab") as f:
        f.write(b"\x00\x01\x00")  # one int8 mode per sequence
    d = IndexedDataset(prefix)
    assert [d[i].tolist() for i in range(3)] == [[0, 1, 2, 3], [4, 5, 6], [7, 8]]


def test_a_huge_count_fails_before_any_allocation(tmp_path):
    import tracemalloc

    prefix = _corrupt(tmp_path, lambda a, raw, b: struct.pack_into("<Q", raw, 18, 2**64 - 1))
    tracemalloc.start()
    try:
        with pytest.raises(UserError, match="18446744073709551615 sequences"):
            IndexedDataset(prefix)
        assert tracemalloc.get_traced_memory()[1] < 1 << 20
    finally:
        tracemalloc.stop()


def test_writer_removes_temporaries_when_a_write_fails(tmp_path):
    """A real failing write: RLIMIT_FSIZE makes the kernel refuse bytes past 16 KiB (EFBIG), and
    closing the buffered file then fails again, which must not keep the temporaries."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (16 << 10, hard))
    try:
        with (
            pytest.raises(UserError, match=r"w: cannot write w\.bin/w\.idx .*File too large"),
            IndexedWriter(str(tmp_path / "w"), np.uint16) as w,
        ):
            for _ in range(50):
                w.add(np.arange(1000), np.array([1000]))
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
    assert list(tmp_path.iterdir()) == []
