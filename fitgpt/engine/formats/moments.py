"""Storage formats for Adam's two moments, smaller than fp32, so more optimizer state fits.

Why: mixed-precision AdamW holds 16 bytes per parameter — fp32 master 4, exp_avg m 4, exp_avg_sq
v 4, bf16 weight 2, bf16 gradient 2 — and the moments are half of it. Keeping m and v in a
smaller format between steps, on any tier (GPU, host RAM, disk), lowers their 8 bytes per
parameter:

  kind   bytes/param (m + v)   format
  fp32   8                     plain fp32 (the engine keeps these as plain tensors)
  bf16   4                     bf16, round-to-nearest-even on encode (torch's cast)
  int8   2.004                 1 byte per element plus one fp32 scale per block of BLOCK elements:
                               m as int8 with symmetric absmax, v as uint8 of sqrt(v) (see below)

How the engine uses a store (engine/formats/compact.py): piece by piece, it decodes m and v into
fp32 scratch, runs torch's fused AdamW kernel on the scratch, and encodes them back. The math of the
step is unchanged; only the rounding between steps differs.

Cost: one decode and one encode pass over both moments per step, on top of AdamW's own traffic
(bf16: read 2 + write 4, then read 4 + write 2 bytes per moment element; int8 also a square root
and a rounding pass; on the host int8 goes through compiled kernels, engine/formats/codec.py). The
planner uses bf16 where fp32 state does not fit (its loss cost at 1.56 B was within the seed
noise); int8 only when asked for (4-5x that noise): benchmarks/results/compact_h100_2026-11-23.

A known limit of both narrow formats: with round-to-nearest, a moment whose per-step change is
below half a quantisation step does not change at all. bf16 keeps 8 significant bits, so v·β2
rounds back to v once 1 - β2 is below 2^-9..2^-8. Measured, a v without gradients for 200 steps:
at β2 = 0.999 it keeps 99.8% of its value instead of decaying to 82%, at 0.99 it ends 12% high,
at fitgpt's default 0.95 it tracks fp32. int8 has the same effect on elements a few steps above
zero (their block's scale still decays with the block's largest element). Prefer fp32 moments
for β2 close to 1.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch
from torch import Tensor

from fitgpt.errors import UserError

FORMATS = ("fp32", "bf16", "int8")  # how a moment is stored (state_io.KINDS: which state)

# int8: elements sharing one fp32 scale. Each scale costs 4/2048 ≈ 0.002 bytes per element; a
# smaller block tracks the local magnitude more closely (less error) but costs more scales.
BLOCK = 2048

# int8 encode and decode work on WORK elements at a time (a multiple of BLOCK). Its fp32
# temporary is then WORK·4 = 4 MiB whatever the chunk's size, and one pass's source, temporary and
# bytes (~9 MiB) stay in L3 cache across the pass's 4-5 elementwise ops. Measured on 2 cores,
# encode+decode of m: 0.4 G elements/s at 2^24 (a fresh 64 MiB temporary is page-faulted in
# every pass and every op goes to DRAM), 1.3 G/s at 2^20, 0.9 G/s at 2^18 (per-op overhead).
# On a GPU the cache argument does not hold and each op is a kernel launch (~5 us): 1 Mi-element
# passes made a 1.56 B model's int8 moments cost ~70 k launches per step, 0.5 s of the H100's
# 0.87 s step (benchmarks/results/compact_h100_2026-11-23/loss). GPU passes take the whole range
# asked for (the device's compact pieces, engine/formats/compact.py: 16 Mi elements).
WORK = 1 << 20


def bytes_per_param(kind: str) -> float:
    """Bytes per parameter that the two moments (m and v) take in `kind`, for the planner."""
    _check_kind(kind)
    return {"fp32": 8.0, "bf16": 4.0, "int8": 2 * (1 + 4 / BLOCK)}[kind]


def store_nbytes(kind: str, numel: int) -> int:
    """Exact bytes of one moment store of `numel` values (the memory model's figure)."""
    _check_kind(kind)
    if kind == "int8":
        nblocks = -(-numel // BLOCK)
        return nblocks * BLOCK + 4 * nblocks
    return numel * (4 if kind == "fp32" else 2)


def store_layout(kind: str, numel: int) -> dict[str, int]:
    """The tensors of one store of `kind` over `numel` values: {name: bytes}."""
    _check_kind(kind)
    if kind == "int8":
        nblocks = -(-numel // BLOCK)
        return {"q": nblocks * BLOCK, "scale": 4 * nblocks}
    return {"data": numel * (4 if kind == "fp32" else 2)}


def make_store(
    kind: str, numel: int, signed: bool, device: torch.device | str = "cpu"
) -> MomentStore:
    """A zero-filled store of `numel` moment values; signed=True for m, False for v (v >= 0)."""
    _check_kind(kind)
    cls = {"fp32": Fp32Store, "bf16": Bf16Store, "int8": Int8Store}[kind]
    return cls(numel, signed, torch.device(device))


def _check_kind(kind: str) -> None:
    if kind not in FORMATS:
        raise UserError(f"moment format {kind!r} is unknown: choose one of {', '.join(FORMATS)}")


class MomentStore(ABC):
    """One moment (m or v) of a flat buffer of `numel` elements, in some storage format.

    decode / encode convert elements [lo, hi) to and from an fp32 tensor of hi - lo elements
    (lo a multiple of BLOCK, so int8 blocks are never split); the optimizer steps a chunk one
    such piece at a time (engine/formats/compact.py). Checkpoints hold the decoded fp32 values, so a
    store needs no state_dict of its own.
    """

    kind = ""

    def __init__(self, numel: int, signed: bool, device: torch.device) -> None:
        self.numel, self.signed, self.device = numel, signed, device
        self.tensors: dict[str, Tensor] = {}

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors.values())

    def fp32(self, lo: int, hi: int) -> Tensor | None:
        """The stored values themselves when they are fp32 (no copy), else None."""
        return None

    @abstractmethod
    def decode(self, lo: int, hi: int, out: Tensor) -> None:
        """Write stored elements [lo, hi), as fp32, into `out` (hi - lo elements)."""

    @abstractmethod
    def encode(self, lo: int, hi: int, src: Tensor, work: Tensor | None = None) -> None:
        """Store the fp32 values of `src` as elements [lo, hi). `work`: fp32 room of at least
        hi - lo elements that the store may overwrite (int8's quantisation temporary; without
        it the store allocates one per pass)."""

    def decode_into(self, out: Tensor) -> None:
        self.decode(0, self.numel, out)

    def encode_from(self, src: Tensor) -> None:
        self.encode(0, self.numel, src)

    def _check(self, lo: int, hi: int, t: Tensor) -> None:
        if t.dtype != torch.float32 or t.shape != (hi - lo,) or not 0 <= lo <= hi <= self.numel:
            raise ValueError(f"expected fp32 [{hi - lo}] in [0, {self.numel}], got {t.dtype} "
                             f"{list(t.shape)} for [{lo}, {hi})")  # fmt: skip


class Fp32Store(MomentStore):
    """Plain fp32: the optimizer steps the stored values in place (fp32() hands them over)."""

    kind = "fp32"

    def __init__(self, numel: int, signed: bool, device: torch.device) -> None:
        super().__init__(numel, signed, device)
        self.tensors["data"] = torch.zeros(numel, dtype=torch.float32, device=device)

    def fp32(self, lo: int, hi: int) -> Tensor | None:
        return self.tensors["data"][lo:hi]

    def decode(self, lo: int, hi: int, out: Tensor) -> None:
        self._check(lo, hi, out)
        out.copy_(self.tensors["data"][lo:hi])

    def encode(self, lo: int, hi: int, src: Tensor, work: Tensor | None = None) -> None:
        self._check(lo, hi, src)
        self.tensors["data"][lo:hi].copy_(src)


class Bf16Store(MomentStore):
    """bf16, rounded to nearest even on encode (relative error at most 2^-8).

    For v: bf16 keeps fp32's 8-bit exponent, so it spans 1e-38..3e38 like fp32 and a v of
    g² ~ 1e-16 stays a normal number (fp16, smallest normal 6e-5, would flush it to zero and turn
    the update m/(sqrt(v)+eps) into m/eps). The price is 7 mantissa bits: each encode rounds v
    by up to 2^-8 of itself, i.e. sqrt(v) in the denominator by up to ~2^-9.
    """

    kind = "bf16"

    def __init__(self, numel: int, signed: bool, device: torch.device) -> None:
        super().__init__(numel, signed, device)
        self.tensors["data"] = torch.zeros(numel, dtype=torch.bfloat16, device=device)

    def decode(self, lo: int, hi: int, out: Tensor) -> None:
        self._check(lo, hi, out)
        out.copy_(self.tensors["data"][lo:hi])  # exact: every bf16 is an fp32

    def encode(self, lo: int, hi: int, src: Tensor, work: Tensor | None = None) -> None:
        self._check(lo, hi, src)
        self.tensors["data"][lo:hi].copy_(src)  # round to nearest even


class Int8Store(MomentStore):
    """Block-wise absmax quantisation: one byte per element, one fp32 scale per BLOCK elements.

    m (signed): q = round(x·127/absmax) in int8 [-127, 127], x ≈ q·scale with scale = absmax/127;
    the error is at most scale/2 of the block's absmax, 1/254 of it.
    v (unsigned): the stored quantity is r = sqrt(v), as uint8 [0, 255] with scale = max(r)/255,
    and decode squares q·scale back. The square root halves v's dynamic range in log terms, so
    a v falls into the bottom bucket (q = 0) only below max(v)/255²/4 of its block instead of
    below max(v)/510 as with v itself in uint8. The error in v is at most sqrt(v)·scale + scale²/4.

    The bottom bucket of v decodes to its top, (scale/2)², not to 0 (an all-zero block still
    decodes to 0). m is quantised linearly and survives down to 1/254 of its block's largest |m|;
    in a block whose largest |m| is well below its largest sqrt(v) (noisy gradients, the usual
    case), an element can keep a non-zero m while its v rounds to 0. With a zero gradient at
    that step (an embedding row absent from the batch) AdamW's update would be m/eps: measured,
    900·lr instead of 0.55·lr. Decoding the bucket's top bounds the update by ~m/(scale/2),
    i.e. about lr like any Adam step, and only ever shrinks the steps of those elements.

    Storage is padded to whole blocks (at most BLOCK-1 spare bytes): q [nblocks·BLOCK] and
    scale [nblocks], viewed as q_RB [nblocks, BLOCK] where R indexes blocks and B elements.
    """

    kind = "int8"

    def __init__(self, numel: int, signed: bool, device: torch.device) -> None:
        super().__init__(numel, signed, device)
        nblocks = -(-numel // BLOCK)
        dtype = torch.int8 if signed else torch.uint8
        self.qmax = 127.0 if signed else 255.0
        self.tensors["q"] = torch.zeros(nblocks * BLOCK, dtype=dtype, device=device)
        self.tensors["scale"] = torch.zeros(nblocks, dtype=torch.float32, device=device)

    def decode(self, lo: int, hi: int, out: Tensor) -> None:
        self._check(lo, hi, out)
        for a, b in self._passes(lo, hi):
            full = (b - a) // BLOCK * BLOCK
            if full:
                self._decode_rows(a, full, out[a - lo : a - lo + full].view(-1, BLOCK))
            if a + full < b:  # the last, partial block: decode whole into a small temporary
                row = torch.empty(1, BLOCK, dtype=torch.float32, device=self.device)
                self._decode_rows(a + full, BLOCK, row)
                out[a - lo + full : b - lo].copy_(row[0, : b - a - full])

    def encode(self, lo: int, hi: int, src: Tensor, work: Tensor | None = None) -> None:
        self._check(lo, hi, src)
        if work is not None and (work.dtype != torch.float32 or work.numel() < hi - lo):
            raise ValueError(f"int8 moments: work room {work.dtype} [{work.numel()}] < {hi - lo}")
        for a, b in self._passes(lo, hi):
            full = (b - a) // BLOCK * BLOCK
            if full:
                t = None if work is None else work[a - lo : a - lo + full].view(-1, BLOCK)
                self._encode_rows(a, full, src[a - lo : a - lo + full].view(-1, BLOCK), t)
            if a + full < b:  # the last, partial block: zero-padded, zeros leave absmax alone
                row = torch.zeros(1, BLOCK, dtype=torch.float32, device=self.device)
                row[0, : b - a - full].copy_(src[a - lo + full : b - lo])
                self._encode_rows(a + full, BLOCK, row)

    def _passes(self, lo: int, hi: int) -> list[tuple[int, int]]:
        """[a, b) ranges covering [lo, hi), of at most WORK elements on the host, whole on a GPU;
        every a on a block boundary (a partial block only at the end of the store)."""
        if lo % BLOCK or (hi % BLOCK and hi != self.numel):
            raise ValueError(f"int8 moments: [{lo}, {hi}) splits a block of {BLOCK}")
        work = WORK if self.device.type == "cpu" else max(hi - lo, 1)
        return [(a, min(a + work, hi)) for a in range(lo, hi, work)]

    def _rows(self, lo: int, n: int) -> tuple[Tensor, Tensor]:
        """The storage of elements [lo, lo+n) as q_RB and scale_R (lo, n multiples of BLOCK)."""
        q_RB = self.tensors["q"][lo : lo + n].view(-1, BLOCK)
        return q_RB, self.tensors["scale"][lo // BLOCK : (lo + n) // BLOCK]

    def _decode_rows(self, lo: int, n: int, out_RB: Tensor) -> None:
        q_RB, scale_R = self._rows(lo, n)
        # cast, then scale in place: ~6x faster on the CPU than one mixed-dtype int8 · fp32 mul
        out_RB.copy_(q_RB)
        out_RB.mul_(scale_R[:, None])
        if not self.signed:
            # q = 0 decodes to the top of its bucket, scale/2 (class docstring: no m/eps steps);
            # q >= 1 is already above it
            torch.maximum(out_RB, scale_R[:, None] / 2, out=out_RB)
            out_RB.square_()  # back from sqrt(v) to v

    def _encode_rows(self, lo: int, n: int, x_RB: Tensor, t_RB: Tensor | None = None) -> None:
        q_RB, scale_R = self._rows(lo, n)
        # the fp32 temporary of this pass: the caller's room, else a fresh one (on the host at
        # most WORK elements, 4 MiB), freed on return
        t_RB = torch.empty_like(x_RB) if t_RB is None else t_RB
        if self.signed:
            # max(max x, -min x): no |x| temporary; two reductions beat torch.aminmax(dim=1) ~7x
            amax_R = torch.maximum(x_RB.amax(dim=1), x_RB.amin(dim=1).neg_())
            torch.mul(x_RB, self._inverse(amax_R)[:, None], out=t_RB)
        else:
            torch.sqrt(x_RB, out=t_RB)
            amax_R = t_RB.amax(dim=1)
            t_RB.mul_(self._inverse(amax_R)[:, None])
        # |t| <= qmax up to one fp32 rounding of the product, which round() absorbs: no clamp
        t_RB.round_()  # half to even
        q_RB.copy_(t_RB)  # exact: t holds integers in range
        torch.div(amax_R, self.qmax, out=scale_R)

    def _inverse(self, amax_R: Tensor) -> Tensor:
        """qmax/amax per block; 0 for an all-zero block, which then encodes as zeros."""
        return torch.where(amax_R > 0, self.qmax / amax_R, torch.zeros_like(amax_R))
