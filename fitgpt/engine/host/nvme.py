"""The NVMe tier: flat CPU tensors (fp32 optimizer state of disk-homed chunks) kept in files.

The tier is for capacity, not speed: a local NVMe disk streams about 1.8 GB/s against about
55 GB/s over PCIe, so state that lives here costs a disk round trip per step and pays off only
when host memory cannot hold it. Reads and writes are asynchronous so the caller can overlap
them with compute.

Layout: `NvmeStore(root, ...)` makes its own folder `root/fitgpt-scratch-<pid>-<hex>` and never
touches anything else under root. Each key gets one file there, `<index>-<key>.bin`, pre-sized
to the key's byte count rounded up to 4096. A transfer is cut into `block_bytes` pieces at
offsets that are multiples of `block_bytes`; the pieces run in parallel on `workers` threads
(os.pwrite/os.preadv and torch copies release the GIL). The folder is removed by close(), by
the `with` block, when the store is garbage collected, and at normal interpreter exit
(exceptions included); a killed process (SIGKILL, OOM killer) leaves it behind, and the next store
made under the same root removes it (its pid is gone).

Direct I/O: files are opened with O_DIRECT where the filesystem accepts it (probed once at
start; tmpfs and some network filesystems refuse it, and the store falls back to the page cache
with `direct = False`), so optimizer state streamed through the tier does not evict the host
memory the rest of training needs. Every block goes through a page-aligned bounce buffer, one
per worker (engine/host/aligned_io.py says why and what it costs): `workers × block_bytes` bytes
(64 MiB by default; the kernel commits the pages on first use).
"""

from __future__ import annotations

import os
import queue
import re
import secrets
import shutil
import threading
import time
import weakref
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

from torch import Tensor

from fitgpt.engine.host.aligned_io import (
    PAGE,
    Bounce,
    bytes_of,
    direct_works,
    presize,
    read_block,
    round_up,
    write_block,
)
from fitgpt.errors import UserError
from fitgpt.procs import pid_alive

GiB = 1 << 30
# Free space the store leaves on the disk: filling a disk to the last byte breaks the logger,
# checkpoints and whatever else shares the disk, and ext4 reserves blocks that df still counts.
MARGIN_MIN_BYTES = 1 * GiB
MARGIN_FRACTION = 0.02  # of the disk's total size, when that is larger than MARGIN_MIN_BYTES
FIX = "point --nvme-path at a larger disk or offload less to nvme"


def orphans(root: str) -> list[str]:
    """Scratch folders under root left by fitgpt processes that no longer exist (a run killed by
    SIGKILL or the OOM killer cannot clean up after itself). A folder of a live process, or
    anything not named like ours, is not one."""
    if not os.path.isdir(root):
        return []
    out = []
    for name in os.listdir(root):
        m = re.fullmatch(r"fitgpt-scratch-(\d+)-[0-9a-f]+", name)
        if m and not pid_alive(int(m.group(1))):
            out.append(os.path.join(root, name))
    return out


def remove_orphans(root: str) -> list[str]:
    """Remove the orphaned scratch folders under root (orphans()); returns their paths."""
    gone = orphans(root)
    for path in gone:
        shutil.rmtree(path, ignore_errors=True)
    return gone


def _used_bytes(folder: str) -> int:
    """Disk blocks the files under `folder` take (what removing them frees)."""
    total = 0
    for dirpath, _, files in os.walk(folder):
        for f in files:
            try:
                total += os.lstat(os.path.join(dirpath, f)).st_blocks * 512
            except OSError:
                continue
    return total


def disk_room(path: str) -> int:
    """Bytes the tier may use at `path`: the free space, plus what a killed run's orphaned
    scratch holds (the store removes it before it allocates: remove_orphans), less the spare
    room it always leaves."""
    usage = shutil.disk_usage(path)
    reclaim = sum(_used_bytes(p) for p in orphans(path))
    return usage.free + reclaim - max(MARGIN_MIN_BYTES, int(MARGIN_FRACTION * usage.total))


def check_disk_room(path: str, need: int) -> None:
    """Raise UserError unless `path` is a writable directory with `need` bytes free plus margin."""
    if not os.path.exists(path):
        raise UserError(f"--nvme-path {path} does not exist; create it or {FIX}")
    if not os.path.isdir(path):
        raise UserError(f"--nvme-path {path} is not a directory; {FIX}")
    if not os.access(path, os.W_OK | os.X_OK):
        raise UserError(f"--nvme-path {path} is not writable by this user; {FIX}")
    usage = shutil.disk_usage(path)
    margin = max(MARGIN_MIN_BYTES, int(MARGIN_FRACTION * usage.total))
    room = disk_room(path)
    if room < need:
        raise UserError(
            f"--nvme-path {path}: needs {need / GiB:.2f} GiB but has {usage.free / GiB:.2f} GiB "
            f"free (keeping {margin / GiB:.2f} GiB spare), short by {(need - room) / GiB:.2f} "
            f"GiB; {FIX}"
        )


@dataclass
class _Key:
    path: str
    capacity: int  # bytes the key may hold; the file is this rounded up to PAGE
    written: int = 0  # bytes of the last complete write
    valid: bool = False  # set only when every block of the last write succeeded
    writing: bool = False
    reading: int = 0  # reads in flight


class NvmeStore:
    """Files of flat CPU tensors under a private scratch folder; see the module docstring.

    write()/read() return a Future that completes when every block is on disk / in `dst`. The
    caller must not modify `src` nor read or free `dst` before that future is done: the workers
    copy from and into their memory until then. Errors of any block surface from
    `future.result()`, raised only after every block of the transfer has finished.
    """

    def __init__(
        self,
        root: str,
        need_bytes: int,
        workers: int = 4,
        block_bytes: int = 16 << 20,
        direct: bool | None = None,
    ) -> None:
        if workers < 1:
            raise ValueError(f"workers={workers} must be at least 1")
        if block_bytes < PAGE or block_bytes % PAGE:
            raise ValueError(f"block_bytes={block_bytes} must be a positive multiple of {PAGE}")
        remove_orphans(root)  # a killed run's scratch must not count against this one's room
        check_disk_room(root, need_bytes)
        self.workers, self.block_bytes = workers, block_bytes
        self.path = os.path.join(
            os.path.abspath(root), f"fitgpt-scratch-{os.getpid()}-{secrets.token_hex(4)}"
        )
        os.mkdir(self.path, 0o700)  # fails rather than reuse a folder that already exists
        # weakref.finalize is an atexit hook that holds only a weak reference to the store: the
        # folder goes at close(), at garbage collection, or at interpreter exit, whichever is
        # first. Its arguments must not reference self.
        self._pool = ThreadPoolExecutor(workers, thread_name_prefix="fitgpt-nvme")
        self._cleanup = weakref.finalize(self, _remove, self.path, self._pool, os.getpid())
        works = direct is not False and direct_works(self.path)
        if direct and not works:  # asked for, not merely tried
            self._cleanup()
            raise UserError(f"--nvme-path {root} does not support O_DIRECT; pass direct=None")
        self.direct = works
        self._flags = os.O_RDWR | (os.O_DIRECT if self.direct else 0)
        self._bounce: queue.Queue[Bounce] = queue.Queue()
        # one per worker, so a block never waits for a buffer. Buffered I/O goes through them too:
        # handing the tensor's own memory to os.pwrite needs a numpy view, and a numpy export pins
        # the storage's size for good, which the disk tier's swap (resize to 0 and back) needs
        for _ in range(workers):
            self._bounce.put(Bounce(block_bytes))
        self._keys: dict[str, _Key] = {}
        self._lock = threading.Lock()  # guards _keys' flags and the counters
        self._count = {"bytes_read": 0, "bytes_written": 0, "reads": 0, "writes": 0}
        self._secs = {"read_s": 0.0, "write_s": 0.0}
        self.allocated_bytes = 0
        self.closed = False

    # ---- keys ----------------------------------------------------------------------------------
    def alloc(self, key: str, nbytes: int) -> None:
        """Create the key's file, pre-sized to nbytes rounded up to 4096 (the disk is reserved)."""
        self._check_open()
        if key in self._keys:
            raise ValueError(f"nvme key {key!r} is already allocated")
        if nbytes < 0:
            raise ValueError(f"nvme key {key!r}: nbytes={nbytes} must be >= 0")
        safe = re.sub(r"[^A-Za-z0-9_.-]", "_", key)[:64]
        path = os.path.join(self.path, f"{len(self._keys):05d}-{safe}.bin")
        size = round_up(nbytes, PAGE)
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            presize(fd, size)
        except OSError as e:
            os.close(fd)
            os.unlink(path)
            raise UserError(
                f"--nvme-path {self.path}: cannot reserve {size / GiB:.2f} GiB for {key!r} "
                f"({e.strerror}); {FIX}"
            ) from e
        os.close(fd)
        self._keys[key] = _Key(path, nbytes)
        self.allocated_bytes += size

    # ---- transfers -----------------------------------------------------------------------------
    def write(self, key: str, src: Tensor) -> Future:
        """Copy src's bytes into the key's file; src must stay untouched until the future is done."""
        self._check_open()
        u8 = bytes_of(src, "src")
        k = self._entry(key)
        n = u8.numel()
        if n > k.capacity:
            raise ValueError(f"nvme key {key!r}: src has {n} bytes, allocated {k.capacity}")
        with self._lock:
            if k.writing or k.reading:
                raise RuntimeError(f"nvme key {key!r}: write while another transfer is in flight")
            k.writing, k.valid = True, False  # a failed or partial write is never read back

        def finish(ok: bool) -> None:
            with self._lock:
                k.writing, k.valid, k.written = False, ok, n if ok else 0
                self._count["writes"] += ok

        return self._run(self._write_block, k.path, u8, finish)

    def read(self, key: str, dst: Tensor) -> Future:
        """Copy the key's last complete write into dst (same byte count); dst is off limits until
        the future is done."""
        self._check_open()
        u8 = bytes_of(dst, "dst")
        k = self._entry(key)
        with self._lock:
            if not k.valid:
                raise RuntimeError(
                    f"nvme key {key!r} has no complete write (never written, failed, or still in "
                    "flight); wait for write() before read()"
                )
            if u8.numel() != k.written:
                raise ValueError(
                    f"nvme key {key!r}: dst has {u8.numel()} bytes, the last write had {k.written}"
                )
            k.reading += 1

        def finish(ok: bool) -> None:
            with self._lock:
                k.reading -= 1
                self._count["reads"] += ok

        return self._run(self._read_block, k.path, u8, finish)

    def _run(
        self, block: Callable, path: str, u8: Tensor, finish: Callable[[bool], None]
    ) -> Future:
        """Submit one task per block; the returned future completes when all of them have."""
        n, step = u8.numel(), self.block_bytes
        parts = [
            self._pool.submit(block, path, u8, off, min(step, n - off)) for off in range(0, n, step)
        ]
        out: Future = Future()
        out.set_running_or_notify_cancel()  # the blocks are queued: cancel() can no longer stop it
        left = [len(parts)]

        def one_done(_: Future) -> None:
            with self._lock:
                left[0] -= 1
                if left[0]:
                    return
            err = next((e for e in (p.exception() for p in parts) if e is not None), None)
            finish(err is None)
            if err is None:
                out.set_result(None)
            else:
                out.set_exception(err)

        if not parts:  # an empty tensor: nothing to move
            finish(True)
            out.set_result(None)
        for p in parts:
            p.add_done_callback(one_done)
        return out

    def _write_block(self, path: str, u8: Tensor, off: int, n: int) -> None:
        t0 = time.perf_counter()
        fd = os.open(path, self._flags)  # no O_CREAT: a file deleted under us is an error
        buf = self._bounce.get()
        try:
            write_block(fd, buf, u8, off, n)
        finally:
            self._bounce.put(buf)
            os.close(fd)
        self._tally("bytes_written", "write_s", n, time.perf_counter() - t0)

    def _read_block(self, path: str, u8: Tensor, off: int, n: int) -> None:
        t0 = time.perf_counter()
        fd = os.open(path, self._flags)
        buf = self._bounce.get()
        try:
            read_block(fd, buf, u8, off, n)
        finally:
            self._bounce.put(buf)
            os.close(fd)
        self._tally("bytes_read", "read_s", n, time.perf_counter() - t0)

    # ---- counters and lifetime -----------------------------------------------------------------
    def _tally(self, nbytes: str, secs: str, n: int, dt: float) -> None:
        with self._lock:
            self._count[nbytes] += n
            self._secs[secs] += dt

    def stats(self, reset: bool = False) -> dict[str, float | int | bool]:
        """Bytes moved, transfers completed, and worker-seconds in I/O (bounce copies included;
        summed over workers, so it exceeds wall time when blocks overlap)."""
        with self._lock:
            out = {**self._count, **self._secs}
            if reset:
                self._count = dict.fromkeys(self._count, 0)
                self._secs = dict.fromkeys(self._secs, 0.0)
        return {**out, "direct": self.direct, "allocated_bytes": self.allocated_bytes}

    def close(self) -> None:
        """Wait for transfers in flight, then remove the scratch folder. Safe to call twice."""
        if self.closed:
            return
        self.closed = True
        self._pool.shutdown(wait=True)  # every pending future completes before its files go
        self._cleanup()
        self._bounce = queue.Queue()  # frees the bounce buffers

    def __enter__(self) -> NvmeStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _entry(self, key: str) -> _Key:
        if key not in self._keys:
            raise KeyError(f"nvme key {key!r} was never allocated")
        return self._keys[key]

    def _check_open(self) -> None:
        if self.closed:
            raise RuntimeError(f"nvme store {self.path} is closed")


def _remove(path: str, pool: ThreadPoolExecutor, pid: int) -> None:
    # A forked child inherits the finalizer; only the process that made the folder removes it.
    if os.getpid() != pid:
        return
    pool.shutdown(wait=False)  # close() has already waited; at exit the threads are joined
    shutil.rmtree(path, ignore_errors=True)
