"""W + s·B·A: a base's weights with LoRA's updates merged in, read like any checkpoint's.

`MergedReader` wraps the reader of the base (a fitgpt checkpoint's or a Hugging Face folder's,
engine/state_io.py's Reader protocol) and adds, to every range it reads of an adapted weight,
that range of s·B·A in fp32: PEFT's merge_and_unload computes the same product
(get_delta_weight: B @ A, then times the scaling) and adds it to the base weight in fp32 before
the weight is rounded to its dtype. Each update is made when its weight is read and dropped
after ([rows, in] fp32 at a time), so merging an 8 B model holds no second copy of it.
"""

from __future__ import annotations

from torch import Tensor

from fitgpt.adapters.lora import param_names
from fitgpt.adapters.targets import Target


class MergedReader:
    """read(chunk, "master", lo, hi) of the base's layout `layout` (its ChunkSpecs): the base's
    values with each target's update added. `tensors`: the adapters' A and B by their names in
    the model (lora.py param_names), fp32."""

    def __init__(
        self, base, layout, targets: list[Target], tensors: dict[str, Tensor], scale: float
    ) -> None:
        self.base, self.layout, self.scale = base, layout, scale
        self.updates: dict[str, list[tuple[Target, Tensor, Tensor]]] = {}
        for t in targets:
            a, b = (tensors[n] for n in param_names(t))
            self.updates.setdefault(t.module + ".weight", []).append((t, a, b))

    def read(self, chunk: int, kind: str, lo: int, hi: int, out: Tensor | None = None) -> Tensor:
        out = self.base.read(chunk, kind, lo, hi, out)
        for s in self.layout[chunk].slots:
            for t, a, b in self.updates.get(s.name, ()):
                cols = s.shape[1]
                first, last = s.offset + t.lo * cols, s.offset + t.hi * cols  # in the chunk
                x, y = max(first, lo), min(last, hi)
                if x < y:
                    update = (b @ a) * self.scale  # [rows, in] fp32, freed after the add
                    out[x - lo : y - lo] += update.reshape(-1)[x - first : y - first]
        return out
