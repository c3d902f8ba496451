"""The frozen base's formats (--base-format): how one block's weights are held, packed into one
flat byte buffer, and unpacked into the working dtype when the block runs.

  fp32   4 bytes per parameter, as trained.
  bf16   2 bytes per parameter: the weights rounded once, at load.
  int8   the matrices per-row absmax int8 (bitsandbytes' int8_vectorwise_quant: q = round(127·w
         / max|row|), w ≈ q·max|row|/127), one fp32 scale per row: 1 + 4/in bytes per
         parameter; vectors (norm gains, biases) in bf16. Quantised from the weights in fp16,
         as bitsandbytes quantises its LLM.int8 weights (its CUDA kernel takes fp16 alone).
  nf4    QLoRA's NormalFloat4 with double quantisation, bitsandbytes' own (quantize_4bit,
         quant_type="nf4", blocksize 64, compress_statistics=True): two 4-bit codes a byte, one
         8-bit absmax per 64 weights, those absmaxes 8-bit-quantised again in blocks of 256 with
         one fp32 scale each and one fp32 offset per tensor: 0.5 + 1/64 + 4/16384 bytes per
         parameter (0.516); vectors in bf16. The bytes are bitsandbytes' bytes, so a tensor
         quantised here or by bitsandbytes (transformers' BitsAndBytesConfig(load_in_4bit,
         bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant)) dequantises to the same values.

Why bitsandbytes (a declared dependency, requirements-dev.txt and pyproject.toml): NF4 must
equal its bytes, and torchao's NF4 does not (torchao 0.18 to_nf4(w, 64, 256) against
quantize_4bit on one 2048² bf16 matrix: 36% of the dequantised values differ, by up to 1.2;
its scales are double-quantised another way). It is also the faster on this CPU (quantise 0.39 s
against torchao's 1.2 s; dequantise 2 ms against 104 ms), and on CUDA its quantise and
dequantise are single kernels (torchao's NF4 is torch ops). Quantising runs where the engine
computes (the GPU on CUDA runs), once per block at load; dequantising once per block per use.

Unpacking writes the block's weights, in the working dtype, into a flat buffer laid out as the
block's ChunkSpec lays out its parameters, so the model's parameters are views of it. Where the
held dtype is the working dtype (fp32 held, fp32 compute; bf16 held, bf16 compute) the packed
bytes are that buffer already (`direct`): nothing is unpacked.

Shape legend: n a tensor's elements, rows its first dimension.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
from torch import Tensor

from fitgpt.adapters.config import BASE_FORMATS
from fitgpt.engine.layout import ChunkSpec
from fitgpt.errors import UserError

FORMATS = BASE_FORMATS
NF4_BLOCK, NF4_STATS_BLOCK = 64, 256  # QLoRA's: 64 weights an absmax, 256 absmaxes a scale
ALIGN = 16  # bytes: every region starts aligned, so fp32 views of the byte buffer are legal


def _bnb():
    """bitsandbytes' functional API, or one line saying how to get it."""
    # on a CPU box bitsandbytes logs a warning that an optional kernel package is missing at
    # import; its own torch code is what then runs (and what the tests compare against)
    logging.getLogger("bitsandbytes.backends.cpu.ops").setLevel(logging.ERROR)
    try:
        import bitsandbytes.functional as bnbf
    except ImportError as e:  # pragma: no cover - a declared dependency; `make` installs it
        raise UserError(
            f"--base-format int8/nf4 needs bitsandbytes ({e}): run `make` or "
            "`pip install bitsandbytes`"
        ) from None
    return bnbf


def is_direct(fmt: str, working: torch.dtype) -> bool:
    """Whether a block held in `fmt` is its working weights already (nothing to unpack)."""
    return (fmt, working) in (("fp32", torch.float32), ("bf16", torch.bfloat16))


def bytes_per_param(fmt: str, in_features: int = 4096) -> float:
    """A matrix's bytes per parameter held in `fmt` (the planner's price: plan/adapter.py)."""
    return {
        "fp32": 4.0,
        "bf16": 2.0,
        "int8": 1.0 + 4.0 / in_features,
        "nf4": 0.5 + 1 / NF4_BLOCK + 4 / (NF4_BLOCK * NF4_STATS_BLOCK),
    }[fmt]


def _up(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(frozen=True)
class Region:
    """One slot's bytes in the packed buffer: `parts` are (name, byte offset, bytes)."""

    slot: int
    kind: str  # "float" (the format's float dtype), "int8" or "nf4"
    parts: tuple[tuple[str, int, int], ...]


class BlockCodec:
    """One chunk's parameters in `fmt`, unpacked to `working` (the compute dtype)."""

    def __init__(self, spec: ChunkSpec, fmt: str, working: torch.dtype) -> None:
        if fmt not in FORMATS:
            raise UserError(f"--base-format {fmt!r}: use one of {', '.join(FORMATS)}")
        self.spec, self.fmt, self.working = spec, fmt, working
        self.held = torch.float32 if fmt == "fp32" else torch.bfloat16  # vectors, and fp32/bf16
        self.direct = is_direct(fmt, working)
        self.regions, self.nbytes = self._lay_out()

    def _lay_out(self) -> tuple[list[Region], int]:
        if self.direct:  # the working buffer itself: slot offsets as the ChunkSpec's
            size = self.held.itemsize
            regions = [
                Region(i, "float", (("w", s.offset * size, s.numel * size),))
                for i, s in enumerate(self.spec.slots)
            ]
            return regions, _up(self.spec.numel * size)
        at, regions = 0, []
        for i, s in enumerate(self.spec.slots):
            kind = self.fmt if self.fmt in ("int8", "nf4") and len(s.shape) >= 2 else "float"
            if kind == "nf4":
                blocks = _cdiv(s.numel, NF4_BLOCK)
                sizes = [
                    ("codes", _cdiv(s.numel, 2)),
                    ("absmax", blocks),
                    ("scales", 4 * _cdiv(blocks, NF4_STATS_BLOCK)),
                    ("offset", 4),
                ]
            elif kind == "int8":
                sizes = [("codes", s.numel), ("scales", 4 * s.shape[0])]
            else:
                sizes = [("w", s.numel * self.held.itemsize)]
            parts = []
            for name, n in sizes:
                parts.append((name, at, n))
                at = _up(at + n)
            regions.append(Region(i, kind, tuple(parts)))
        return regions, at

    # ---- packing: once per block, at load ----------------------------------------------------
    @torch.no_grad()
    def pack(self, flat: Tensor, out: Tensor) -> None:
        """The chunk's fp32 weights `flat` [n] (on the device that quantises) into `out`, a
        uint8 buffer of `nbytes` on the same device."""
        for r in self.regions:
            s = self.spec.slots[r.slot]
            w = flat[s.offset : s.offset + s.numel].view(s.shape)
            got = self._quantise(r.kind, w)
            for (_, at, n), t in zip(r.parts, got):
                out[at : at + n].copy_(t.reshape(-1).view(torch.uint8))

    def _quantise(self, kind: str, w: Tensor) -> list[Tensor]:
        if kind == "float":
            return [w.to(self.held).contiguous()]
        bnbf = _bnb()
        if kind == "int8":  # from fp16, as bitsandbytes' int8 weights (its CUDA kernel's input)
            codes, scales, _ = bnbf.int8_vectorwise_quant(w.half().reshape(w.shape[0], -1))
            return [codes, scales]
        codes, st = bnbf.quantize_4bit(
            w.float().contiguous(), blocksize=NF4_BLOCK, compress_statistics=True, quant_type="nf4"
        )
        return [codes, st.absmax, st.state2.absmax, st.offset.reshape(1).float()]

    # ---- unpacking: once per block per use ---------------------------------------------------
    @torch.no_grad()
    def unpack(self, buf: Tensor, out: Tensor) -> None:
        """Packed `buf` (uint8, on the compute device) into `out` [n] of the working dtype."""
        for r in self.regions:
            s = self.spec.slots[r.slot]
            dst = out[s.offset : s.offset + s.numel].view(s.shape)
            part = {name: buf[at : at + n] for name, at, n in r.parts}
            if r.kind == "float":
                dst.copy_(part["w"].view(self.held).view(s.shape))
            elif r.kind == "int8":
                bnbf = _bnb()
                codes = part["codes"].view(torch.int8).view(s.shape[0], -1)
                dst.copy_(bnbf.int8_vectorwise_dequant(codes, part["scales"].view(torch.float32))
                          .view(s.shape))  # fmt: skip
            else:
                dst.copy_(self._nf4(part, s.shape, s.numel, buf.device))

    def _nf4(self, part: dict[str, Tensor], shape, n: int, device) -> Tensor:
        bnbf = _bnb()
        stats = bnbf.QuantState(
            absmax=part["scales"].view(torch.float32),
            code=_code("dynamic", device),
            blocksize=NF4_STATS_BLOCK,
            dtype=torch.float32,
        )
        st = bnbf.QuantState(
            absmax=part["absmax"],
            shape=torch.Size(shape),
            code=_code("nf4", device),
            blocksize=NF4_BLOCK,
            quant_type="nf4",
            dtype=self.working,
            offset=part["offset"].view(torch.float32).reshape(()),
            state2=stats,
        )
        return bnbf.dequantize_4bit(part["codes"].view(-1, 1), st)


_CODES: dict[tuple[str, str], Tensor] = {}


def _code(which: str, device: torch.device) -> Tensor:
    """bitsandbytes' code tables (NF4's 16 values; the 8-bit dynamic map of the double
    quantisation), made once per device."""
    key = (which, str(device))
    if key not in _CODES:
        bnbf = _bnb()
        code = (
            bnbf.get_4bit_type("nf4", device="cpu")
            if which == "nf4"
            else bnbf.create_dynamic_map(signed=True)
        )
        _CODES[key] = code.to(device)
    return _CODES[key]


def base_format(adapter, precision: str) -> str:
    """The base's format: --base-format, or for auto bf16 under bf16/fp16 compute (half the
    bytes of fp32, what the blocks compute in anyway) and fp32 under fp32 (the CPU's runs: the
    base exactly as read). The planner resolves it with this (plan/adapter.py); an engine built
    directly with auto resolves it the same way."""
    if adapter.base_format != "auto":
        return adapter.base_format
    return "fp32" if precision == "fp32" else "bf16"


def packed_base(adapter, precision: str) -> bool:
    """Whether an adapter run's base is held block by block (engine/chunked/frozen.py): in a
    format other than fp32, or with blocks in host RAM. An fp32 base on the device is the ddp
    engine's own fp32 parameters, as before."""
    return base_format(adapter, precision) != "fp32" or bool(adapter.base_host_blocks)
