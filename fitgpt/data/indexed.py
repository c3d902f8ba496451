"""Megatron-LM's indexed dataset (MMIDIDX): tokens in a .bin, their layout in a .idx.

The .bin is the tokens of every sequence back to back, no header. The .idx, little-endian, with
N sequences and M document-index entries (M = documents + 1), is:

    offset      size    field
    0           9       magic b"MMIDIDX\\x00\\x00"
    9           8       version, uint64, always 1
    17          1       dtype code of the .bin tokens, uint8 (DTYPES below)
    18          8       N, number of sequences, uint64
    26          8       M, number of document-index entries, uint64
    34          4·N     sequence lengths in tokens, int32[N]
    34 + 4N     8·N     sequence pointers, byte offsets into the .bin, int64[N]
    34 + 12N    8·M     document index, int64[M]: 0, then the sequence count after each document

GPT preprocessing writes one sequence per document, so the document index is 0, 1, ..., N,
except for a document with no tokens, which has none (its entry repeats the one before), as in
Megatron's preprocess_data.py.
docs/data.md has the same table. Files are written under temporary names and renamed when
complete (.bin first, .idx last), so a crash never leaves an .idx that looks valid; a failed
write (full disk) removes every temporary.

Opening a pair validates all of it (sizes, lengths, contiguous pointers that exactly fill the
.bin, a document index from 0 to N that never decreases), so a damaged index is one error line
naming the first bad entry instead of silently wrong samples. The tokenizer that made a pair is
recorded beside it, in PREFIX.fitgpt.json (sidecar.py), which Megatron's reader never opens.
"""

from __future__ import annotations

import contextlib
import os
import struct
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from fitgpt.errors import UserError

MAGIC = b"MMIDIDX\x00\x00"
VERSION = 1
HEADER_BYTES = 34  # magic 9 + version 8 + dtype 1 + N 8 + M 8
DTYPES: dict[int, type[np.generic]] = {
    1: np.uint8,
    2: np.int8,
    3: np.int16,
    4: np.int32,
    5: np.int64,
    6: np.float64,
    7: np.float32,
    8: np.uint16,
}
CODES = {np.dtype(t): c for c, t in DTYPES.items()}
SIDECAR_SUFFIX = ".fitgpt.json"  # PREFIX.fitgpt.json: the tokenizer record, fitgpt/data/sidecar.py
# PREFIX.loss_mask.bin/.idx: chat data's per-token loss mask, a pair of uint8 0/1 "tokens" with
# the same sequences as PREFIX's (fitgpt/data/chat.py writes it, packed.py reads it)
LOSS_MASK_SUFFIX = ".loss_mask"
_CHUNK = 1 << 24  # elements per streamed chunk: 64-128 MiB of int32/int64, constant memory


def token_dtype(vocab_size: int) -> np.dtype:
    """Megatron's rule: uint16 tokens when the vocabulary is under 65500, int32 otherwise."""
    return np.dtype(np.uint16 if vocab_size < 65500 else np.int32)


def paths(prefix: str) -> tuple[Path, Path]:
    return Path(prefix + ".bin"), Path(prefix + ".idx")


class IndexedDataset:
    """A .bin/.idx pair, memory-mapped: nothing is read until a sequence or array is touched.

    Opening validates the whole index (see `_validate`), so every later read stays inside the
    .bin and every document is a run of whole sequences.
    """

    def __init__(self, prefix: str) -> None:
        bin_path, idx_path = paths(prefix)
        for p in (bin_path, idx_path):
            if not p.is_file():
                raise UserError(
                    f"{p} does not exist; pass the prefix of a .bin/.idx pair (without the suffix), "
                    "e.g. out/corpus_text_document"
                )
        self.prefix = prefix
        n, m, self.dtype = _read_header(idx_path)
        idx_size, bin_size = idx_path.stat().st_size, bin_path.stat().st_size
        # Sizes first, in Python integers: a corrupted count must fail here, before any array of
        # its size is mapped or allocated.
        expected = HEADER_BYTES + 12 * n + 8 * m
        # Megatron's multimodal variant appends one int8 mode per sequence; we ignore it.
        if idx_size not in (expected, expected + n):
            raise UserError(
                f"{idx_path} has {idx_size} bytes but its header promises {n} sequences and {m} "
                f"document entries ({expected} bytes); the file is truncated or corrupt, rebuild it"
            )
        idx = np.memmap(idx_path, dtype=np.uint8, mode="r")
        self.lengths = np.frombuffer(idx, np.int32, n, HEADER_BYTES)
        self.pointers = np.frombuffer(idx, np.int64, n, HEADER_BYTES + 4 * n)
        self.doc_idx = np.frombuffer(idx, np.int64, m, HEADER_BYTES + 12 * n)
        _check_sequences(idx_path, bin_path, self.lengths, self.pointers, self.dtype, bin_size)
        _check_documents(idx_path, self.doc_idx, n)
        # np.memmap refuses empty files, so an empty dataset gets an empty array instead.
        self.tokens = (
            np.memmap(bin_path, dtype=self.dtype, mode="r") if bin_size else np.empty(0, self.dtype)
        )

    @property
    def num_sequences(self) -> int:
        return len(self.lengths)

    @property
    def num_documents(self) -> int:
        return len(self.doc_idx) - 1

    @property
    def num_tokens(self) -> int:
        return int(self.lengths.sum(dtype=np.int64))

    def __len__(self) -> int:
        return self.num_sequences

    def __getitem__(self, i: int) -> np.ndarray:
        start = int(self.pointers[i]) // self.dtype.itemsize
        return self.tokens[start : start + int(self.lengths[i])]

    def max_token(self) -> int:
        """The largest token id (-1 when empty): one streaming pass over the .bin."""
        best = -1
        for lo in range(0, len(self.tokens), _CHUNK):
            best = max(best, int(self.tokens[lo : lo + _CHUNK].max()))
        return best


def _read_header(idx_path: Path) -> tuple[int, int, np.dtype]:
    with open(idx_path, "rb") as f:
        head = f.read(HEADER_BYTES)
    if len(head) < HEADER_BYTES or head[:9] != MAGIC:
        raise UserError(
            f"{idx_path} is not a Megatron indexed dataset (it does not start with {MAGIC!r}); "
            "make it with `fitgpt data preprocess`"
        )
    version, code, n, m = struct.unpack("<QBQQ", head[9:])
    if version != VERSION:
        raise UserError(f"{idx_path} has format version {version}; only version {VERSION} is known")
    if code not in DTYPES:
        raise UserError(
            f"{idx_path} has token dtype code {code}, not one of {sorted(DTYPES)}; the file is "
            "corrupt, rebuild it"
        )
    return n, m, np.dtype(DTYPES[code])


_CHECK = 1 << 20  # index entries per validation chunk: temporaries of ~8 MiB whatever the count
_REBUILD = "the index is corrupt; rebuild the pair (e.g. with fitgpt data preprocess)"


def _check_sequences(
    idx_path: Path, bin_path: Path, lengths, pointers, dtype: np.dtype, bin_size: int
) -> None:
    """Lengths >= 0; pointers contiguous from byte 0; the sequences exactly fill the .bin.

    Megatron's writer (and ours) sets pointer[i] = itemsize × (tokens before i), so any other
    pointer is damage. O(n) in chunks of _CHECK: ~15 ms per million sequences (2-core box).
    """
    itemsize = dtype.itemsize
    end = 0  # the byte where the checked sequences end; never past bin_size
    for lo in range(0, len(lengths), _CHECK):
        size = lengths[lo : lo + _CHECK].astype(np.int64) * itemsize
        ends = np.cumsum(size) + end
        starts = ends - size
        bad = (size < 0) | (pointers[lo : lo + _CHECK] != starts) | (ends > bin_size)
        if bad.any():
            i = int(np.argmax(bad))  # the first bad entry; everything before it is sound
            length, pointer = int(lengths[lo + i]), int(pointers[lo + i])
            if length < 0:
                what = f"sequence {lo + i} has length {length}, negative; {_REBUILD}"
            elif pointer != starts[i]:
                what = (
                    f"sequence {lo + i} starts at byte {pointer}, but the sequences before it end "
                    f"at byte {starts[i]} (sequences must be contiguous); {_REBUILD}"
                )
            else:
                what = (
                    f"sequence {lo + i} ({length} tokens from byte {pointer}) runs past the end of "
                    f"{bin_path} ({bin_size} bytes); the .bin is truncated or belongs to another "
                    ".idx, rebuild the pair"
                )
            raise UserError(f"{idx_path}: {what}")
        end = int(ends[-1])
    if end != bin_size:
        raise UserError(
            f"{bin_path} has {bin_size} bytes but {idx_path} describes {end} "
            f"({end // itemsize} {dtype.name} tokens); the .bin is damaged or belongs to another "
            ".idx, rebuild the pair"
        )


def _check_documents(idx_path: Path, doc_idx, n: int) -> None:
    """The document index starts at 0, never decreases and ends at the sequence count n."""
    if len(doc_idx) == 0 or doc_idx[0] != 0:
        first = "empty" if len(doc_idx) == 0 else f"entry 0 is {int(doc_idx[0])}"
        raise UserError(f"{idx_path}: document index {first}, not 0; {_REBUILD}")
    prev = 0
    for lo in range(0, len(doc_idx), _CHECK):
        d = doc_idx[lo : lo + _CHECK]
        bad = (d < np.concatenate(([prev], d[:-1]))) | (d > n)  # < 0 fails the first test
        if bad.any():
            i = lo + int(np.argmax(bad))
            v = int(doc_idx[i])
            why = (
                f"outside 0..{n} (the sequence count)"
                if not 0 <= v <= n
                else f"below entry {i - 1} ({int(doc_idx[i - 1])}); it must not decrease"
            )
            raise UserError(f"{idx_path}: document index entry {i} is {v}, {why}; {_REBUILD}")
        prev = int(d[-1])
    if prev != n:
        raise UserError(
            f"{idx_path}: document index entry {len(doc_idx) - 1} (the last) is {prev}, not the "
            f"sequence count {n}; {_REBUILD}"
        )


class IndexedWriter:
    """Streams sequences into a new .bin/.idx pair in constant memory.

    Tokens go straight to a temporary .bin; lengths and document ends go to two small temporary
    side files (4 and 8 bytes per sequence) that `finish` turns into the .idx. On an exception
    inside `with`, every temporary is removed and no output appears.
    """

    def __init__(self, prefix: str, dtype: np.dtype | type) -> None:
        self.dtype = np.dtype(dtype)
        if self.dtype not in CODES:
            raise ValueError(f"dtype {self.dtype} has no MMIDIDX code")
        self.prefix = prefix
        self.bin_path, self.idx_path = paths(prefix)
        tag = f".{os.getpid()}.tmp"
        self._tmp = {
            k: Path(str(p) + tag)
            for k, p in (
                ("bin", self.bin_path),
                ("idx", self.idx_path),
                ("len", Path(prefix + ".lengths")),
                ("doc", Path(prefix + ".docs")),
            )
        }
        self._files: list = []
        # A Ctrl-C here, before the caller's `with` holds the writer, would leave the files
        # opened so far behind (seen: a .bin.PID.tmp after a preprocess stopped at its start).
        try:
            with self._os_errors():
                self.bin_path.parent.mkdir(parents=True, exist_ok=True)
                # Open for the writer's whole life; `finish` or `abort` closes them.
                self._bin = open(self._tmp["bin"], "wb")  # noqa: SIM115
                self._files.append(self._bin)
                self._len = open(self._tmp["len"], "wb")  # noqa: SIM115
                self._files.append(self._len)
                self._doc = open(self._tmp["doc"], "wb")  # noqa: SIM115
                self._files.append(self._doc)
        except BaseException:
            self.abort()
            raise
        self.num_sequences = 0
        self.num_documents = 0
        self.num_tokens = 0  # tokens written to the .bin
        self._indexed_tokens = 0  # tokens the lengths account for
        self._last_doc_end = 0  # in sequences; must reach num_sequences by `finish`
        self._info = np.iinfo(self.dtype) if self.dtype.kind in "iu" else None

    @contextlib.contextmanager
    def _os_errors(self) -> Iterator[None]:
        """A failed write (full disk, quota, file size limit) removes every temporary and becomes
        one line naming the output; the caller's `with` then has nothing left to clean."""
        try:
            yield
        except OSError as e:
            self.abort()
            why = e.strerror or str(e)
            raise UserError(
                f"{self.prefix}: cannot write {self.bin_path.name}/{self.idx_path.name} in "
                f"{self.bin_path.parent or '.'} ({why}); free space there or pick another "
                "output prefix (temporary files removed)"
            ) from e

    def add(
        self, tokens: np.ndarray, lengths: np.ndarray, doc_ends: np.ndarray | None = None
    ) -> None:
        """`tokens` (flat) hold sequences of `lengths`; each sequence is a document by default."""
        self.write_tokens(tokens)
        self.write_index(lengths, doc_ends)

    def write_tokens(self, tokens: np.ndarray) -> None:
        if tokens.dtype != self.dtype:
            if tokens.size and self._info is not None:
                lo, hi = int(tokens.min()), int(tokens.max())
                if lo < self._info.min or hi > self._info.max:
                    raise UserError(
                        f"token ids {lo}..{hi} do not fit {self.dtype} in {self.bin_path}; "
                        "use a wider dtype (a vocabulary of 65500+ needs int32)"
                    )
            tokens = tokens.astype(self.dtype)
        with self._os_errors():
            self._bin.write(np.ascontiguousarray(tokens).tobytes())
        self.num_tokens += tokens.size

    def write_index(self, lengths: np.ndarray, doc_ends: np.ndarray | None = None) -> None:
        """Lengths of the next sequences; `doc_ends` counts sequences (1..len) where documents end."""
        lengths = np.asarray(lengths, dtype=np.int64)
        if lengths.size and (lengths.min() < 0 or lengths.max() > np.iinfo(np.int32).max):
            raise ValueError("sequence lengths must fit int32")
        if doc_ends is None:
            doc_ends = np.arange(1, len(lengths) + 1, dtype=np.int64)
        ends = np.asarray(doc_ends, dtype=np.int64) + self.num_sequences
        with self._os_errors():
            self._len.write(lengths.astype(np.int32).tobytes())
            self._doc.write(ends.tobytes())
        if ends.size:
            self._last_doc_end = int(ends[-1])
        self.num_sequences += len(lengths)
        self.num_documents += len(doc_ends)
        self._indexed_tokens += int(lengths.sum())

    def finish(self) -> None:
        """Write the .idx from the side files, then rename: .bin first, .idx last."""
        with self._os_errors():
            for f in self._files:
                f.close()
            if self._indexed_tokens != self.num_tokens:
                raise ValueError(
                    f"lengths add up to {self._indexed_tokens} tokens, wrote {self.num_tokens}"
                )
            n, m = self.num_sequences, self.num_documents + 1
            if self._last_doc_end != n:
                raise ValueError(
                    f"the last document ends at sequence {self._last_doc_end}, not {n}"
                )
            with open(self._tmp["idx"], "wb") as out:
                out.write(MAGIC + struct.pack("<QBQQ", VERSION, CODES[self.dtype], n, m))
                _copy_file(self._tmp["len"], out)
                _write_pointers(self._tmp["len"], out, self.dtype.itemsize)
                out.write(np.zeros(1, np.int64).tobytes())
                _copy_file(self._tmp["doc"], out)
                out.flush()
                os.fsync(out.fileno())
            with open(self._tmp["bin"], "rb+") as f:
                os.fsync(f.fileno())
            # An old .idx must not pair with the new .bin if we die between the two renames, and
            # an old sidecar (fitgpt/data/sidecar.py) or loss mask must not describe the new pair
            # (a chat preprocess writes its mask after this).
            self.idx_path.unlink(missing_ok=True)
            Path(self.prefix + SIDECAR_SUFFIX).unlink(missing_ok=True)
            for p in paths(self.prefix + LOSS_MASK_SUFFIX):
                p.unlink(missing_ok=True)
            os.replace(self._tmp["bin"], self.bin_path)
            os.replace(self._tmp["idx"], self.idx_path)
            self._remove_temporaries()

    def abort(self) -> None:
        """Close and remove every temporary; safe to call twice, and after a failed write (where
        closing flushes into the same full disk and fails again)."""
        for f in self._files:
            with contextlib.suppress(OSError):
                f.close()
        self._remove_temporaries()

    def _remove_temporaries(self) -> None:
        for p in self._tmp.values():
            with contextlib.suppress(OSError):  # missing, or its directory never came to be
                p.unlink()

    def __enter__(self) -> IndexedWriter:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is not None:
            self.abort()
            return
        try:
            self.finish()
        except BaseException:
            self.abort()
            raise


def _copy_file(src: Path, out) -> None:
    with open(src, "rb") as f:
        while block := f.read(1 << 24):
            out.write(block)


def _write_pointers(lengths_file: Path, out, itemsize: int) -> None:
    """Byte offset of each sequence: an exclusive prefix sum, chunk by chunk (constant memory)."""
    done = 0
    with open(lengths_file, "rb") as f:
        while block := f.read(4 * _CHUNK):
            lengths = np.frombuffer(block, np.int32).astype(np.int64)
            ends = np.cumsum(lengths) + done
            out.write(((ends - lengths) * itemsize).tobytes())
            done = int(ends[-1])
