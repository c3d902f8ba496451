"""The optimizer state's storage formats the planner chooses, least compact first.

Three engine fields say how the optimizer state is stored (engine/formats/compact.py,
docs/offload.md): `master` (fp32, or split: the bf16 working weight plus an int16 remainder),
`moments` (the Adam moments of the offloaded blocks, in host RAM or on disk) and `device_moments`
(those of the chunks whose state stays on the GPU), each fp32, bf16 or block-wise int8. A field the
user set is used as set; the planner chooses the fields left "auto": fp32 when some plan fits with
it, else the first rung of LADDER with which one does; and, where that rung's fastest plan offloads
optimizer state, a higher rung whose plan is at least 10% faster, or faster at all where only
the master is split (lossless: plan/planner.py faster; the host AdamW is faster on compact state
than on fp32). Either way only formats in AUTO_FORMATS:
a split master leaves the bf16 weights the forward sees unchanged, and bf16 moments kept the
loss within the seed noise (1.56 B, 1,000 steps), so speed costs no accuracy that room does not
already. Bytes per parameter and the reasons for this order: docs/planner.md.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from fitgpt.engine.chunked.placement import Placement
from fitgpt.engine.config import EngineConfig
from fitgpt.errors import UserError
from fitgpt.plan.fixed import Fixed

FIELDS = ("master", "moments", "device_moments")
Formats = tuple[str, str, str]  # (master, moments of offloaded blocks, moments on the device)

# The compact formats the planner may choose by itself, for room or for speed: only those whose
# loss cost was measured within the run-to-run noise (benchmarks/results/compact_h100_2026-11-23/:
# 1.56 B, 1,000 steps of real text on the H100; validation loss, mean |Δ| over the second half
# against fp32 state: split + bf16 moments 0.023, a second seed of fp32 0.023; split + int8
# moments +0.09..0.15 at every evaluation to step 600, several times the noise). int8 stays
# available by its flag.
AUTO_FORMATS = ("split", "bf16")

# Least compact first; each rung saves more bytes per parameter than the one before it. The split
# master is lossless (within engine/formats/split_master.py's one-ulp ties), so it comes first; the
# offloaded blocks' moments before the device's, because they are most of the parameters of a model
# that needs the room and because host RAM and the disk, not the GPU, run out first once the GPU is
# filled by offloading blocks.
LADDER: tuple[Formats, ...] = (
    ("fp32", "fp32", "fp32"),
    ("split", "fp32", "fp32"),
    ("split", "bf16", "fp32"),
    ("split", "bf16", "bf16"),
    ("split", "int8", "bf16"),
    ("split", "int8", "int8"),
)


# Each field's formats, least compact first (every field climbs the ladder in this order).
ORDER = {"master": ("fp32", "split"), "moments": ("fp32", "bf16", "int8")}


def allowed(name: str, value: str, split_ok: bool) -> str:
    """`value` for an auto field, or the most compact format below it the planner may use."""
    order = ORDER["master" if name == "master" else "moments"]
    ok = [f for f in order[: order.index(value) + 1] if f == "fp32" or f in AUTO_FORMATS]
    ok = [f for f in ok if f != "split" or split_ok]
    return ok[-1]


def rungs(fixed: Fixed | Mapping[str, Any], precision: str) -> list[Formats]:
    """The ladder as this run may climb it: the fields the user fixed as fixed; the rest from
    each rung, a format outside AUTO_FORMATS replaced by the most compact one below it; repeats
    dropped. A split master shares its high half with bf16 working weights: under fp32 compute
    the master is the weights (or plain fp32 for offloaded chunks), and fp16 refuses it, so
    there it stays fp32."""
    split_ok = precision == "bf16"
    fixed = Fixed.of(fixed)
    out: list[Formats] = []
    for rung in LADDER:
        a, b, c = (
            allowed(name, value, split_ok) if fixed.format(name) == "auto" else fixed.format(name)
            for name, value in zip(FIELDS, rung)
        )
        if (a, b, c) not in out:
            out.append((a, b, c))
    return out


def lossless(fmt: Formats, than: Formats) -> bool:
    """Whether state in `fmt` trains as state in `than` does: the same moments (or fp32, or
    none) on each tier, the master fp32 or split (engine/formats/split_master.py: exact but for
    one-ulp ties)."""
    return all(f in ("fp32", "-", t) for f, t in zip(fmt[1:], than[1:]))


def with_formats(e: EngineConfig, fmt: Formats) -> EngineConfig | None:
    """`e` storing its state in `fmt`; None where the engine cannot (ddp keeps torch's fp32)."""
    try:
        return dataclasses.replace(e, **dict(zip(FIELDS, fmt)))
    except UserError:
        return None


def in_effect(placement: Placement) -> Formats:
    """The formats a plan really stores its state in: "-" for a tier that holds no chunk (the
    plain engine's placement: fp32 on the device, nothing offloaded)."""
    master = "split" if any(c.master == "split" for c in placement.chunks) else "fp32"
    off = {c.moments for c in placement.chunks if c.offloaded}
    dev = {c.moments for c in placement.chunks if not c.offloaded}
    return (master, "/".join(sorted(off)) or "-", "/".join(sorted(dev)) or "-")


def settled(e: EngineConfig, placement: Placement) -> EngineConfig:
    """`e` with every format for a tier the plan leaves empty set back to fp32 (nothing is
    stored in it: the name and the flags then say only what is used). Also a format the user
    fixed: `--moments int8` under --plan auto asks for int8 where the plan offloads;
    a plan that offloads nothing keeps no moments in it, and its flags, run with --plan off,
    would be refused as a flag that changes nothing (plan/validate.py)."""
    used = in_effect(placement)
    changes = {}
    for name, value in zip(FIELDS, used):
        if getattr(e, name) != "fp32" and value in ("-", "fp32"):
            changes[name] = "fp32"
    return dataclasses.replace(e, **changes) if changes else e


def label(fmt: Formats) -> str:
    """ ", split master, bf16 moments" for a name; empty when everything is fp32."""
    master, off, dev = fmt
    if all(f in ("fp32", "-") for f in fmt):
        return ""
    parts = ["split master"] if master == "split" else []
    if off in ("-", dev) or dev == "-":
        moments = dev if off == "-" else off
        if moments != "fp32":
            parts.append(f"{moments} moments")
    else:
        parts.append(f"{off} moments offloaded, {dev} on the GPU")
    return ", " + ", ".join(parts)


def short(fmt: Formats) -> str:
    """The table's column: master/offloaded moments/device moments, e.g. split/bf16/fp32."""
    return "/".join(fmt)
