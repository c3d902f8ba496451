"""C written to a .npy file: every rank writes its own blocks into one memory map.

Rank 0 creates the file (header and size) under a temporary name; after a barrier every rank
opens it read-write and writes its blocks; after a second barrier rank 0 renames it, so a
crashed run never leaves a complete-looking C.npy. The ranks must share a filesystem (one node,
or a shared mount). C is stored as float32 whatever the dtype: numpy has no bfloat16.
"""

from __future__ import annotations

import contextlib
import os

import numpy as np
import torch

from fitgpt.dist import DistContext

WRITE_CHUNK_BYTES = 256 << 20  # host copy of a block is made this much at a time


class NpyWriter:
    def __init__(self, ctx: DistContext, path: str, n: int):
        self.ctx, self.path = ctx, path
        self.tmp = f"{path}.tmp"
        if ctx.is_main:
            mm = np.lib.format.open_memmap(self.tmp, mode="w+", dtype=np.float32, shape=(n, n))
            del mm  # header written, file sized (sparse until the blocks land)
        ctx.barrier()
        self.mm = np.lib.format.open_memmap(self.tmp, mode="r+")

    def write(self, r0: int, c0: int, block: torch.Tensor) -> None:
        """C[r0:r0+h, c0:c0+w] = block (any device; copied to the host in row chunks)."""
        h, w = block.shape
        step = max(1, WRITE_CHUNK_BYTES // (4 * max(1, w)))
        for r in range(0, h, step):
            e = min(h, r + step)
            # .cpu() is a host-device sync when the block is on a GPU.
            self.mm[r0 + r : r0 + e, c0 : c0 + w] = block[r:e].to("cpu", torch.float32).numpy()

    def close(self) -> None:
        """Flush every rank's blocks, then rank 0 publishes the file under its real name."""
        self.mm.flush()
        del self.mm
        self.ctx.barrier()
        if self.ctx.is_main:
            os.replace(self.tmp, self.path)
        self.ctx.barrier()

    def abort(self) -> None:
        with contextlib.suppress(AttributeError):
            del self.mm
        if self.ctx.is_main:
            with contextlib.suppress(FileNotFoundError):
                os.remove(self.tmp)
