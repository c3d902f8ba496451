"""The disk tier (`--offload-optimizer nvme`): the optimizer state of disk-homed chunks kept in
files, one per chunk and tensor, through engine/host/nvme.py's store. A disk-homed chunk's host
buffers exist only between a read and the write after it: the host optimizer
(engine/chunked/offload.py) reads the state in for its update and writes it out after the step;
checkpoints read and write it through the same files (engine/chunked/chunk_state.py).
"""

from __future__ import annotations

import concurrent.futures

from fitgpt.engine.chunked.chunk import Chunk
from fitgpt.engine.host.nvme import NvmeStore


class DiskTier:
    """The optimizer state of disk-homed chunks, one file per chunk and tensor (in its formats:
    compact ones move fewer bytes), in a scratch folder under `path` that is removed at exit
    (engine/host/nvme.py). The free space is checked for the whole tier before anything is
    written."""

    def __init__(self, path: str, layouts: dict[int, dict[str, int]]) -> None:
        """layouts: chunk index -> {tensor name: bytes} of its optimizer state on this rank."""
        need = sum(sum(lay.values()) for lay in layouts.values())
        self.store = NvmeStore(path, need_bytes=need)
        for index, lay in layouts.items():
            for name, nbytes in lay.items():
                self.store.alloc(f"{index}.{name}", nbytes)

    def write_out(self, c: Chunk) -> None:
        """Write the chunk's state to its files, wait, and free its host buffers."""
        futs = [self.store.write(f"{c.spec.index}.{k}", t) for k, t in c.state_tensors().items()]
        for f in futs:
            f.result()
        c.free_state()

    def read_in_async(self, c: Chunk) -> list[concurrent.futures.Future]:
        c.alloc_state()
        return [self.store.read(f"{c.spec.index}.{k}", t) for k, t in c.state_tensors().items()]

    def read_in(self, c: Chunk) -> None:
        for f in self.read_in_async(c):
            f.result()

    def stats(self) -> dict:
        return self.store.stats()

    def close(self) -> None:
        self.store.close()
