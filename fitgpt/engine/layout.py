"""How a model's parameters are grouped into chunks and laid out in flat buffers.

A chunk is the unit of placement, communication and checkpointing: the embedding chunk (every
child of the model before `blocks`), one chunk per transformer block, and the head chunk (every
child after `blocks`). A sparse block of a mixture of experts is two chunks: `block.i` (attention,
norms, router) and `block.i.experts` (every expert's weights, `blocks.i.mlp.experts.*`), so the
experts are placed, reduced (over their own group under expert parallelism) and checkpointed as
a unit of their own. Inside a chunk, parameters sit back to back in a fixed order, the
weight-decayed ones (matrices and embeddings) first, so the decayed part of any range of the
flat buffer is one contiguous run. The layout depends only on the model, never on the world
size or the placement, which is what lets a checkpoint saved one way be loaded another.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from torch import nn

from fitgpt.model import Split


@dataclass(frozen=True)
class ParamSlot:
    name: str
    shape: tuple[int, ...]
    offset: int  # first element inside the chunk's flat buffer
    numel: int
    # how tensor parallelism cuts it (the model family's rule, read once here); None: replicated.
    # Not part of a checkpoint's record, nor of a layout's identity.
    split: Split | None = field(default=None, compare=False)


@dataclass(frozen=True)
class ChunkSpec:
    index: int
    name: str  # "embed", "block.7", "block.7.experts", "head"
    slots: tuple[ParamSlot, ...]
    numel: int  # unpadded
    decay_numel: int  # elements [0, decay_numel) get weight decay

    def to_dict(self) -> dict:
        return {
            "index": self.index,
            "name": self.name,
            "numel": self.numel,
            "decay_numel": self.decay_numel,
            "slots": [[s.name, list(s.shape), s.offset, s.numel] for s in self.slots],
        }

    @property
    def layer(self) -> int | None:
        """The transformer layer of a block chunk ("block.i" or "block.i.experts"), else None."""
        parts = self.name.split(".")
        return int(parts[1]) if parts[0] == "block" else None

    @property
    def experts(self) -> bool:
        """The experts of a sparse block: a chunk of their own (expert parallelism cuts it)."""
        return self.name.endswith(".experts")

    @classmethod
    def from_dict(cls, d: dict) -> ChunkSpec:
        slots = tuple(ParamSlot(n, tuple(shape), off, k) for n, shape, off, k in d["slots"])
        return cls(d["index"], d["name"], slots, d["numel"], d["decay_numel"])


EXPERTS = ".mlp.experts."  # the parameters of a sparse block's experts (model/families/qwen3_moe)


def decays(name: str, ndim: int) -> bool:
    """Weight decay on matrices and embeddings only: biases and norm gains are left alone. By
    the dimensions, and by the name for the biases of fused experts (gpt-oss's [E, 2F]
    `experts.gate_up_bias`: one bias per expert, two-dimensional)."""
    return ndim >= 2 and not name.endswith("bias")


def _chunk(index: int, name: str, named: list[tuple[str, nn.Parameter]], rule) -> ChunkSpec:
    ordered = [p for p in named if decays(p[0], p[1].ndim)] + [
        p for p in named if not decays(p[0], p[1].ndim)
    ]
    slots, off, decay_numel = [], 0, 0
    for pname, p in ordered:
        slots.append(ParamSlot(pname, tuple(p.shape), off, p.numel(), rule(pname)))
        off += p.numel()
        if decays(pname, p.ndim):
            decay_numel = off
    return ChunkSpec(index, name, tuple(slots), off, decay_numel)


def chunk_layout(model: nn.Module, trained: bool = False) -> list[ChunkSpec]:
    """Chunks in execution order: embed, block.0 … block.L-1, head (works on the meta device).
    Each parameter's tensor-parallel Split comes from the model's family (none for a module
    that has no family: every parameter replicated). `trained`: only the parameters that train
    (requires_grad), chunks left empty dropped: an adapter run's adapters, its frozen base
    aside (fitgpt/adapters)."""
    family = getattr(model, "family", None)
    rule = family.split_rule if family is not None else (lambda name: None)
    before, after, seen_blocks = [], [], False
    seen: set[int] = set()
    chunks: list[ChunkSpec] = []

    def kept(named: list[tuple[str, nn.Parameter]]) -> list[tuple[str, nn.Parameter]]:
        return [(n, p) for n, p in named if p.requires_grad] if trained else named

    for child_name, child in model.named_children():
        if child_name == "blocks":
            seen_blocks = True
            for i, block in enumerate(child):
                named = [(f"blocks.{i}.{n}", p) for n, p in block.named_parameters()]
                seen.update(id(p) for _, p in named)
                experts = [(n, p) for n, p in named if EXPERTS in n]
                dense = [(n, p) for n, p in named if EXPERTS not in n]
                chunks.append(_chunk(0, f"block.{i}", kept(dense), rule))
                chunks.append(_chunk(0, f"block.{i}.experts", kept(experts), rule))
            continue
        named = [(f"{child_name}.{n}", p) for n, p in child.named_parameters() if id(p) not in seen]
        seen.update(id(p) for _, p in named)
        (after if seen_blocks else before).append(kept(named))
    specs = [
        _chunk(0, "embed", [p for g in before for p in g], rule),
        *chunks,
        _chunk(0, "head", [p for g in after for p in g], rule),
    ]
    specs = [s for s in specs if s.numel > 0]
    return [ChunkSpec(i, s.name, s.slots, s.numel, s.decay_numel) for i, s in enumerate(specs)]
