"""What `fitgpt matmul` multiplies, how, and in which precision: one config, and the dtype rules.

The three precisions differ in what is stored and what the GEMM rounds:
  fp32  operands and C stored fp32, cuBLAS in IEEE fp32 (TF32 off)
  tf32  operands and C stored fp32, cuBLAS rounds the inputs to TF32 (10-bit mantissa)
  bf16  operands stored bf16 (half the memory and traffic), fp32 accumulation inside the GEMM
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Literal

import torch

from fitgpt.errors import UserError

Layout = Literal["rows", "2d"]
DType = Literal["fp32", "tf32", "bf16"]
DTYPES: tuple[str, ...] = ("fp32", "tf32", "bf16")
LAYOUTS: tuple[str, ...] = ("rows", "2d")


@dataclass(frozen=True)
class MatmulConfig:
    """C = A·B for n×n A and B. Every field is a flag of `fitgpt matmul`."""

    n: int = field(default=50000, metadata={"help": "matrix size: A, B and C are n×n"})
    dtype: DType = field(
        default="fp32", metadata={"help": "fp32 (IEEE), tf32 (fp32 storage, TF32 GEMM), bf16"}
    )
    layout: Layout = field(
        default="rows",
        metadata={
            "help": "rows: each GPU holds a band of A's rows and receives B in column panels; "
            "2d: A, B and C in q×q blocks over q² GPUs (the SUMMA algorithm)"
        },
    )
    out_of_core: bool = field(
        default=False,
        metadata={"help": "one device multiplies matrices larger than its memory, tile by tile"},
    )
    seed: int = field(default=0, metadata={"help": "seed of the generated A, B and check vector"})
    a_path: str | None = field(
        default=None, metadata={"help": "read A from this .npy (n×n) instead", "flag": "a"}
    )
    b_path: str | None = field(
        default=None, metadata={"help": "read B from this .npy (n×n) instead", "flag": "b"}
    )
    out: str | None = field(default=None, metadata={"help": "write C to this .npy file"})
    panel: int = field(
        default=0,
        metadata={
            "help": "columns of B (or of A's block) sent to every GPU at once; 0: auto, at most 4096"
        },
    )
    tile_rows: int = field(default=0, metadata={"help": "out-of-core C tile rows; 0: auto"})
    tile_cols: int = field(default=0, metadata={"help": "out-of-core C tile columns; 0: auto"})
    samples: int = field(
        default=64, metadata={"help": "entries of C compared with an exact float64 dot product"}
    )
    repeat: int = field(default=1, metadata={"help": "time this many products, report the median"})
    ref_n: int = field(
        default=-1,
        metadata={
            "help": "size of the one-device GEMM reference; -1: 16384 (GPU), 512 (CPU); 0: skip"
        },
    )
    host_mem: float = field(
        default=0.0,
        metadata={"help": "host memory to assume, GB; 0: MemAvailable in /proc/meminfo"},
    )
    device_mem: float = field(
        default=0.0, metadata={"help": "device memory to use, GB; 0: what the device has free"}
    )

    def __post_init__(self) -> None:
        if self.n < 1:
            raise UserError(f"--n {self.n}: must be a positive matrix size, e.g. --n 50000")
        if self.dtype not in DTYPES:
            raise UserError(f"--dtype {self.dtype!r}: use one of {', '.join(DTYPES)}")
        if self.layout not in LAYOUTS:
            raise UserError(f"--layout {self.layout!r}: use one of {', '.join(LAYOUTS)}")
        for name in ("panel", "tile_rows", "tile_cols", "samples"):
            if getattr(self, name) < 0:
                flag = "--" + name.replace("_", "-")
                raise UserError(f"{flag} {getattr(self, name)}: must be >= 0 (0 means auto)")
        if self.repeat < 1:
            raise UserError(f"--repeat {self.repeat}: must be at least 1")
        if self.ref_n < -1:
            raise UserError(f"--ref-n {self.ref_n}: use -1 (auto), 0 (skip) or a size")
        if self.host_mem < 0 or self.device_mem < 0:
            raise UserError("--host-mem/--device-mem: must be >= 0 GB (0 means measure it)")
        from fitgpt.paths import check_readable_file

        for flag, path in (("--a", self.a_path), ("--b", self.b_path)):
            if path is not None:
                check_readable_file(path, flag, "an n×n .npy saved with np.save")
        if self.out is not None and not self.out.endswith(".npy"):
            raise UserError(f"--out {self.out}: C is written as .npy; name the file *.npy")
        if self.out is not None and not os.path.isdir(os.path.dirname(os.path.abspath(self.out))):
            raise UserError(f"--out {self.out}: its folder does not exist; create it first")

    @property
    def storage(self) -> torch.dtype:
        return storage_dtype(self.dtype)

    @property
    def itemsize(self) -> int:
        return torch.empty((), dtype=self.storage).element_size()

    @property
    def flops(self) -> float:
        return 2.0 * self.n**3


def storage_dtype(dtype: str) -> torch.dtype:
    """How the operands are stored: fp32 for fp32 and tf32 (TF32 is a GEMM mode), else bf16."""
    return torch.bfloat16 if dtype == "bf16" else torch.float32


@contextlib.contextmanager
def matmul_precision(dtype: str) -> Iterator[None]:
    """TF32 on for tf32, off for fp32 (a process-wide torch setting, restored on exit)."""
    before = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("high" if dtype == "tf32" else "highest")
    try:
        yield
    finally:
        torch.set_float32_matmul_precision(before)
