"""Page-aligned file I/O for the NVMe tier (engine/host/nvme.py): bounce buffers and whole
transfers.

O_DIRECT bypasses the page cache, so optimizer state streamed through the disk tier does not
evict the host memory the rest of training needs, but it requires the buffer address, the file
offset and the length to be multiples of PAGE (4096). Tensor memory is not page aligned, so every
block goes through a page-aligned bounce buffer (an anonymous mmap, which starts on a page): on
write, the block is copied in and its tail padded with zeros up to the next page; on read, whole
pages are read and the pad is dropped.

Costs: one extra memory copy per byte each way (tensor <-> bounce buffer). Buffered I/O (no
O_DIRECT) goes through the bounce buffers too, so the caller's tensors are never exported through
numpy, which would pin their storage's size for good (the disk tier frees a chunk's state by
resizing its storage to 0 and back); the page cache then holds whatever the kernel keeps.
"""

from __future__ import annotations

import errno
import mmap
import os

import torch
from torch import Tensor

PAGE = 4096  # O_DIRECT alignment of buffer addresses, file offsets and lengths


class Bounce:
    """A page-aligned buffer (anonymous mmaps start on a page) seen as bytes and as a tensor."""

    def __init__(self, nbytes: int) -> None:
        self.mm = mmap.mmap(-1, nbytes)
        self.mv = memoryview(self.mm)
        self.t = torch.frombuffer(self.mm, dtype=torch.uint8)


def write_block(fd: int, buf: Bounce, u8: Tensor, off: int, n: int) -> None:
    """Write bytes [off, off+n) of u8 at file offset off (a multiple of PAGE), through buf,
    padded with zeros to a whole page."""
    m = round_up(n, PAGE)
    buf.t[:n].copy_(u8[off : off + n])
    buf.t[n:m].zero_()  # pad the tail to a whole page
    pwrite_all(fd, buf.mv[:m], off)


def read_block(fd: int, buf: Bounce, u8: Tensor, off: int, n: int) -> None:
    """Read bytes [off, off+n) of the file into u8[off : off+n], through buf."""
    pread_all(fd, buf.mv[: round_up(n, PAGE)], off)  # the pad is read, unused
    u8[off : off + n].copy_(buf.t[:n])


def round_up(n: int, m: int) -> int:
    return -(-n // m) * m


def bytes_of(t: Tensor, name: str) -> Tensor:
    """The tensor's memory as a flat uint8 view (no copy)."""
    if t.device.type != "cpu" or not t.is_contiguous():
        raise ValueError(f"{name} must be a contiguous CPU tensor, got {t.device} {t.stride()}")
    return t.reshape(-1).view(torch.uint8)


def presize(fd: int, size: int) -> None:
    """Reserve the file's blocks up front (posix_fallocate), or at least set its length."""
    if size and hasattr(os, "posix_fallocate"):
        try:
            os.posix_fallocate(fd, 0, size)
            return
        except OSError as e:
            if e.errno not in (errno.EOPNOTSUPP, errno.EINVAL):  # the filesystem cannot: fall back
                raise
    os.ftruncate(fd, size)


def pwrite_all(fd: int, mv: memoryview, off: int) -> None:
    while len(mv):
        done = os.pwrite(fd, mv, off)
        mv, off = mv[done:], off + done


def pread_all(fd: int, mv: memoryview, off: int) -> None:
    while len(mv):
        got = os.preadv(fd, [mv], off)
        if got == 0:
            raise OSError(f"unexpected end of file at offset {off}")
        mv, off = mv[got:], off + got


def direct_works(folder: str) -> bool:
    """Write and read back one page with O_DIRECT; False if the filesystem refuses it."""
    if not hasattr(os, "O_DIRECT"):
        return False
    probe = os.path.join(folder, "direct-probe")
    buf = Bounce(PAGE)
    buf.t.fill_(0x5A)
    try:
        fd = os.open(probe, os.O_RDWR | os.O_CREAT | os.O_DIRECT, 0o600)
        try:
            pwrite_all(fd, buf.mv, 0)
            buf.t.zero_()
            pread_all(fd, buf.mv, 0)
        finally:
            os.close(fd)
        return bool((buf.t == 0x5A).all())
    except OSError:
        return False
    finally:
        if os.path.exists(probe):
            os.unlink(probe)
