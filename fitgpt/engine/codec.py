"""Fused decode and encode of one piece of compact optimizer state (engine/compact.py), compiled.

Why: on the host, AdamW over fp32 state is DRAM-bound (~40 bytes per element per step). The
compact formats move fewer bytes, but decoding and encoding them in eager torch takes about 20
elementwise ops per piece (the split master's integer join and split, int8's per-block absmax,
scaling, rounding, square root), each a pass with its own thread fan-out and launch cost; on a
16-core host those passes, not DRAM, set the speed. torch.compile (inductor's C++ backend) fuses
a piece's decode into one loop and its encode into two (the per-block reductions, then the
quantisation), so each byte of compact state is read and written once.

The kernels compute what the eager stores do, and the split master and bf16 moments to the bit
(integer arithmetic and exact casts; the tests hold them equal). inductor compiles C++ with
unsafe floating-point optimisations, so its square root (int8 v's sqrt(v)) may differ from
torch's correctly rounded one in the last bit: a block's scale, and rarely one quantised value,
can differ by one step between the eager and compiled paths. Either is a valid encoding. They take whole pieces only (the last, partial piece of a chunk runs eagerly: one
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

from fitgpt.engine.moments import BLOCK

_CACHE: dict[tuple[str, str], tuple[Callable, Callable] | None] = {}


def wanted(device: torch.device) -> bool:
    """Whether the compiled kernels are to be used for state on `device`."""
    mode = os.environ.get("FITGPT_HOST_KERNELS", "")
    if mode in ("compiled", "eager"):
        return mode == "compiled" and device.type == "cpu"
    return device.type == "cpu" and torch.cuda.is_available()


def kernels(master: str, moments: str, device: torch.device) -> tuple[Callable, Callable] | None:
    """(decode, encode) for pieces of state in these formats, or None: use the eager path."""
    if not wanted(device) or (master, moments) == ("fp32", "fp32"):
        return None
    key = (master, moments)
    if key not in _CACHE:
        fns = []
        for fn in (_decode_fn(master, moments), _encode_fn(master, moments)):
            # a code object of its own per format: dynamo caches compiled graphs per code
            # object, and the closures of one factory would share (and evict) one cache
            fn.__code__ = fn.__code__.replace(co_name=f"{fn.__name__}_{master}_{moments}")
            fns.append(torch.compile(fn, dynamic=False))
        _CACHE[key] = (fns[0], fns[1])
    return _CACHE[key]


def disable(master: str, moments: str, err: BaseException) -> None:
    """A compile failed: eager from now on for these formats."""
    print(f"fitgpt: compiled codec for {master}/{moments} unavailable ({type(err).__name__}: "
          f"{str(err)[:120]}); using the eager path", file=sys.stderr)  # fmt: skip
    _CACHE[(master, moments)] = None


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


def _decode_fn(master: str, moments: str) -> Callable:
    def decode(hi, md, mt, vt, p, m, v):
        if master == "split":
            p.view(torch.int32).copy_(hi.to(torch.float32).view(torch.int32) + md)
        if moments == "bf16":
            m.copy_(mt[0])
            v.copy_(vt[0])
        elif moments == "int8":
            m.copy_(_dequant(mt[0], mt[1], True))
            v.copy_(_dequant(vt[0], vt[1], False))

    return decode


def _encode_fn(master: str, moments: str) -> Callable:
    def encode(p, m, v, hi, md, mt, vt):
        if moments == "bf16":
            mt[0].copy_(m)
            vt[0].copy_(v)
        elif moments == "int8":
            _quant(m, mt[0], mt[1], True)
            _quant(v, vt[0], vt[1], False)
        if master == "split":
            # `hi` is the bf16 weights viewed as int16. Round to nearest even on the bits, as
            # torch's cast does (c10's round_to_nearest_even): inductor would fold a
            # bf16 -> fp32 round trip away, so the rounding is spelled out in integers.
            x = p.view(torch.int32)
            H = x >> 16  # the high half, truncated (arithmetic shift: sign-extended)
            h = (x + (0x7FFF + (H & 1))) >> 16  # rounded
            hi.copy_(h.to(torch.int16))
            # r = x - h·2^16 = L - (h - H)·2^16, with L the low 16 bits: no shifts of negatives
            r = (x & 0xFFFF) - (h - H) * 65536
            md.copy_(torch.clamp(r, max=32767).to(torch.int16))
        elif master == "fp32":
            hi.copy_(p)  # the new working weights (an alias's p is the weights already)

    return encode
