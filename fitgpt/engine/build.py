"""The model both engines train, built in one order (TorchEngine and ChunkEngine call `build`):

  1. the family's network on the meta device: no memory (model/family.py build_model);
  2. its chunk layout, the unsplit model's: what checkpoints record (engine/layout.py);
  3. tensor parallelism, checked in one line first: 1/T of the cut weights (fitgpt/parallel);
  4. this rank's layout (the same as 2 at T = 1).

The engines then place the parameters (TorchEngine: on the device; ChunkEngine: views of its
chunks), make the buffers (DecoderLM.materialize_buffers), initialise every parameter by name,
compile, and wrap activation checkpointing around the compiled blocks, in that order.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from fitgpt.dist.mesh import Mesh
from fitgpt.engine.layout import ChunkSpec, chunk_layout
from fitgpt.model import DecoderLM, ModelConfig, build_model
from fitgpt.parallel import check_tensor_parallel, parallelize


@dataclass
class Built:
    model: DecoderLM  # on the meta device
    layout: list[ChunkSpec]  # the unsplit model's
    local_layout: list[ChunkSpec]  # this rank's


def build(cfg: ModelConfig, mesh: Mesh | None, world: int, sequence_parallel: bool) -> Built:
    with torch.device("meta"):
        model = build_model(cfg)
    layout = chunk_layout(model)
    if mesh is None:
        return Built(model, layout, layout)
    check_tensor_parallel(mesh.tp, cfg, world, sequence_parallel)
    model = parallelize(model, mesh, sequence_parallel)
    return Built(model, layout, chunk_layout(model))
