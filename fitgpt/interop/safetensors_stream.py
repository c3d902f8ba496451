"""safetensors files written and read one tensor at a time.

`safetensors.torch.save_file` needs every tensor in memory at once; for a model bigger than host
RAM that is the whole model twice (our chunks plus the converted copies). The format is simple
enough to stream: 8 bytes of little-endian header length, a JSON header giving each tensor's
dtype, shape and [begin, end) byte range in the data section, then the data. We know every shape
up front, so the header is written first and the tensors follow in the order it lists them.

Reading: `safe_open` memory-maps the file, and every page a read touches stays mapped (and
counted in the process's RSS) until the file is closed: reading a whole model tensor by tensor
would show the whole file as resident. `SafetensorsReader` reads each tensor with plain file
reads into a buffer of its own, so only the tensor being converted is held.
"""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path

import torch
from torch import Tensor

DTYPES = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16"}
READ_DTYPES = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16}
READ_DTYPES["F64"] = torch.float64


class SafetensorsReader:
    """The tensors of one safetensors file, each read from disk only when asked for."""

    def __init__(self, path: Path) -> None:
        self.path = path
        with open(path, "rb") as f:
            (n,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(n))
        header.pop("__metadata__", None)
        self.base, self.entries = 8 + n, header
        for name, e in header.items():
            if e["dtype"] not in READ_DTYPES:
                raise ValueError(f"tensor {name} has dtype {e['dtype']}, not a float type")

    def __iter__(self):
        return iter(self.entries)  # the tensor names, as for a dict of tensors

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self.entries[name]["shape"])

    def get(self, name: str) -> Tensor:
        e = self.entries[name]
        begin, end = e["data_offsets"]
        buf = torch.empty(end - begin, dtype=torch.uint8)
        with open(self.path, "rb") as f:
            f.seek(self.base + begin)
            if f.readinto(memoryview(buf.numpy())) != end - begin:
                raise ValueError(f"{self.path} is truncated inside tensor {name}")
        return buf.view(READ_DTYPES[e["dtype"]]).view(e["shape"])


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
