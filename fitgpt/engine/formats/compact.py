"""Compact optimizer state: a chunk's master weights and Adam moments in fewer bytes, stepped in
pieces through fp32 scratch.

Mixed-precision AdamW keeps 16 bytes per parameter; 12 of them are the fp32 master and the two
fp32 moments. A chunk whose plan gives it a compact format (engine/chunked/placement.py:
ChunkPlan.master, ChunkPlan.moments) keeps its state here instead:

  master "split"   the fp32 master is the chunk's bf16 working weight (its high 16 bits, the
                   weight the forward uses anyway) plus an int16 remainder: 2 bytes, not 4.
  master "fp32"    a plain fp32 master (with compact moments only).
  master "alias"   fp32 compute on the state's device: the fp32 working weights are the master
                   (with compact moments only; no master buffer at all).
  moments          fp32, bf16 or block-wise int8 stores (engine/formats/moments.py): 8, 4 or
                   ~2 bytes.

The split is exact except at rounding ties, where the master comes back one fp32 ulp low: about
one element update in 2^17 (engine/formats/split_master.py says why, and why the ties go that way).

The update: per piece of at most PIECE elements (a multiple of the int8 block), the master is
joined from (working weight, remainder) and the moments decoded into fp32 scratch, torch's fused
AdamW kernel (torch._fused_adamw_, the kernel torch.optim.AdamW(fused=True) calls) steps the
piece, and the results are split and encoded back; the new working weights are written to
`out`. Elementwise, so the result equals one fused step over the whole chunk, bit for bit: the
pieces are cut where the kernel's own calls over the param groups end (CompactState._pieces;
tests/test_compact.py checks it against torch.optim.AdamW). The scratch is
four fp32 pieces per device, shared by every compact chunk there (one chunk is stepped at a time
per device: the main thread for the GPU, the host optimizer's worker for host RAM): on the host
4 Mi elements (64 MiB, mostly inside the CPU's caches), on a GPU 16 Mi
(256 MiB: kernel launches stay few). On the host, bf16 and int8 moments (either master) take a
native kernel instead (engine/formats/hostkernel.py: the whole step in one pass per element, no
scratch), on GPU machines by default.

Costs per element and step, over fp32 state: the split master reads and writes 4 bytes instead
of 8 but adds the integer join and split; bf16 moments one cast each way; int8 moments a
block-wise absmax, a rounding and (v) a square root and a square. Measured on the host tier:
benchmarks/parts/host_adamw_formats.py.
"""

from __future__ import annotations

import math
import os
from itertools import pairwise

import torch
from torch import Tensor

from fitgpt.engine.formats import codec, hostkernel
from fitgpt.engine.formats.moments import BLOCK, MomentStore, make_store, store_layout
from fitgpt.engine.formats.speculate import undo_adamw_
from fitgpt.engine.formats.split_master import join_master, split_master

# elements per piece, multiples of BLOCK. Host: 4 Mi (64 MiB of scratch), the fastest on the
# H100 machine's 16 cores for most formats (1 Mi pieces pay each op's thread fan-out 4x as
# often); GPU: 16 Mi (256 MiB), so kernel launches stay few.
PIECE = {"cpu": 1 << 22, "cuda": 1 << 24}
MASTERS = ("alias", "fp32", "split")  # alias: fp32 compute, the weights are the master
# the masters the native host kernel serves, per moment format (engine/formats/hostkernel.py).
# fp32 + int8 was left out while the compiler left its loop scalar (1.76x the fp32 state's time on
# the H100 machine's host, compact_native_h100_2026-11-23); vectorized (host_adamw.cpp: step_range)
# it takes 0.54x on the 2-core CPU box, as split + int8 does
NATIVE_MASTERS = {"bf16": ("split", "fp32"), "int8": ("split", "fp32")}


def piece_elems(device: torch.device) -> int:
    """Elements per piece on `device` (FITGPT_HOST_PIECE overrides the host's, for
    benchmarks/parts/host_adamw_formats.py; a multiple of the int8 block)."""
    if device.type == "cuda":
        return PIECE["cuda"]
    return int(os.environ.get("FITGPT_HOST_PIECE", PIECE["cpu"]))


def upcast_scaled(grad: Tensor, mul: float, out: Tensor) -> None:
    """out = fp32(grad) · mul, in fp32, piece by piece on the host (each piece's two passes stay
    in cache). Upcasting first matters: torch.mul(bf16, float, out=fp32) may round the product
    to bf16 or not depending on which of its vector or scalar loops an element falls in, which
    moves with the thread count and the tensor's length; this way every tier and format, at
    any piece size, scales the gradient identically."""
    P = len(out) if out.device.type == "cuda" else piece_elems(out.device)
    for lo in range(0, len(out), P):
        o = out[lo : lo + P]
        o.copy_(grad[lo : lo + P])
        if mul != 1.0:
            o.mul_(mul)


def state_layout(numel: int, master: str, moments: str, compact: bool) -> dict[str, int]:
    """{name: bytes} of a chunk's optimizer-state tensors, as Chunk.state_tensors() names them
    (the disk tier sizes one file each before anything is allocated)."""
    if not compact:
        return {k: 4 * numel for k in ("master", "exp_avg", "exp_avg_sq")}
    out = {} if master == "alias" else {"master": numel * (2 if master == "split" else 4)}
    for moment in ("exp_avg", "exp_avg_sq"):
        out.update({f"{moment}.{k}": b for k, b in store_layout(moments, numel).items()})
    return out


class Scratch:
    """Four fp32 pieces (master, m, v, gradient) on one device, shared by its compact chunks."""

    def __init__(self, elems: int, device: torch.device) -> None:
        # a multiple of 128 elements, a whole number of CPU vectors (CompactState._pieces): the
        # engine's are PIECE (also whole int8 blocks) or its largest chunk's optimizer range
        assert elems % 128 == 0, elems
        self.elems = elems
        self.bufs = [torch.empty(elems, dtype=torch.float32, device=device) for _ in range(4)]

    def nbytes(self) -> int:
        return 16 * self.elems


class CompactState:
    """One chunk's optimizer state over its optimizer range of `numel` elements on `device`:
    master ("split": an int16 remainder beside the working weights; "fp32") and two moment
    stores; `groups` are the (lo, hi, weight_decay) param groups of that range."""

    def __init__(
        self,
        numel: int,
        master: str,
        moments: str,
        device: torch.device,
        groups: list[tuple[int, int, float]],
        betas: tuple[float, float],
        eps: float,
    ) -> None:
        assert master in MASTERS
        self.numel, self.master, self.moments, self.device = numel, master, moments, device
        self.groups, self.betas, self.eps = groups, betas, eps
        dtype = torch.int16 if master == "split" else torch.float32
        self.master_data = torch.zeros(0 if master == "alias" else numel, dtype=dtype,
                                       device=device)  # fmt: skip
        self.m: MomentStore = make_store(moments, numel, signed=True, device=device)
        self.v: MomentStore = make_store(moments, numel, signed=False, device=device)
        self.step_count = torch.zeros((), dtype=torch.float32, device=device)

    def tensors(self) -> dict[str, Tensor]:
        """Every buffer of the state, by name (the disk tier keeps one file each)."""
        out = {} if self.master == "alias" else {"master": self.master_data}
        out.update({f"exp_avg.{k}": t for k, t in self.m.tensors.items()})
        out.update({f"exp_avg_sq.{k}": t for k, t in self.v.tensors.items()})
        return out

    def master_nbytes(self) -> int:
        return self.master_data.numel() * self.master_data.element_size()

    def moments_nbytes(self) -> int:
        return self.m.nbytes() + self.v.nbytes()

    def _pieces(self, P: int) -> list[tuple[int, int]]:
        """[lo, hi) ranges of at most P elements covering the state, in order.

        fp32 and bf16 moments: cut afresh from the start of each param group, so that every
        kernel call on a piece ends where the fp32 path's one call over the group ends, or a
        multiple of P (a multiple of 128) after its start. Why: torch's CPU kernel computes the
        last numel % 8 (AVX2; 16 with AVX-512) elements of a call in scalar code, which rounds
        differently from its vector code; a call ending anywhere else changes a few elements'
        low bits, whenever a group boundary is not on a multiple of the vector width.
        int8 moments: cut on multiples of P from 0, i.e. on whole blocks (decode and encode work
        on whole blocks); that format is lossy anyway."""
        cuts = {0, self.numel}
        if self.moments != "int8":
            cuts |= {a for a, _, _ in self.groups if 0 < a < self.numel}
        spans = sorted(cuts)
        return [(lo, min(lo + P, b)) for a, b in pairwise(spans) for lo in range(a, b, P)]

    # ---- the step -----------------------------------------------------------------------------
    @torch.no_grad()
    def step(
        self,
        weights: Tensor,
        grad: Tensor,
        grad_mul: float | None,
        lr: float,
        scratch: Scratch,
        undo_mul: float | None = None,
    ) -> None:
        """One AdamW step from `grad` (working dtype, times grad_mul), writing the new working
        weights into `weights` ([numel], working dtype). A split master reads its high half from
        `weights` first: they must hold the weights of the last step (or of the load).
        undo_mul: first undo the last step, which used `grad` times undo_mul (a speculative step,
        engine/formats/speculate.py); then grad_mul=None takes no new step (an overflow)."""
        if undo_mul is None:
            self.step_count += 1
            if grad_mul is not None and self._native_step(weights, grad, grad_mul, lr):
                return
        sp, sm, sv, sg = scratch.bufs
        kern = codec.kernels(self.moments, self.device)
        for lo, hi in self._pieces(scratch.elems):
            k = hi - lo
            # whole pieces of whole blocks only: one compiled shape, no partial int8 block
            fused = kern is not None and k == scratch.elems and k % BLOCK == 0
            p = self._master_in(weights, lo, hi, sp[:k])
            if fused:
                m, v = sm[:k], sv[:k]
                kern[0](*self._stored(lo, hi), m, v)
            else:
                m, v = (
                    self._moment_in(st, lo, hi, s[:k]) for st, s in ((self.m, sm), (self.v, sv))
                )
            g = sg[:k]
            if undo_mul is not None:
                upcast_scaled(grad[lo:hi], undo_mul, g)
                for a, b, wd in self._group_parts(lo, hi):
                    undo_adamw_(p[a:b], g[a:b], m[a:b], v[a:b], self.step_count.item(), lr,
                                self.betas, wd, self.eps)  # fmt: skip
            if grad_mul is not None:
                upcast_scaled(grad[lo:hi], grad_mul, g)
                for a, b, wd in self._group_parts(lo, hi):
                    torch._fused_adamw_(
                        [p[a:b]], [g[a:b]], [m[a:b]], [v[a:b]], [], [self.step_count],
                        lr=lr, beta1=self.betas[0], beta2=self.betas[1], weight_decay=wd,
                        eps=self.eps, amsgrad=False, maximize=False,
                    )  # fmt: skip
            if fused:
                kern[1](m, v, *self._stored(lo, hi))
            else:
                for st, t in ((self.m, m), (self.v, v)):
                    if st.fp32(lo, hi) is None:  # g is spent: int8's quantisation room
                        st.encode(lo, hi, t, work=g)
            self._master_out(p, weights, lo, hi, work=g)  # g is spent: split_master's workspace
        if undo_mul is not None and grad_mul is None:
            self.step_count -= 1

    def _native_step(self, weights: Tensor, grad: Tensor, grad_mul: float, lr: float) -> bool:
        """The whole step in one native pass per element (engine/formats/hostkernel.py), where it
        serves: host state, bf16 weights and gradients, bf16 or int8 moments (NATIVE_MASTERS), the
        usual two param groups. False: not taken."""
        decay = self._decay_split()
        if (
            not self._native_formats()
            or weights.device.type != "cpu"
            or weights.dtype != torch.bfloat16  # the kernel's working weights and gradients
            or grad.dtype != torch.bfloat16  # are bf16 (fp32 compute: the torch path)
            or hostkernel.kernel() is None
        ):
            return False
        t = self.step_count.item()
        b1, b2 = self.betas
        hp = torch.tensor([lr, b1, b2, self.eps, decay[1], 1 - b1**t, math.sqrt(1 - b2**t),
                           grad_mul], dtype=torch.float32)  # fmt: skip
        hostkernel.adamw_(weights, self.master_data, grad, self.m, self.v, decay[0], hp)
        return True

    def _native_formats(self) -> bool:
        """Whether this state's formats, grouping and device take the native kernel (wanted
        here: engine/formats/hostkernel.py), the weights' and gradients' dtypes aside."""
        return (
            self.master in NATIVE_MASTERS.get(self.moments, ())
            and self._decay_split() is not None
            and hostkernel.wanted(self.device)
        )

    def _decay_split(self) -> tuple[int, float] | None:
        """(d, wd): elements [0, d) decay by wd, the rest not at all (a chunk's param groups,
        engine/layout.py: decayed, then not); None for any other grouping."""
        g = self.groups
        if len(g) == 1 and g[0][:2] == (0, self.numel):
            return self.numel, g[0][2]
        if len(g) == 2 and g[0][0] == 0 and g[0][1] == g[1][0] and g[1][1:] == (self.numel, 0.0):
            return g[0][1], g[0][2]
        return None

    def _group_parts(self, lo: int, hi: int) -> list[tuple[int, int, float]]:
        """(a, b, weight_decay) of each param group's part inside piece [lo, hi), as offsets
        into the piece (one kernel call per part: see _pieces)."""
        parts = [(max(a, lo) - lo, min(b, hi) - lo, wd) for a, b, wd in self.groups]
        return [(a, b, wd) for a, b, wd in parts if b > a]

    def _stored(self, lo: int, hi: int) -> tuple[tuple[Tensor, ...], tuple[Tensor, ...]]:
        """A piece of each moment's stored tensors (bf16: the values; int8: q and its scales)."""
        out = []
        for st in (self.m, self.v):
            if st.kind == "int8":
                out.append((st.tensors["q"][lo:hi], st.tensors["scale"][lo // BLOCK : hi // BLOCK]))
            elif st.kind == "bf16":
                out.append((st.tensors["data"][lo:hi],))
            else:
                out.append(())
        return out[0], out[1]

    def warm_up(self, scratch: Scratch) -> None:
        """Build the native kernel (a failed build says so once, here) and compile this format's
        codec kernels now, on the calling thread, the codecs over a full piece of throw-away
        tensors (not the state); a failure falls back to eager."""
        if self._native_formats():
            hostkernel.kernel()
        kern = codec.kernels(self.moments, self.device)
        if kern is None or self.numel < scratch.elems or scratch.elems % BLOCK:
            return  # no piece of this state would take the compiled path
        P = scratch.elems
        twin = CompactState(P, self.master, self.moments, self.device, [(0, P, 0.0)],
                            self.betas, self.eps)  # fmt: skip
        w = torch.zeros(P, dtype=torch.bfloat16)
        try:
            twin.step(w, torch.zeros(P, dtype=torch.bfloat16), 1.0, 0.0, scratch)
        except Exception as e:
            codec.disable(self.moments, e)

    def _master_in(
        self, weights: Tensor, lo: int, hi: int, buf: Tensor, spare: Tensor | None = None
    ) -> Tensor:
        """The fp32 master of [lo, hi): the stored one, the weights (alias), or joined into
        `buf`. `spare` (the scratch's fourth piece): room to bring down working weights that
        live on another device (a host-homed chunk's GPU weights, at checkpoint time)."""
        if self.master == "fp32":
            return self.master_data[lo:hi]
        if self.master == "alias":
            return weights[lo:hi]
        hi_w = weights[lo:hi]
        if hi_w.device.type != self.device.type:
            assert spare is not None, "a split master steps with its weights on its own device"
            hi_w = spare.view(hi_w.dtype)[: hi - lo].copy_(hi_w)  # device → host, synchronous
        join_master(hi_w, self.master_data[lo:hi], buf)
        return buf

    def _moment_in(self, store: MomentStore, lo: int, hi: int, buf: Tensor) -> Tensor:
        direct = store.fp32(lo, hi)
        if direct is not None:
            return direct
        store.decode(lo, hi, buf)
        return buf

    def _master_out(
        self,
        p: Tensor,
        weights: Tensor,
        lo: int,
        hi: int,
        spare: Tensor | None = None,
        work: Tensor | None = None,
    ) -> None:
        """Store the fp32 master `p` of [lo, hi) and write its working weights (`spare` as in
        _master_in: the weights split on the host, then copied up; `work`: split_master's)."""
        if self.master == "alias":
            return  # p is weights[lo:hi] itself, already stepped in place
        if self.master == "fp32":
            weights[lo:hi].copy_(p)  # p is the stored master itself
            return
        if weights.device.type == self.device.type:
            split_master(p, weights[lo:hi], self.master_data[lo:hi], work)
            return
        assert spare is not None, "a split master steps with its weights on its own device"
        tmp = spare.view(weights.dtype)[: hi - lo]
        split_master(p, tmp, self.master_data[lo:hi])
        weights[lo:hi].copy_(tmp)  # host → device, synchronous (loads only)

    # ---- whole-state conversion (initialisation and checkpoints) ------------------------------
    @torch.no_grad()
    def load(
        self, master: Tensor, m: Tensor | None, v: Tensor | None, weights: Tensor, scratch: Scratch
    ) -> None:
        """Set the state from fp32 values (any device, k <= numel elements; the rest zero; m and v
        None: zero) and write the matching working weights into `weights`."""
        sp, sm, sv, sg = scratch.bufs
        k = master.numel()
        for lo, hi in self._pieces(scratch.elems):
            n = hi - lo
            for src, buf, store in ((master, sp, None), (m, sm, self.m), (v, sv, self.v)):
                buf[:n].zero_()
                if src is not None and lo < k:
                    buf[: min(hi, k) - lo].copy_(src[lo : min(hi, k)])
                if store is not None:  # sg is free until _master_out: int8's room
                    store.encode(lo, hi, buf[:n], work=sg[:n])
            if self.master == "alias":
                weights[lo:hi].copy_(sp[:n])
                continue
            if self.master == "fp32":
                self.master_data[lo:hi].copy_(sp[:n])
            self._master_out(sp[:n], weights, lo, hi, sg[:n])

    @torch.no_grad()
    def export(self, weights: Tensor, k: int, scratch: Scratch) -> tuple[Tensor, Tensor, Tensor]:
        """The first k elements of master, m and v as fp32 CPU tensors (12·k bytes of host RAM,
        freed by the caller: checkpoints hold fp32 whatever the format)."""
        out = [torch.empty(k, dtype=torch.float32) for _ in range(3)]
        sp, sm, sv, sg = scratch.bufs
        for lo, hi in self._pieces(scratch.elems):
            if lo >= k:
                break
            n, e = hi - lo, min(hi, k) - lo
            p = self._master_in(weights, lo, hi, sp[:n], sg[:n])
            m, v = (self._moment_in(st, lo, hi, s[:n]) for st, s in ((self.m, sm), (self.v, sv)))
            for dst, src in zip(out, (p, m, v)):
                dst[lo : lo + e].copy_(src[:e])
        return out[0], out[1], out[2]
