"""Where A and B come from: generated from a seed, or read from .npy files, any block at a time.

Generated entries are a pure function of (seed, matrix, global row, global column): a
counter-based hash, not a random stream, so every layout (rows, 2-D blocks, out-of-core tiles)
builds the SAME matrices from its own blocks, and the verifier can regenerate any single row or
column without the rest. Each block is computed on the device that will hold it, with
vectorised 32-bit integer arithmetic carried in int64 (products stay below 2^59: no overflow).

    row key  rk[i] = mix(i ^ key(seed, matrix))        one per row of the block
    col key  ck[j] = mix(j ^ COL_SALT)                 one per column
    entry    h = mix(rk[i] ^ ck[j]);  value = (h >> 8) / 2^23 - 1     uniform in [-1, 1)

The value is k·2^-23 - 1 for a 24-bit k, exactly representable in fp32 and float64, so the
generated fp32 operands and a float64 regeneration agree bit for bit (bf16 storage rounds them).
Cost: about 15 elementwise int64 passes per entry, ~2% of a fp32 GEMM's time at n=50000.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch

from fitgpt.errors import UserError

M32 = 0xFFFFFFFF
MIX = 0x45D9F3B  # odd multiplier < 2^27 of a well-tested 32-bit integer hash
COL_SALT = 0x2545F491
MATRIX_A, MATRIX_B, CHECK_VECTOR = 1, 2, 3

# Entries generated per pass: bounds the int64 temporaries (16 bytes an entry) to 256 MB on a
# GPU, 16 MB on a CPU.
CHUNK_CUDA, CHUNK_CPU = 1 << 24, 1 << 20


def _mix(h: torch.Tensor) -> torch.Tensor:
    """A bijective 32-bit hash on int64 values in [0, 2^32), in place."""
    for _ in range(2):
        h ^= h >> 16
        h *= MIX
        h &= M32
    h ^= h >> 16
    return h


def _mix_int(v: int) -> int:
    for _ in range(2):
        v = (((v >> 16) ^ v) * MIX) & M32
    return (v >> 16) ^ v


def _key(seed: int, matrix: int) -> int:
    return _mix_int((_mix_int(seed & M32) ^ (matrix * 0x9E3779B1)) & M32)


def _uniform_into(out: torch.Tensor, seed: int, matrix: int, r0: int, c0: int) -> None:
    """Fill `out` (h, w) with entries (r0.., c0..), a few rows at a time (bounded temporaries)."""
    h, w = out.shape
    chunk = CHUNK_CUDA if out.device.type == "cuda" else CHUNK_CPU
    step = max(1, chunk // max(1, w))
    key, dev = _key(seed, matrix), out.device
    ck = _mix(torch.arange(c0, c0 + w, dtype=torch.int64, device=dev) ^ COL_SALT)
    for r in range(0, h, step):
        e = min(h, r + step)
        rk = _mix(torch.arange(r0 + r, r0 + e, dtype=torch.int64, device=dev) ^ key)
        v = _mix(rk[:, None] ^ ck[None, :])  # (e - r, w) int64: the one large temporary
        v >>= 8
        # int -> fp32 is exact below 2^24, and so are the scale and the shift.
        out[r:e].copy_(v.to(torch.float32).mul_(2.0**-23).sub_(1.0))


def check_vector(seed: int, n: int, device: torch.device) -> torch.Tensor:
    """Freivalds' x (n, float64): random signs, magnitudes in [0.5, 1), never near zero, so a
    wrong entry in any column of C moves C·x by at least half its error."""
    u = torch.empty(1, n, dtype=torch.float64, device=device)
    _uniform_into(u, seed, CHECK_VECTOR, 0, 0)
    u = u[0]
    return torch.where(u < 0, u * 0.5 - 0.5, u * 0.5 + 0.5)


class Source(Protocol):
    """An n×n operand that can produce any block on any device."""

    n: int

    def fill(self, out: torch.Tensor, r0: int, c0: int) -> None:
        """Write entries (r0.., c0..) into `out` (h, w), converting to out.dtype."""
        ...

    def describe(self) -> str: ...


def block(src: Source, rows: tuple[int, int], cols: tuple[int, int], dtype, device) -> torch.Tensor:
    """A new (rows × cols) tensor of `src`'s entries."""
    out = torch.empty(rows[1] - rows[0], cols[1] - cols[0], dtype=dtype, device=device)
    src.fill(out, rows[0], cols[0])
    return out


@dataclass(frozen=True)
class Generated:
    """Entries from the hash of (seed, matrix id, row, column)."""

    n: int
    seed: int
    matrix: int

    def fill(self, out: torch.Tensor, r0: int, c0: int) -> None:
        _uniform_into(out, self.seed, self.matrix, r0, c0)

    def describe(self) -> str:
        return f"generated (seed {self.seed})"


class NpyFile:
    """Entries read from an n×n .npy file through a memory map (only the block read is loaded)."""

    def __init__(self, path: str, n: int):
        self.path, self.n = path, n
        self._array: np.ndarray | None = None  # opened on first use, in the process that reads

    def fill(self, out: torch.Tensor, r0: int, c0: int) -> None:
        if self._array is None:
            self._array = np.load(self.path, mmap_mode="r")
        h, w = out.shape
        # Read ~256 MB of rows at a time so the host copy of a block stays small.
        step = max(1, (256 << 20) // max(1, w * 8))
        for r in range(0, h, step):
            e = min(h, r + step)
            # A private copy: torch will not wrap the read-only memory map itself.
            piece = np.array(self._array[r0 + r : r0 + e, c0 : c0 + w], order="C")
            out[r:e].copy_(torch.from_numpy(piece))  # on a GPU: a host-device copy, synchronous

    def describe(self) -> str:
        return os.path.basename(self.path)

    def __getstate__(self) -> dict:  # spawned ranks open their own map
        return {"path": self.path, "n": self.n, "_array": None}


def npy_shape(path: str, flag: str) -> tuple[int, int]:
    """The (n, n) shape of a .npy operand, read from its header; one-line errors otherwise: a
    folder, a missing or empty file, a file cut short or not a .npy (np.load raises EOFError,
    ValueError or OSError for those), a shape that is not square or holds no entry, a dtype that
    is not floating point."""
    from fitgpt.paths import check_readable_file

    check_readable_file(path, flag, "an n×n .npy saved with np.save")
    with open(path, "rb") as f:
        magic = f.read(6)
    if magic != b"\x93NUMPY":  # else np.load tries it as a pickle and blames allow_pickle
        raise UserError(f"{flag} {path}: not a .npy file (no .npy header); save it with np.save")
    try:
        arr = np.load(path, mmap_mode="r")
    except (OSError, ValueError, EOFError) as e:
        raise UserError(
            f"{flag} {path}: not a readable .npy file ({e}); save it with np.save"
        ) from None
    if arr.ndim != 2 or arr.shape[0] != arr.shape[1]:
        raise UserError(f"{flag} {path}: shape {arr.shape} is not square n×n; give an n×n matrix")
    if arr.shape[0] == 0:
        raise UserError(
            f"{flag} {path}: shape {arr.shape} holds no entry; give an n×n matrix, n ≥ 1"
        )
    if arr.dtype.kind != "f":
        raise UserError(
            f"{flag} {path}: dtype {arr.dtype} is not floating point; save it as float32"
        )
    return arr.shape


def open_source(path: str | None, flag: str, n: int, seed: int, matrix: int) -> Source:
    if path is None:
        return Generated(n, seed, matrix)
    shape = npy_shape(path, flag)
    if shape[0] != n:
        raise UserError(f"{flag} {path}: shape {shape} does not match --n {n}; drop --n or fix it")
    return NpyFile(path, n)


def operands(cfg) -> tuple[Source, Source]:
    """(A, B) for a MatmulConfig."""
    return (
        open_source(cfg.a_path, "--a", cfg.n, cfg.seed, MATRIX_A),
        open_source(cfg.b_path, "--b", cfg.n, cfg.seed, MATRIX_B),
    )


def row_col_dot(a: Source, b: Source, i: int, j: int, device: torch.device) -> torch.Tensor:
    """The exact-as-float64 C[i, j] = Σ_k A[i, k]·B[k, j], from one row of A and one column of B."""
    n = a.n
    return (
        block(a, (i, i + 1), (0, n), torch.float64, device)[0]
        @ block(b, (0, n), (j, j + 1), torch.float64, device)[:, 0]
    )
