"""Engine state on disk: one safetensors file per (chunk, rank), readable at any world size.

Each file `c{chunk}-r{rank}.safetensors` holds the rank's contiguous range [lo, hi) of the chunk's
unpadded flat buffer, for each kind of state: `master` (fp32 weights), and in full checkpoints
`exp_avg`, `exp_avg_sq` (a weights-only checkpoint, `--save-optimizer none`, holds `master`
alone). A sidecar `index-r{rank}.json` lists every file with its range, byte size, a CRC-32 of
its safetensors header and a CRC-32 of each tensor. Loading a range reads the tensors that cover
it, from whichever ranks wrote them, so a run saved on 2 ranks with ZeRO-3 resumes on 1 rank with
the plain engine and vice versa.

Integrity, every byte of a state file: a safetensors file is its header followed by its tensors
back to back, so the size, the header's CRC and the tensors' CRCs together cover all of it. The
size and header of every file are checked when a reader opens the folder (small reads); every
tensor is read whole and CRC-checked before any of it is used (a resharded load, which needs a
slice, reads the whole tensor once: up to 4 bytes × the file's range extra, never wrong data).
Files are written under the checkpoint's temporary folder; the trainer renames the folder only
when all are in.
"""

from __future__ import annotations

import json
import os
import struct
import zlib
from abc import ABC, abstractmethod
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch import Tensor

from fitgpt.engine.layout import ChunkSpec
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


def header_bytes(path: Path, size: int) -> bytes:
    """The safetensors header of `path`: its 8-byte length and the JSON it announces."""
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise CorruptCheckpoint(f"{path} is shorter than a safetensors header")
        (n,) = struct.unpack("<Q", head)
        if n > size - 8:  # a damaged length must not make us read (or allocate) without bound
            raise CorruptCheckpoint(f"{path}: its header length {n} exceeds the file")
        return head + f.read(n)


@dataclass
class Piece:
    """One rank's range of one chunk, each kind of state as a 1-D CPU tensor of hi-lo elements."""

    chunk: int
    lo: int
    hi: int
    tensors: dict[str, Tensor]


def write_pieces(folder: Path, rank: int, pieces: Iterable[Piece]) -> None:
    """Write this rank's pieces and its index into `folder` (which must exist)."""
    index, seen = [], set()
    for p in pieces:
        # a rank may write several ranges of one chunk (expert parallelism: its experts' rows of
        # each of the chunk's parameters); the reader finds each by the index, not the name
        part = f"-{p.lo}" if p.chunk in seen else ""
        seen.add(p.chunk)
        name = f"c{p.chunk:04d}-r{rank:03d}{part}.safetensors"
        tensors = {k: v.contiguous() for k, v in p.tensors.items()}
        save_file(tensors, str(folder / name), metadata={"lo": str(p.lo), "hi": str(p.hi)})
        size = (folder / name).stat().st_size
        index.append(
            {
                "file": name,
                "chunk": p.chunk,
                "lo": p.lo,
                "hi": p.hi,
                "bytes": size,
                "header_crc": zlib.crc32(header_bytes(folder / name, size)),
                "crc": {k: crc(v) for k, v in tensors.items()},
            }
        )
    fsync_write_json(folder / f"index-r{rank:03d}.json", index)


def _entries(ix: Path) -> list[dict]:
    """The entries of one index file, each checked for the fields and types the reader uses."""
    try:
        entries = json.loads(ix.read_bytes().decode("utf-8"))
        for e in entries:
            ints = [e["chunk"], e["lo"], e["hi"], e["bytes"], *e["crc"].values()]
            if not (isinstance(e["file"], str) and all(type(v) is int for v in ints)):
                raise TypeError("a field has the wrong type")
            if "/" in e["file"] or not 0 <= e["lo"] <= e["hi"]:
                raise ValueError(f"entry {e['file']!r} is out of range")
        return entries
    except (OSError, UnicodeDecodeError, ValueError, TypeError, KeyError, AttributeError) as ex:
        raise CorruptCheckpoint(
            f"{ix} is unreadable or malformed ({type(ex).__name__}: {ex})"
        ) from None


class Reader(Protocol):
    """What engines load state through: elements [lo, hi) of one kind of one chunk's flat buffer,
    in the loading rank's layout (StateReader; TPReader; a WeightSource's reader)."""

    def read(
        self, chunk: int, kind: str, lo: int, hi: int, out: Tensor | None = None
    ) -> Tensor: ...


class WeightSource(ABC):
    """Weights that are no checkpoint folder (a Hugging Face model), read where they lie: each
    rank opens a reader of its own ranges, `master` only (an engine loads it as a weights-only
    checkpoint, optimizer=False). Engines take one wherever they take a checkpoint folder."""

    @abstractmethod
    def reader(self, local: list[ChunkSpec] | None, tp_rank: int, tp: int) -> Reader:
        """A reader in this rank's layout: `local`, the rank's ChunkSpecs under tensor
        parallelism (rank `tp_rank` of `tp`), None for the unsplit model's."""


class NamedWeights(WeightSource):
    """Whole parameters by name (an adapter folder's tensors, fitgpt/adapters/peft.py), read in
    the layout `layout` they fill: `master` only, unsplit."""

    def __init__(self, tensors: dict[str, Tensor], layout: list[ChunkSpec]) -> None:
        self.tensors, self.layout = tensors, layout

    def reader(self, local: list[ChunkSpec] | None, tp_rank: int, tp: int) -> Reader:
        if tp != 1:
            raise ValueError("named weights are read unsplit (no tensor parallelism)")
        return self

    def read(self, chunk: int, kind: str, lo: int, hi: int, out: Tensor | None = None) -> Tensor:
        if kind != "master":
            raise UserError(f"named weights hold weights only, no {kind}")
        spec = self.layout[chunk]
        flat = torch.cat([self.tensors[s.name].reshape(-1).float() for s in spec.slots])
        if out is None:
            return flat[lo:hi].clone()
        return out.copy_(flat[lo:hi])


def open_reader(src: Path | WeightSource) -> Reader:
    """The reader of a checkpoint folder or a WeightSource, in the unsplit model's layout."""
    return src.reader(None, 0, 1) if isinstance(src, WeightSource) else StateReader(src)


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
            for e in _entries(ix):
                self._check_file(e)
                self.entries.setdefault(e["chunk"], []).append(e)
        for lst in self.entries.values():
            lst.sort(key=lambda e: e["lo"])

    def _check_file(self, e: dict) -> None:
        f = self.folder / e["file"]
        size = f.stat().st_size if f.is_file() else -1
        if size != e["bytes"]:
            state = "missing" if size < 0 else f"{size} bytes"
            raise CorruptCheckpoint(f"{f} is {state}, expected {e['bytes']}")
        if "header_crc" in e and zlib.crc32(header_bytes(f, size)) != e["header_crc"]:
            raise CorruptCheckpoint(f"{f}: its header fails its CRC check")

    def _tensor(self, e: dict, kind: str) -> Tensor:
        """The whole `kind` tensor of one file, CRC-checked."""
        path = self.folder / e["file"]
        if kind not in e["crc"]:
            raise CorruptCheckpoint(f"{path} holds no {kind} (its index lists {list(e['crc'])})")
        try:
            with safe_open(str(path), framework="pt") as f:
                t = f.get_tensor(kind)
        except Exception as ex:  # safetensors raises its own error types for bad headers
            raise CorruptCheckpoint(f"{path} is unreadable ({ex})") from ex
        if t.dtype != torch.float32 or t.shape != (e["hi"] - e["lo"],):
            raise CorruptCheckpoint(f"{path}: tensor {kind} is {t.dtype} {list(t.shape)}")
        if crc(t) != e["crc"][kind]:
            raise CorruptCheckpoint(f"{path}: tensor {kind} fails its CRC check")
        return t

    def read(self, chunk: int, kind: str, lo: int, hi: int, out: Tensor | None = None) -> Tensor:
        """Elements [lo, hi) of `kind` for `chunk`, as fp32 on the CPU (or copied into `out`)."""
        if out is None:
            out = torch.empty(hi - lo, dtype=torch.float32)
        filled = 0
        for e in self.entries.get(chunk, []):
            a, b = max(lo, e["lo"]), min(hi, e["hi"])
            if a >= b:
                continue
            t = self._tensor(e, kind)  # whole, so the CRC covers what is used
            out[a - lo : b - lo].copy_(t[a - e["lo"] : b - e["lo"]])
            filled += b - a
        if filled != hi - lo:
            raise CorruptCheckpoint(
                f"{self.folder}: chunk {chunk} {kind} covers {filled} of the {hi - lo} elements asked for"
            )
        return out
