"""The model both engines train, built in one order (TorchEngine and ChunkEngine call `build`):

  1. the family's network on the meta device: no memory (model/families/__init__.py build_model);
  2. its chunk layout, the unsplit model's: what checkpoints record (engine/layout.py);
  3. tensor parallelism: 1/T of the cut weights (fitgpt/parallel); or context parallelism:
     attention's all-to-alls hooked on, every weight whole (fitgpt/parallel/context.py); or
     expert parallelism: E/P experts of each sparse layer (fitgpt/parallel/experts.py). T and C
     were validated with the run's other settings (plan/validate.py), and the ranks laid out
     for them (train/assemble.py), before any engine is built;
  4. this rank's layout (the same as 2 at T = 1, and under context parallelism);
  5. the view of the unsplit model that initialisation, checkpoints and generation take
     (StateView: the model as it is at T = 1, TP's gathers and splits at T > 1), chosen here once.

The engines then place the parameters (TorchEngine: on the device; ChunkEngine: views of its
chunks), make the buffers (DecoderLM.materialize_buffers), initialise every parameter by name,
compile, and wrap activation checkpointing around the compiled blocks, in that order.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor

from fitgpt.adapters import AdapterConfig, lora_targets
from fitgpt.adapters.lora import attach_lora
from fitgpt.dist.mesh import ContextGroup, ExpertGroups, Mesh
from fitgpt.engine.layout import ChunkSpec, chunk_layout
from fitgpt.engine.state_io import Piece, Reader, StateReader, WeightSource, open_reader
from fitgpt.engine.transforms.ep_state import ExpertView
from fitgpt.engine.transforms.tp_state import TPReader, sharded_init, tp_pieces, unsplitter
from fitgpt.model import DecoderLM, ModelConfig, build_model
from fitgpt.parallel import context_parallel, parallelize
from fitgpt.parallel.experts import expert_parallel

Init = Callable[[str, Tensor], None]


class StateView:
    """The unsplit model as this rank's state meets it: checkpoints hold whole chunks in the
    unsplit layout, initialisation draws whole parameters, generation wants whole weights. At
    T = 1 every method passes through; SplitView is tensor parallelism's
    (engine/transforms/tp_state.py)."""

    def init(self, init: Init) -> Init:
        """init(name, t) for this rank's tensor t, from the unsplit model's init by name."""
        return init

    def reader(self, src: Path | WeightSource) -> Reader:
        """Reads a checkpoint's (or a WeightSource's) ranges in this rank's layout."""
        return open_reader(src)

    def pieces(self, local: Iterator[tuple[ChunkSpec, dict[str, Tensor]]]) -> Iterator[Piece]:
        """Whole-chunk pieces in the unsplit layout from this rank's whole local chunks
        (collective under TP: every rank of the group consumes it)."""
        return (Piece(c.index, 0, c.numel, t) for c, t in local)

    unsplit: Callable[[str, Tensor], Tensor] | None = None  # whole weights from this rank's


class SplitView(StateView):
    def __init__(self, layout: list[ChunkSpec], local: list[ChunkSpec], mesh: Mesh, device):
        self.layout, self.local, self.mesh, self.device = layout, local, mesh, device
        self.unsplit = unsplitter(mesh, device, layout)

    def init(self, init: Init) -> Init:
        return sharded_init(init, self.layout, self.mesh)

    def reader(self, src: Path | WeightSource) -> Reader:
        if isinstance(src, WeightSource):  # reads this rank's rows and columns alone
            return src.reader(self.local, self.mesh.tp_rank, self.mesh.tp)
        return TPReader(StateReader(src), self.layout, self.local, self.mesh)

    def pieces(self, local):
        return tp_pieces(local, self.layout, self.mesh, self.device)


@dataclass
class Built:
    model: DecoderLM  # on the meta device
    layout: list[ChunkSpec]  # the unsplit model's
    local_layout: list[ChunkSpec]  # this rank's
    view: StateView | ExpertView


def build(
    cfg: ModelConfig,
    mesh: Mesh | None,
    sequence_parallel: bool,
    device,
    cp: ContextGroup | None = None,
    ep: ExpertGroups | None = None,
) -> Built:
    """`cp`: the context-parallel group (DistContext.cp), None at C = 1; `ep`: the
    expert-parallel groups (DistContext.ep), None at P = 1 (neither T nor C then: refused)."""
    with torch.device("meta"):
        model = build_model(cfg)
    layout = chunk_layout(model)
    if ep is not None:  # E/P experts per sparse layer, the rest whole
        model = expert_parallel(model, ep)
        local = chunk_layout(model)
        return Built(model, layout, local, ExpertView(layout, local, ep))
    if mesh is None:  # context parallelism keeps the weights whole: the unsplit layout and view
        model = context_parallel(model, cp) if cp is not None else model
        return Built(model, layout, layout, StateView())
    model = parallelize(model, mesh, sequence_parallel)
    if cp is not None:  # after TP: its head-cut linears get the all-to-alls
        model = context_parallel(model, cp)
    local = chunk_layout(model)
    return Built(model, layout, local, SplitView(layout, local, mesh, device))


def adapter_layout(cfg: ModelConfig, adapter: AdapterConfig) -> list[ChunkSpec]:
    """The chunks an adapter run trains and saves (its adapters; TorchEngine's `layout`), made
    as the engine makes them, on the meta device: no memory."""
    with torch.device("meta"):
        model = build_model(cfg)
    attach_lora(model, lora_targets(cfg, adapter), adapter)
    return chunk_layout(model, trained=True)
