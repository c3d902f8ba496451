"""The yardstick: one device's GEMM rate (cuBLAS on a GPU) at a size that fits, same dtype.

The distributed and out-of-core rates are reported as a fraction of world × this rate, so
1.0 means every device ran its share as fast as a plain torch.mm of a comfortable size.
"""

from __future__ import annotations

import time

import torch

from fitgpt.matmul.config import matmul_precision, storage_dtype

AUTO_REF_N = {"cuda": 16384, "cpu": 512}


def ref_size(ref_n: int, device: torch.device) -> int:
    return AUTO_REF_N.get(device.type, 512) if ref_n < 0 else ref_n


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)  # host-device sync: timing needs the GEMMs finished


def gemm_tflops(n: int, dtype: str, device: torch.device, seconds: float = 0.5) -> float:
    """TFLOP/s of torch.mm on two n×n matrices: one warm-up, then repeats for ~`seconds`."""
    gen = torch.Generator(device=device).manual_seed(0)
    st = storage_dtype(dtype)
    a = torch.rand(n, n, generator=gen, device=device).sub_(0.5).to(st)
    b = torch.rand(n, n, generator=gen, device=device).sub_(0.5).to(st)
    c = torch.empty(n, n, dtype=st, device=device)
    with matmul_precision(dtype):
        t0 = time.perf_counter()
        torch.mm(a, b, out=c)  # warm-up: cuBLAS picks its kernel here
        _sync(device)
        reps = max(2, min(20, int(seconds / max(time.perf_counter() - t0, 1e-6))))
        t0 = time.perf_counter()
        for _ in range(reps):
            torch.mm(a, b, out=c)
        _sync(device)
        elapsed = time.perf_counter() - t0
    del a, b, c  # free before the real product allocates
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return 2.0 * n**3 * reps / elapsed / 1e12
