"""MXFP4, the format transformers stores gpt-oss's experts in (config.json's
quantization_config, quant_method "mxfp4"): the OCP Microscaling format's 4-bit E2M1 values, a
shared power-of-two scale (E8M0) per block of 32. A parameter `name` that transformers computes
with as [E, I, O] (x @ W: an expert's input rows, output columns) is stored as

  name_blocks  uint8 [E, O, I/32, 16]: 32 values a block, two a byte, the low nibble first
  name_scales  uint8 [E, O, I/32]: block b of packed row o times 2^(scale - 127)

so a packed row is one of the parameter's columns: dequantizing transposes the last two
dimensions, as transformers' convert_moe_packed_tensors does (integrations/mxfp4.py, which
tests/test_gpt_oss.py holds this module equal to). A scale of 255 (MX's NaN) makes values
infinite or NaN, as torch.ldexp computes 2^128; the reader refuses them (hf_read.py).

Cost: the whole of a read's values in fp32 (4 bytes a value, 8 times the packed bytes) and
index tensors as large as its blocks; hf_read.py reads an expert's rows at a time, so this
is the transient of one expert (66 MB for gpt-oss-120b's gate_up).
"""

from __future__ import annotations

import torch
from torch import Tensor

BLOCK = 32  # values per scale
BLOCKS, SCALES = "_blocks", "_scales"  # the stored tensors' suffixes


def e2m1_values() -> Tensor:
    """[16] fp32: the value of each 4-bit code. Bit 3 is the sign, bits 2-1 the exponent e,
    bit 0 the mantissa m: m/2 when e = 0 (0 and 0.5), else 2^(e-1)·(1 + m/2), up to 6; no inf
    or NaN. Code 8 is -0."""
    values = []
    for code in range(16):
        e, m = (code >> 1) & 3, code & 1
        magnitude = m / 2 if e == 0 else 2.0 ** (e - 1) * (1 + m / 2)
        values.append(-magnitude if code & 8 else magnitude)
    return torch.tensor(values, dtype=torch.float32)


def packed_shapes(shape: tuple[int, ...]) -> tuple[tuple[int, ...], tuple[int, ...]] | None:
    """The shapes of the blocks and scales of a parameter of `shape` [E, I, O]; None when I is
    not a whole number of blocks (no MXFP4 tensor can hold it)."""
    *lead, i, o = shape
    if i % BLOCK:
        return None
    return (*lead, o, i // BLOCK, BLOCK // 2), (*lead, o, i // BLOCK)


def dequantize(blocks: Tensor, scales: Tensor, dtype: torch.dtype = torch.float32) -> Tensor:
    """[..., G·32] in `dtype` from blocks [..., G, 16] and scales [..., G], both uint8, in the
    stored order (not transposed). Every value is exact in fp32 and bf16 but at the extreme
    scales (a value times 2^-127 may be subnormal; 255 overflows)."""
    table = e2m1_values().to(blocks.device)
    low, high = table[(blocks & 0x0F).int()], table[(blocks >> 4).int()]
    values = torch.stack((low, high), dim=-1).flatten(-2)  # [..., G, 32]: low, high, low, ...
    values = torch.ldexp(values, scales.to(torch.int32).unsqueeze(-1) - 127)
    return values.flatten(-2).to(dtype)


def dequantize_param(blocks: Tensor, scales: Tensor, dtype: torch.dtype = torch.float32) -> Tensor:
    """The parameter [E, I, O] that blocks [E, O, I/32, 16] and scales [E, O, I/32] hold."""
    return dequantize(blocks, scales, dtype).transpose(-2, -1)
