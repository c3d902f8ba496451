"""Page-locked host buffers sized exactly, for state that lives in host RAM for the whole run.

`tensor.pin_memory()` goes through torch's pinned caching allocator, which rounds every request
up to a power of two: a 403 MB block of bf16 weights would hold 512 MB, 27% of host RAM lost
on the tier that limits capacity. Here the buffer is an ordinary allocation that is then
registered with the driver (cudaHostRegister): exactly its size, and DMA-able, so copies to and
from the GPU with non_blocking=True are truly asynchronous. Registration costs a few ms per GB
once. Where it is refused (no CUDA, a driver without the call), the caching allocator is used
instead.
"""

from __future__ import annotations

import torch
from torch import Tensor


class PinnedArena:
    """Owns registered buffers and unregisters them at close() (before their memory is freed)."""

    def __init__(self, cuda: bool) -> None:
        self.cuda = cuda
        self.registered: list[Tensor] = []

    def zeros(self, n: int, dtype: torch.dtype) -> Tensor:
        t = torch.zeros(n, dtype=dtype)
        if not self.cuda or n == 0:
            return t
        try:
            rt = torch.cuda.cudart()
            torch.cuda.check_error(rt.cudaHostRegister(t.data_ptr(), t.nbytes, 0))
        except (RuntimeError, AttributeError):
            return t.pin_memory()  # the caching allocator: rounded up, but pinned
        self.registered.append(t)
        return t

    def close(self) -> None:
        rt = torch.cuda.cudart() if self.registered else None
        for t in self.registered:
            rt.cudaHostUnregister(t.data_ptr())
        self.registered = []
