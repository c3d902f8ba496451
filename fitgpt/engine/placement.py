"""Where each chunk's optimizer state lives: one function, used by the engine and the planner.

Three tiers, filled in order GPU, host RAM, disk. The GPU is filled first: only the last `offload_fraction` of the transformer blocks send their
fp32 master weights and Adam moments to the offload tier. The last blocks go first because the
next step's forward needs the first blocks first: their updates (on the GPU) are ready at once,
while the host finishes the last blocks' updates during that forward.
"""

from __future__ import annotations

from fitgpt.engine.config import EngineConfig
from fitgpt.engine.layout import ChunkSpec


def optimizer_homes(layout: list[ChunkSpec], ecfg: EngineConfig) -> list[str]:
    """Per chunk: "device" (the compute device), "cpu" or "nvme"."""
    homes = ["device"] * len(layout)
    if ecfg.offload_optimizer == "none":
        return homes
    blocks = [i for i, c in enumerate(layout) if c.name.startswith("block.")]
    k = round(len(blocks) * ecfg.offload_fraction)
    offloaded = blocks[len(blocks) - k :]
    # the nvme tier takes the last of the offloaded blocks (their updates are needed last); the
    # rest of them stay in host RAM, which is ~30x faster to stream than the disk
    d = round(k * ecfg.nvme_fraction) if ecfg.offload_optimizer == "nvme" else 0
    for j, i in enumerate(offloaded):
        homes[i] = "nvme" if j >= k - d else "cpu"
    return homes
