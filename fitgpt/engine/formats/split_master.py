"""The split master: an fp32 master weight kept as its bf16 working weight (the high half, the
weight the forward uses anyway) plus an int16 remainder, 2 bytes instead of 4.
engine/formats/compact.py keeps a chunk's split master and steps it piece by piece; these two
functions are its codec.

The split is exact. Write the fp32 master's bits as an integer x = H·2^16 + L (L the low 16
bits). torch's cast to bf16 rounds to nearest even: hi = H when L < 0x8000, H + 1 when
L > 0x8000, and on a tie (L = 0x8000) whichever of the two is even. The remainder r = x - hi·2^16
then lies in [-32768, 32768]; -32768 and every value below 32768 fit in int16 and give x back to
the bit as hi·2^16 + r. The one value that does not fit, +32768, is a tie rounded down to an even
H: it is stored as 32767, so that master comes back one fp32 ulp (2^-23 of its magnitude) lower.
Its bf16 rounding is still H, so the working weight the forward uses is exactly torch's cast
of the master (the same bf16 values as a plain fp32-master run) after every step, and the master
differs from a plain run's only at those ties, about one element update in 2^17, by one ulp.
(Rounding ties away from zero instead would make the master exact, but then the working weight
would differ from torch's cast by one bf16 ulp at every tie; the forward is what users compare.)
"""

from __future__ import annotations

import torch
from torch import Tensor


def split_master(x32: Tensor, hi: Tensor, rem: Tensor, tmp: Tensor | None = None) -> None:
    """hi = x32 cast to bf16 (round to nearest even), rem = the int16 remainder (module doc).
    `tmp`: a 4-byte buffer of x32's size to work in (the step passes its spent gradient piece);
    without it one is allocated for the call."""
    hi.copy_(x32)
    t = torch.empty_like(x32) if tmp is None else tmp.view(torch.float32)
    t.copy_(hi)  # hi's bits in the high half: hi·2^16 as an int32
    r = t.view(torch.int32)
    torch.sub(x32.view(torch.int32), r, out=r)
    r.clamp_(max=32767)  # +32768 (a tie rounded down) is stored one ulp low
    rem.copy_(r)


def join_master(hi: Tensor, rem: Tensor, out32: Tensor) -> None:
    """out32 = the fp32 master that (hi, rem) hold."""
    out32.copy_(hi)  # exact: hi·2^16 as an int32
    out32.view(torch.int32).add_(rem)
