"""Memory the product may use, checked before anything large is allocated; pinned host buffers.

Sizes are in GB (10^9 bytes), as in "a 50000×50000 fp32 matrix is 10 GB".
"""

from __future__ import annotations

import os

import torch

from fitgpt.errors import UserError

GB = 1e9
# Kept free on the device for cuBLAS workspaces, NCCL buffers and the verifier's float64
# temporaries (at most VERIFY_CHUNK_BYTES each), which the layouts' own counts leave out.
DEVICE_RESERVE = int(1.5 * GB)


def gb(nbytes: float) -> str:
    return f"{nbytes / GB:.2f} GB" if nbytes < 10 * GB else f"{nbytes / GB:.1f} GB"


def host_available(override_gb: float = 0.0) -> int:
    """Bytes of host memory a new allocation can take: --host-mem, else MemAvailable."""
    if override_gb > 0:
        return int(override_gb * GB)
    from fitgpt.plan.hardware import host_available

    available = host_available()
    if available:
        return available
    raise UserError("host memory: /proc/meminfo has no MemAvailable here; pass --host-mem GB")


def device_available(device: torch.device, override_gb: float = 0.0, local_ranks: int = 1) -> int:
    """Bytes this rank may allocate on its device: --device-mem, else free memory less a reserve.

    On the CPU the "device" is host memory shared by the `local_ranks` processes of this node.
    """
    if override_gb > 0:
        return int(override_gb * GB)
    if device.type == "cuda":
        free, _total = torch.cuda.mem_get_info(device)  # host-device sync (driver query)
        # Memory torch's allocator holds but no tensor uses is ours too.
        cached = torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
        return max(0, free + cached - DEVICE_RESERVE)
    return host_available() // max(1, local_ranks)


def local_ranks() -> int:
    return int(os.environ.get("LOCAL_WORLD_SIZE", "1"))


# Host arrays are made of pinned chunks of this many bytes. torch's pinned allocator rounds
# every request up to a power of two (one 40 GB request would take 68.7 GB), so the chunks are
# a power of two themselves and nothing is wasted but the unused end of the last one.
HOST_CHUNK_BYTES = 1 << 30


class HostArray:
    """A flat host array in page-locked chunks, so host<->device copies run asynchronously.

    A region [off, off + numel) may span chunks; reads and writes go piece by piece (a 20 GB
    panel is twenty 1 GiB DMA copies, no slower than one). Without CUDA nothing is pinned.
    """

    def __init__(self, numel: int, dtype: torch.dtype, pin: bool = True):
        self.pinned = pin and torch.cuda.is_available()  # False once any chunk is not
        self.per_chunk = max(1, HOST_CHUNK_BYTES // torch.empty((), dtype=dtype).element_size())
        self.numel = numel
        self.chunks = []
        for start in range(0, numel, self.per_chunk):
            size = min(self.per_chunk, numel - start)
            try:
                self.chunks.append(torch.empty(size, dtype=dtype, pin_memory=self.pinned))
            except RuntimeError:
                if not self.pinned:
                    raise
                # The system would lock no more pages: the rest is pageable, and copies from
                # it are synchronous for the host (slower, still correct).
                self.pinned = False
                self.chunks.append(torch.empty(size, dtype=dtype))

    def pieces(self, off: int, numel: int):
        """(host slice, its position within the region) covering [off, off + numel)."""
        pos = 0
        while pos < numel:
            chunk, start = divmod(off + pos, self.per_chunk)
            take = min(self.per_chunk - start, numel - pos)
            yield self.chunks[chunk][start : start + take], pos
            pos += take

    def read(self, dst: torch.Tensor, off: int, non_blocking: bool = False) -> None:
        """dst (flat, any device) <- region [off, off + dst.numel())."""
        for piece, pos in self.pieces(off, dst.numel()):
            dst[pos : pos + piece.numel()].copy_(piece, non_blocking=non_blocking)

    def write(self, off: int, src: torch.Tensor) -> None:
        """Region [off, off + src.numel()) <- src (flat, any device; from a GPU: a sync)."""
        for piece, pos in self.pieces(off, src.numel()):
            piece.copy_(src[pos : pos + piece.numel()])

    def close(self) -> None:
        """Drop the chunks and hand the pinned pages back to the system."""
        self.chunks = []
        if torch.cuda.is_available() and hasattr(torch._C, "_host_emptyCache"):
            torch.cuda.synchronize()  # host-device sync: no copy may still read the chunks
            torch._C._host_emptyCache()
