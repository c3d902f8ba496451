"""Engine state on disk: one safetensors file per (chunk, rank), readable at any world size.

Each file `c{chunk}-r{rank}.safetensors` holds the rank's contiguous range [lo, hi) of the chunk's
unpadded flat buffer, for each kind of state: `master` (fp32 weights), `exp_avg`, `exp_avg_sq`.
A sidecar `index-r{rank}.json` lists every file with its range, byte size and a CRC-32 of each
tensor. Loading a range reads only the slices that cover it, from whichever ranks wrote them,
so a run saved on 2 ranks with ZeRO-3 resumes on 1 rank with the plain engine and vice versa.

Integrity: sizes are checked for every file (a truncated file is caught before reading), the
safetensors header must parse, and every tensor read whole is CRC-checked. Files are written
under the checkpoint's temporary folder; the trainer renames the folder only when all are in.
"""

from __future__ import annotations

import json
import os
import zlib
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch import Tensor

from fitgpt.errors import UserError

KINDS = ("master", "exp_avg", "exp_avg_sq")


class CorruptCheckpoint(UserError):
    """A checkpoint file is missing, truncated or does not match its recorded checksum."""


def crc(t: Tensor) -> int:
    """CRC-32 of a CPU tensor's bytes (zlib releases the GIL, so threads can overlap these)."""
    return zlib.crc32(t.contiguous().view(torch.uint8).numpy())


def fsync_write_json(path: Path, obj) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


@dataclass
class Piece:
    """One rank's range of one chunk, each kind of state as a 1-D CPU tensor of hi-lo elements."""

    chunk: int
    lo: int
    hi: int
    tensors: dict[str, Tensor]


def write_pieces(folder: Path, rank: int, pieces: Iterable[Piece]) -> None:
    """Write this rank's pieces and its index into `folder` (which must exist)."""
    index = []
    for p in pieces:
        name = f"c{p.chunk:04d}-r{rank:03d}.safetensors"
        tensors = {k: v.contiguous() for k, v in p.tensors.items()}
        save_file(tensors, str(folder / name), metadata={"lo": str(p.lo), "hi": str(p.hi)})
        index.append(
            {
                "file": name,
                "chunk": p.chunk,
                "lo": p.lo,
                "hi": p.hi,
                "bytes": (folder / name).stat().st_size,
                "crc": {k: crc(v) for k, v in tensors.items()},
            }
        )
    fsync_write_json(folder / f"index-r{rank:03d}.json", index)


class StateReader:
    """Reads any range of any chunk's state from a checkpoint folder written at any world size."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self.entries: dict[int, list[dict]] = {}
        indexes = sorted(folder.glob("index-r*.json"))
        if not indexes:
            raise CorruptCheckpoint(
                f"{folder} has no index-r*.json: not a fitgpt checkpoint or incomplete"
            )
        for ix in indexes:
            try:
                entries = json.loads(ix.read_text())
            except (json.JSONDecodeError, OSError) as e:
                raise CorruptCheckpoint(f"{ix} is unreadable ({e})") from e
            for e in entries:
                f = folder / e["file"]
                size = f.stat().st_size if f.exists() else -1
                if size != e["bytes"]:
                    raise CorruptCheckpoint(
                        f"{f} is {'missing' if size < 0 else f'{size} bytes'}, expected {e['bytes']}"
                    )
                self.entries.setdefault(e["chunk"], []).append(e)
        for lst in self.entries.values():
            lst.sort(key=lambda e: e["lo"])

    def read(self, chunk: int, kind: str, lo: int, hi: int, out: Tensor | None = None) -> Tensor:
        """Elements [lo, hi) of `kind` for `chunk`, as fp32 on the CPU (or copied into `out`)."""
        if out is None:
            out = torch.empty(hi - lo, dtype=torch.float32)
        filled = 0
        for e in self.entries.get(chunk, []):
            a, b = max(lo, e["lo"]), min(hi, e["hi"])
            if a >= b:
                continue
            path = self.folder / e["file"]
            try:
                with safe_open(str(path), framework="pt") as f:
                    if a == e["lo"] and b == e["hi"]:
                        t = f.get_tensor(kind)
                        if crc(t) != e["crc"][kind]:
                            raise CorruptCheckpoint(f"{path}: tensor {kind} fails its CRC check")
                    else:
                        t = f.get_slice(kind)[a - e["lo"] : b - e["lo"]]
            except CorruptCheckpoint:
                raise
            except Exception as ex:  # safetensors raises its own error types for bad headers
                raise CorruptCheckpoint(f"{path} is unreadable ({ex})") from ex
            out[a - lo : b - lo].copy_(t)
            filled += b - a
        if filled != hi - lo:
            raise CorruptCheckpoint(
                f"{self.folder}: chunk {chunk} {kind} covers {filled} of the {hi - lo} elements asked for"
            )
        return out
