"""The host tier's AdamW over compact state as one native pass per element (host_adamw.cpp).

Why hand-written: on the host, AdamW is DRAM-bound, and the compact formats exist to move fewer
bytes (split master + bf16 moments: 18 bytes per element per step against ~40 for fp32 state
through torch's fused kernel). Built from torch operations they move more, not fewer: the join,
the decodes, the gradient's upcast, AdamW, the encodes and the split are a dozen passes over
fp32 scratch (measured on the H100 machine's host: 1.7x slower per element than fp32 state,
benchmarks/results/compact_h100_2026-11-23). torch.compile fuses them into one loop, but
inductor's C++ does not vectorize int16 (the remainder) and folds a bf16 round trip into
nothing, so its loop ran slower than the eager passes. No library ships an AdamW over a split
master or block-wise int8 moments on the CPU (bitsandbytes' 8-bit optimizers are GPU kernels).
So: about 180 lines of C++, auto-vectorized by the compiler, one pass per element.

Built on first use with the C++ compiler torch.compile uses ($CXX, else c++), -O3
-march=native -ffp-contract=off, into ~/.cache/fitgpt (FITGPT_CACHE) under a name hashed from
the source and flags (written to a temporary name, then renamed); loaded with ctypes, which
releases the GIL during the call, so THREADS Python threads run it over disjoint ranges (no
OpenMP runtime of its own beside torch's). No compiler, or a failed build: one line on stderr
and the torch path (engine/formats/compact.py), as before.

Used for host-homed compact state with bf16 or int8 moments where FITGPT_HOST_KERNELS says
(native; compiled and eager turn it off), by default on GPU machines (the host optimizer's
tier). fp32 moments keep torch's kernel, so a split master stays bit-identical to an fp32 one
(this kernel's arithmetic is torch's formula but not its code: see host_adamw.cpp).
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch
from torch import Tensor

from fitgpt.engine.formats.moments import BLOCK, MomentStore

SOURCE = Path(__file__).with_name("host_adamw.cpp")
# no -ffast-math: IEEE fp32 as torch computes it; no contraction into fused multiply-adds
FLAGS = "-O3 -march=native -ffp-contract=off -fno-math-errno -fno-trapping-math -shared -fPIC"
_LIB: list = []  # [ctypes function] once built, [None] once it failed
_POOL: dict[int, ThreadPoolExecutor] = {}  # by thread count (torch's intra-op threads)
SPANS_PER_THREAD = 4  # a few more ranges than threads: a thread on a shared core falls behind


def wanted(device: torch.device) -> bool:
    """Whether state on `device` steps through the native kernel."""
    mode = os.environ.get("FITGPT_HOST_KERNELS", "")
    if mode:
        return mode == "native" and device.type == "cpu"
    return device.type == "cpu" and torch.cuda.is_available()


def kernel():
    """The built kernel, or None (no compiler, or the build failed: said once on stderr)."""
    if not _LIB:
        try:
            _LIB.append(_load())
        except (OSError, subprocess.SubprocessError, RuntimeError) as e:
            print(f"fitgpt: native host AdamW unavailable ({str(e).strip()[:160]}); using the "
                  "torch path", file=sys.stderr)  # fmt: skip
            _LIB.append(None)
    return _LIB[0]


def _load():
    cxx = os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++")
    if not cxx:
        raise RuntimeError("no C++ compiler found (set CXX)")
    src = SOURCE.read_text()
    if f"BLOCK = {BLOCK};" not in src:
        raise RuntimeError(
            f"host_adamw.cpp's BLOCK differs from engine/formats/moments.py's {BLOCK}"
        )
    # -march=native: a cache shared between machines (a network home) keeps one per CPU
    tag = hashlib.sha256((src + cxx + FLAGS + _cpu_flags()).encode()).hexdigest()[:16]
    cache = Path(os.environ.get("FITGPT_CACHE", Path.home() / ".cache" / "fitgpt"))
    lib = cache / f"host_adamw_{tag}.so"
    if not lib.exists():
        cache.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(suffix=".so", dir=cache)
        os.close(fd)
        try:
            p = subprocess.run([cxx, *FLAGS.split(), str(SOURCE), "-o", tmp], capture_output=True,
                               text=True, timeout=120)  # fmt: skip
            if p.returncode:
                raise RuntimeError(f"{cxx} failed: {p.stderr.strip().splitlines()[-1:]}")
            os.replace(tmp, lib)  # another process may have built it too: same bytes
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
    fn = ctypes.CDLL(str(lib)).fitgpt_adamw
    fn.restype = None
    fn.argtypes = [ctypes.c_int64] * 3 + [ctypes.c_int] * 2 + [ctypes.c_void_p] * 11
    return fn


def _cpu_flags() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next((line for line in f if line.startswith("flags")), "")
    except OSError:
        return ""


def _ptr(t: Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


def adamw_(
    weights: Tensor,
    master: Tensor | None,
    grad: Tensor,
    m: MomentStore,
    v: MomentStore,
    d: int,
    hp: Tensor,
) -> None:
    """One step over a whole state of n = len(grad) elements, in place, split over the intra-op
    thread count's Python threads, in ranges of whole int8 blocks (the GIL is released in the
    kernel).
    weights: bf16 [n] (a split master's high half in; the new weights out); master: the int16
    remainder or an fp32 master; hp: fp32 [8] (lr, beta1, beta2, eps, weight decay,
    1 - beta1^t, sqrt(1 - beta2^t), gradient multiplier); elements before d decay."""
    fn = kernel()
    n = grad.numel()
    split = master.dtype == torch.int16
    q = m.kind == "int8"
    args = [
        1 if split else 0,
        1 if q else 0,
        _ptr(weights),  # may alias grad (an fp32 master's staging buffer): read, then written
        _ptr(master) if split else None,
        None if split else _ptr(master),
        _ptr(grad),
        None if q else _ptr(m.tensors["data"]),
        _ptr(m.tensors["q"]) if q else None,
        _ptr(m.tensors["scale"]) if q else None,
        None if q else _ptr(v.tensors["data"]),
        _ptr(v.tensors["q"]) if q else None,
        _ptr(v.tensors["scale"]) if q else None,
        _ptr(hp),
    ]
    threads = max(1, torch.get_num_threads())
    # SPANS_PER_THREAD spans per thread, taken from the pool's queue as threads come free: with
    # one static span each, a thread sharing its core (the backward's Python threads, while a
    # speculative update runs beside them) held the whole chunk back
    per = -(-n // (threads * SPANS_PER_THREAD) // BLOCK) * BLOCK  # whole int8 blocks per span
    spans = [(lo, min(lo + per, n)) for lo in range(0, n, per)]
    if len(spans) == 1 or threads == 1:
        fn(0, n, d, *args)
        return
    pool = _POOL.get(threads)
    if pool is None:
        pool = _POOL[threads] = ThreadPoolExecutor(threads, thread_name_prefix="fitgpt-adamw")
    for f in [pool.submit(fn, lo, hi, d, *args) for lo, hi in spans]:
        f.result()
