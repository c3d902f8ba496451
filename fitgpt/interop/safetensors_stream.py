"""safetensors files written and read one tensor at a time.

`safetensors.torch.save_file` needs every tensor in memory at once; for a model bigger than host
RAM that is the whole model twice (our chunks plus the converted copies). The format is simple
enough to stream: 8 bytes of little-endian header length, a JSON header giving each tensor's
dtype, shape and [begin, end) byte range in the data section, then the data. We know every shape
up front, so the header is written first and the tensors follow in the order it lists them.

Reading: `safe_open` memory-maps the file, and every page a read touches stays mapped (and
counted in the process's RSS) until the file is closed: reading a whole model tensor by tensor
would show the whole file as resident. `SafetensorsReader` reads each tensor, or a range of its
rows, with plain file reads into a buffer of its own, so only what is being converted is held
(the page cache keeps the file, outside the process's RSS, reclaimable).
"""

from __future__ import annotations

import json
import math
import os
import struct
from pathlib import Path

import torch
from torch import Tensor

DTYPES = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16"}
READ_DTYPES = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16}
READ_DTYPES["F64"] = torch.float64
READ_DTYPES["U8"] = torch.uint8  # MXFP4's blocks and scales only (hf_read.py check_tensors)


class SafetensorsError(ValueError):
    """What is wrong with a safetensors file, in words a user can act on (the caller names the
    file)."""


# The largest header we read: real ones are a few hundred bytes per tensor (safetensors itself
# refuses headers over 100 MB); a bigger length means a damaged or foreign file, not a header.
MAX_HEADER = 100_000_000


class SafetensorsReader:
    """The tensors of one safetensors file, each read from disk only when asked for.

    The header is checked whole on opening (every entry's dtype, shape and byte range against
    the file's size, and the ranges tiling the data as safetensors requires), so a truncated or
    damaged file is refused before any tensor is read or anything is written; a few hundred
    bytes per tensor, no data read."""

    def __init__(self, path: Path) -> None:
        self.path = path
        size = os.path.getsize(path)
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise SafetensorsError(
                    f"{size} bytes, too short for a safetensors file (8-byte header length "
                    "first): truncated"
                )
            (n,) = struct.unpack("<Q", head)
            if n > min(size - 8, MAX_HEADER):
                raise SafetensorsError(
                    f"its first 8 bytes announce a {n:,}-byte header but the file holds "
                    f"{size - 8:,} bytes after them: truncated, or not a safetensors file"
                )
            raw = f.read(n)
        try:
            header = json.loads(raw)
        except (ValueError, RecursionError) as e:  # bad UTF-8 or JSON: ValueError subclasses
            raise SafetensorsError(f"its header is not JSON ({e}): not a safetensors file") from e
        if not isinstance(header, dict):
            raise SafetensorsError("its header is not a JSON object: not a safetensors file")
        header.pop("__metadata__", None)
        self.base, self.entries = 8 + n, header
        for name, e in header.items():
            _check_entry(name, e, size - self.base)
        _check_coverage(header, size - self.base)

    def __iter__(self):
        return iter(self.entries)  # the tensor names, as for a dict of tensors

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self.entries[name]["shape"])

    def dtype(self, name: str) -> torch.dtype:
        return READ_DTYPES[self.entries[name]["dtype"]]

    def get(self, name: str) -> Tensor:
        return self.rows(name, 0, self.shape(name)[0] if self.shape(name) else 1)

    def rows(self, name: str, r0: int, r1: int) -> Tensor:
        """Rows [r0, r1) along dim 0 (a 0-d tensor is one row): one contiguous byte range of the
        file, read into a buffer of its own, so only those rows are held."""
        e = self.entries[name]
        shape, begin = e["shape"], e["data_offsets"][0]
        row_bytes = (e["data_offsets"][1] - begin) // max(1, shape[0] if shape else 1)
        n = (r1 - r0) * row_bytes
        buf = torch.empty(n, dtype=torch.uint8)
        with open(self.path, "rb") as f:
            f.seek(self.base + begin + r0 * row_bytes)
            if f.readinto(memoryview(buf.numpy())) != n:  # shrunk since it was opened
                raise SafetensorsError(f"truncated inside tensor {name}")
        out = buf.view(self.dtype(name))
        return out.view([r1 - r0, *shape[1:]] if shape else [])


def _check_entry(name: str, e: object, data_bytes: int) -> None:
    """One header entry: a float dtype, a shape, and a byte range of exactly the shape's size
    inside the file's `data_bytes` bytes of data."""
    if not isinstance(e, dict):
        raise SafetensorsError(f"header entry {name} is not a JSON object: damaged header")
    dtype, shape, offsets = e.get("dtype"), e.get("shape"), e.get("data_offsets")
    if dtype not in READ_DTYPES:
        raise SafetensorsError(
            f"tensor {name} has dtype {dtype}; fitgpt imports floating-point weights only "
            "(F32, BF16, F16, F64; U8 as MXFP4's blocks and scales)"
        )
    ints = (isinstance(shape, list) and all(type(d) is int and d >= 0 for d in shape)) and (
        isinstance(offsets, list) and len(offsets) == 2 and all(type(o) is int for o in offsets)
    )
    if not ints or not 0 <= offsets[0] <= offsets[1]:
        raise SafetensorsError(
            f"tensor {name}: shape {shape!r} or data_offsets {offsets!r} are not valid: "
            "damaged header"
        )
    itemsize = torch.empty((), dtype=READ_DTYPES[dtype]).element_size()
    need = itemsize * math.prod(shape)
    if offsets[1] - offsets[0] != need:
        raise SafetensorsError(
            f"tensor {name}: shape {shape} in {dtype} needs {need:,} bytes, its data_offsets "
            f"span {offsets[1] - offsets[0]:,}: damaged header"
        )
    if offsets[1] > data_bytes:
        raise SafetensorsError(
            f"tensor {name} ends at data byte {offsets[1]:,} but the file holds {data_bytes:,} "
            "bytes of data: truncated (copy or download it again)"
        )


def _check_coverage(header: dict, data_bytes: int) -> None:
    """The byte ranges, in order, tile the data section exactly, as safetensors' own reader
    requires (its Metadata::validate, then "file not fully covered"): two tensors over the same
    bytes would read one's values as the other's (v_proj as k_proj), and a gap or bytes after
    the last tensor mean a header that is not this file's. Each entry is checked already."""
    end, prev = 0, None
    for name, e in sorted(header.items(), key=lambda kv: tuple(kv[1]["data_offsets"])):
        begin, stop = e["data_offsets"]
        if begin != end:
            what = (
                f"overlaps tensor {prev}'s bytes" if begin < end
                else f"leaves {begin - end:,} bytes unclaimed before it"
            )  # fmt: skip
            raise SafetensorsError(
                f"tensor {name} starts at data byte {begin:,} and {what} (data_offsets "
                f"{e['data_offsets']}): damaged header; copy or download the file again"
            )
        end, prev = stop, name
    if end != data_bytes:
        raise SafetensorsError(
            f"its tensors end at data byte {end:,} but the file holds {data_bytes:,} bytes of "
            "data: not the header of this file; copy or download it again"
        )


class SafetensorsWriter:
    """Write tensors named in `entries` (name, shape), in that order, all of dtype `dtype`:
    `with SafetensorsWriter(...) as w: w.write(name, t) ...`."""

    def __init__(
        self,
        path: Path,
        entries: list[tuple[str, tuple[int, ...]]],
        dtype: torch.dtype,
        metadata: dict[str, str],
    ) -> None:
        self.dtype, self.order, self.next = dtype, [n for n, _ in entries], 0
        itemsize = torch.empty((), dtype=dtype).element_size()
        header: dict[str, object] = {"__metadata__": metadata}
        self.sizes: dict[str, tuple[tuple[int, ...], int]] = {}
        offset = 0
        for name, shape in entries:
            nbytes = itemsize * int(torch.Size(shape).numel())
            header[name] = {
                "dtype": DTYPES[dtype],
                "shape": list(shape),
                "data_offsets": [offset, offset + nbytes],
            }
            self.sizes[name] = (tuple(shape), nbytes)
            offset += nbytes
        raw = json.dumps(header, separators=(",", ":")).encode()
        self.header = raw + b" " * (-len(raw) % 8)  # the data section starts 8-byte aligned
        self.path = path

    def __enter__(self) -> SafetensorsWriter:
        self.f = open(self.path, "wb")  # closed by __exit__
        self.f.write(struct.pack("<Q", len(self.header)))
        self.f.write(self.header)
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        try:
            if exc_type is None:
                self._finish()
        finally:
            self.f.close()

    def write(self, name: str, t: Tensor) -> None:
        if self.next >= len(self.order) or name != self.order[self.next]:
            raise ValueError(f"tensor {name} written out of the header's order")
        shape, nbytes = self.sizes[name]
        if tuple(t.shape) != shape:
            raise ValueError(f"tensor {name} has shape {tuple(t.shape)}, the header says {shape}")
        data = t.detach().to(self.dtype).contiguous().view(torch.uint8).reshape(-1)
        assert data.numel() == nbytes
        self.f.write(memoryview(data.numpy()))  # the tensor's own bytes: no extra copy
        self.next += 1

    def _finish(self) -> None:
        """Flush to disk; every tensor of the header must have been written."""
        if self.next != len(self.order):
            raise ValueError(f"{len(self.order) - self.next} tensors were never written")
        self.f.flush()
        os.fsync(self.f.fileno())
