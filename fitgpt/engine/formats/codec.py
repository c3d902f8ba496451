"""Fused decode and encode of one piece of int8 moments (engine/formats/moments.py), compiled.

Why: on the host, AdamW over fp32 state is DRAM-bound (~40 bytes per element per step). int8
moments move fewer bytes, but their eager decode and encode take about a dozen elementwise ops
per piece (per-block absmax, scaling, rounding, a square root and a square), each a pass with
its own thread fan-out; on a 16-core host those passes, not DRAM, set the speed. torch.compile
(inductor's C++ backend) fuses a piece's decode into one loop and its encode into two (the
per-block reductions, then the quantisation).

The kernels compute what Int8Store does, with one difference: inductor compiles C++ with unsafe
floating-point optimisations, so its square root (v is stored as sqrt(v)) may differ from
torch's correctly rounded one in the last bit. A block's scale then differs in its last bit (and
every v of that block decodes a hair differently; measured over 5 steps of 2 M elements: v within
0.5% of its block's largest, m identical, the master within 1.1e-4 at lr 1e-3), and rarely one
quantised value by one step. Either path is a valid encoding. They take whole pieces only (the last, partial piece of a chunk runs eagerly: one
compiled shape per format, no recompiles). Used where FITGPT_HOST_KERNELS says (compiled or
eager); by default compiled on GPU machines (the host optimizer's tier) and eager elsewhere
(a CPU run's compile time would outweigh its small chunks). A compile that fails falls back to
eager with one line on stderr.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable

import torch
from torch import Tensor

from fitgpt.engine.formats.moments import BLOCK

_CACHE: dict[str, tuple[Callable, Callable] | None] = {}


def wanted(device: torch.device) -> bool:
    """Whether the compiled kernels are to be used for state on `device`."""
    mode = os.environ.get("FITGPT_HOST_KERNELS", "")
    if mode in ("compiled", "eager"):
        return mode == "compiled" and device.type == "cpu"
    return device.type == "cpu" and torch.cuda.is_available()


def kernels(moments: str, device: torch.device) -> tuple[Callable, Callable] | None:
    """(decode, encode) for pieces of moments in this format, or None: use the eager path.
    Only int8 has them: measured on the H100 machine's host (16 cores, 201 M-element chunk,
    benchmarks/results/compact_h100_2026-11-23/host_adamw_formats.json), compiling made int8
    about 2x faster, bf16 moments and the split master no faster or slower."""
    if not wanted(device) or moments != "int8":
        return None
    if moments not in _CACHE:
        _CACHE[moments] = (torch.compile(_decode_fn(), dynamic=False),
                           torch.compile(_encode_fn(), dynamic=False))  # fmt: skip
    return _CACHE[moments]


def disable(moments: str, err: BaseException) -> None:
    """A compile failed: eager from now on for this format."""
    print(f"fitgpt: compiled codec for {moments} moments unavailable ({type(err).__name__}: "
          f"{str(err)[:120]}); using the eager path", file=sys.stderr)  # fmt: skip
    _CACHE[moments] = None


def _dequant(q: Tensor, scale: Tensor, signed: bool) -> Tensor:
    x = q.view(-1, BLOCK).to(torch.float32) * scale[:, None]
    if not signed:
        s = scale[:, None] / 2
        x = torch.maximum(x, s)
        x = x * x
    return x.view(-1)


def _quant(x: Tensor, q: Tensor, scale: Tensor, signed: bool) -> None:
    x_RB = x.view(-1, BLOCK)
    qmax = 127.0 if signed else 255.0
    if signed:
        amax = torch.maximum(x_RB.amax(dim=1), x_RB.amin(dim=1).neg())
        t = x_RB
    else:
        t = torch.sqrt(x_RB)
        amax = t.amax(dim=1)
    inv = torch.where(amax > 0, qmax / amax, torch.zeros_like(amax))
    q.view(-1, BLOCK).copy_(torch.round(t * inv[:, None]))
    scale.copy_(amax / qmax)


def _decode_fn() -> Callable:
    def decode(mt, vt, m, v):
        m.copy_(_dequant(mt[0], mt[1], True))
        v.copy_(_dequant(vt[0], vt[1], False))

    return decode


def _encode_fn() -> Callable:
    def encode(m, v, mt, vt):
        _quant(m, mt[0], mt[1], True)
        _quant(v, vt[0], vt[1], False)

    return encode
