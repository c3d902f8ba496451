"""The host optimizer: AdamW steps of host-homed chunks, on a worker thread, overlapped with the GPU.

Per host-homed chunk and step:
  1. the reduced gradient (working dtype, on the GPU) is copied device→host into a pinned staging
     buffer on a side stream; the compute stream waits for that copy before it zeroes gradients;
  2. on the worker thread: the gradient is upcast to fp32 and scaled by clip/loss-scale, torch's
     fused AdamW updates the host fp32 master weights and moments in place, and the master is cast
     back into the staging buffer;
  3. the staging buffer is copied host→device into the chunk's weights on the side stream.
The next forward waits for a chunk just before its block runs (the engine's pre-hook), so the
host's work overlaps with the GPU updates of device-homed chunks and with the forward of the
blocks before it. Torch's CPU kernels release the GIL; the main thread keeps launching GPU work.

Compact formats (engine/formats/compact.py): step 2 runs piece by piece through the worker's fp32
scratch; a split master whose working weights are on the GPU brings them down beside the
gradient (a second pinned buffer per slot, `wstaging`), since they are its master's high half.

Disk-homed chunks (the nvme tier, engine/chunked/disk_tier.py: one file per tensor, in its formats):
`submit` gives the chunk's state its host buffers back and starts reading its files at once, so
the reads of the chunks queued behind the one the worker is updating overlap that update; the
worker waits for its reads, steps, casts back, writes the state out and frees the buffers. At most `slots` chunks are in flight, so the
host holds at most `slots` chunks' state (12 bytes per element in fp32 formats) for the tier,
whatever its size.

Costs per offloaded parameter and step: 2·w bytes over PCIe (gradient down, weights up), about
36 bytes of host memory traffic in AdamW, one fp32 conversion. Pinned staging: `slots` buffers of
the largest chunk (working dtype), plus one fp32 buffer of it for the worker.
"""

from __future__ import annotations

import atexit
import concurrent.futures
import math
import queue
import threading
import time
import weakref
from dataclasses import dataclass, field

import torch
from torch import Tensor

from fitgpt.engine.chunked.chunk import Chunk
from fitgpt.engine.chunked.disk_tier import DiskTier
from fitgpt.engine.chunked.placement import HOST_SLOTS
from fitgpt.engine.formats.compact import Scratch, piece_elems, upcast_scaled
from fitgpt.engine.formats.speculate import undo_optimizer_


class HostOptimizer:
    def __init__(
        self,
        device: torch.device,
        dtype: torch.dtype,
        max_elems: int,
        slots: int = HOST_SLOTS,
        disk: DiskTier | None = None,
        *,
        plain_elems: int | None = None,
        weight_elems: int = 0,
        scratch: Scratch | None = None,
    ) -> None:
        """Staging for chunks of up to max_elems elements; an fp32 gradient for those in fp32
        formats (up to plain_elems, default max_elems); and for split masters whose working
        weights are on the GPU a second pinned buffer per slot that brings them down (up to
        weight_elems). `scratch`: the compact formats' pieces (engine/formats/compact.py)."""
        self.disk, self.scratch = disk, scratch
        self.cuda = device.type == "cuda"
        if self.cuda and device.index is None:  # the worker selects it: torch needs the index
            device = torch.device("cuda", torch.cuda.current_device())
        self.device = device
        # gradients down and weights up on separate side streams: a copy up never queues behind
        # a gradient's copy down, which waits for a point of the backward not reached yet
        self.stream = torch.cuda.Stream(device) if self.cuda else None
        self.up_stream = torch.cuda.Stream(device) if self.cuda else None
        self.staging = [
            torch.empty(max_elems, dtype=dtype, pin_memory=self.cuda) for _ in range(slots)
        ]
        self.wstaging = [
            torch.empty(weight_elems, dtype=dtype, pin_memory=self.cuda) for _ in range(slots)
        ] if weight_elems else []  # fmt: skip
        # a guarded (speculative) job's gradient norm per slot, computed on the GPU beside its
        # copy down: the worker's finiteness check is one read, not a pass over host memory (that
        # pass ran on the host's threads during the backward, and slowed the update 3x there)
        self.norms = torch.zeros(slots, dtype=torch.float32, pin_memory=self.cuda)
        self.norms_np = self.norms.numpy()
        plain = max_elems if plain_elems is None else plain_elems
        self.g32 = torch.empty(plain, dtype=torch.float32)  # the worker's own fp32 gradient
        self.free: queue.Queue[int] = queue.Queue()
        for i in range(slots):
            self.free.put(i)
        self.jobs: queue.Queue = queue.Queue()
        # submitted chunks waiting for a staging slot, and the gradient copies of staged ones
        # the compute stream has not yet been made to wait for (flush)
        self.lock = threading.Lock()
        self.slot_freed = threading.Condition(self.lock)
        self.ready: list[_Job] = []
        self.copied: list[torch.cuda.Event] = []
        self.pending: dict[int, _Done] = {}  # chunk index -> its update's completion
        self.error: BaseException | None = None
        self.busy_s = 0.0  # worker time spent in AdamW and conversions (for the step breakdown)
        self.wait_s = 0.0  # time the main thread waited for the worker
        self.disk_wait_s = 0.0  # worker time spent waiting for the nvme tier's reads and writes
        self.slot_wait_s = 0.0  # main-thread time blocked in submit() for a free staging slot
        self.d2h_s = self.h2d_s = 0.0  # side-stream copy time (CUDA events), gradients / weights
        self.thread = threading.Thread(target=self._run, name="fitgpt-host-adamw", daemon=True)
        self.thread.start()
        # stop the worker before interpreter shutdown: a thread killed inside torch's CPU kernels
        # aborts the process
        atexit.register(_stop, weakref.ref(self))

    # ---- main thread ----------------------------------------------------------------------------
    def submit(
        self,
        c: Chunk,
        lr: float,
        grad_mul: float | None,
        target: Tensor,
        undo_mul: float | None = None,
        guarded: bool = False,
    ) -> None:
        """Queue chunk c's update (its optimizer, over its param groups); it starts as soon as a
        staging slot is free. Its gradient must be final now: on CUDA an event marks the point
        of the compute stream after which it is. `target` receives its new weights: the device
        weights, or a host buffer (streamed weights). undo_mul: undo the chunk's last step first
        (it used the same gradient times undo_mul; engine/formats/speculate.py); grad_mul None then
        takes no new step. guarded: skip the step if the gradient is not finite (a speculative
        update before the overflow check: NaN state cannot be undone). Call flush() before the
        gradients are zeroed."""
        ready = None
        if self.cuda:
            ready = torch.cuda.Event()
            ready.record(torch.cuda.current_stream(self.device))
        job = _Job(c, lr, grad_mul, target, ready, undo_mul, guarded)
        with self.lock:
            self.pending[c.spec.index] = job.done
            self.ready.append(job)
        self._pump()

    def flush(self) -> None:
        """Wait until every queued chunk has its gradient staged, and (CUDA) make the compute
        stream wait for those copies: after this the gradients may be zeroed."""
        t0 = time.perf_counter()
        with self.slot_freed:
            while self.ready and self.error is None:
                if not self.slot_freed.wait(0.5) and not self.thread.is_alive():
                    self.error = RuntimeError("the host optimizer's worker thread has stopped")
            copied, self.copied = self.copied, []
        self.slot_wait_s += time.perf_counter() - t0
        if self.error is not None:
            raise RuntimeError("the host optimizer failed") from self.error
        if self.cuda:
            stream = torch.cuda.current_stream(self.device)
            for ev in copied:
                stream.wait_event(ev)

    def _pump(self) -> None:
        """Stage queued chunks while slots are free (the main thread after submit(), the worker
        after each job): earliest deadline first, i.e. the chunk the next forward needs first
        (the lowest index), so the forward waits least."""
        with self.lock:
            while self.ready and not self.free.empty():
                job = min(self.ready, key=lambda j: j.c.spec.index)
                self.ready.remove(job)
                slot = self.free.get_nowait()
                try:
                    self._stage(job, slot)
                except BaseException as e:  # e.g. no host RAM for a disk-homed chunk's state
                    # nobody would ever finish this job: fail it, so its waiters raise
                    self.error = self.error or e
                    self.free.put(slot)
                    job.done.flag.set()
                    self.slot_freed.notify_all()
                    if threading.current_thread() is not self.thread:
                        raise
                    return
                self.jobs.put(job)

    def _stage(self, job: _Job, slot: int) -> None:
        """Copy the job's gradient (and a split master's working weights) into pinned staging
        slot `slot`; on a side stream after its ready event (CUDA), so the GPU keeps working."""
        c = job.c
        src = c.opt_grad
        job.slot, job.buf = slot, self.staging[slot][: src.numel()]
        # a split master's high half: the working weights, brought down beside the gradient
        if c.compact is not None and c.compact.master == "split" and job.target.is_cuda:
            job.wbuf = self.wstaging[slot][: src.numel()]
        job.out = job.buf
        if self.cuda:
            with torch.cuda.stream(self.stream):
                self.stream.wait_event(job.ready)  # the gradient is final
                d2h = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
                d2h[0].record(self.stream)  # timing only: the copy's own span, not its queueing
                job.buf.copy_(src, non_blocking=True)
                if job.wbuf is not None:
                    job.wbuf.copy_(job.target, non_blocking=True)
                if job.guarded:  # non-finite iff an element is (or it overflows fp32: see _step)
                    norm = torch.linalg.vector_norm(src, dtype=torch.float32)
                    self.norms[slot].copy_(norm, non_blocking=True)
                d2h[1].record(self.stream)
            job.d2h = d2h
            self.copied.append(d2h[1])  # flush(): the compute stream zeroes gradients after this
        else:
            job.buf.copy_(src)
            if job.wbuf is not None:
                job.wbuf.copy_(job.target)
        # a disk-homed chunk's reads start now and overlap the worker's update of earlier chunks
        job.reads = self.disk.read_in_async(c) if c.on_disk else []

    def wait(self, c: Chunk) -> bool:
        """Make the compute stream wait for chunk c's new weights (the host waits only if the
        worker has not finished the chunk yet). False if its update took no step (a guarded
        update whose gradient was not finite)."""
        done = self.pending.pop(c.spec.index, None)
        if done is None:
            return True
        self._wait_done(c, done)
        if done.h2d is not None:
            torch.cuda.current_stream(self.device).wait_event(done.h2d)
        return done.stepped

    def _wait_done(self, c: Chunk, done: _Done) -> None:
        t0 = time.perf_counter()
        # a failed worker may never set this job's flag: poll for its error, and for its end
        while not done.flag.wait(0.5) and self.error is None:
            if not self.thread.is_alive() and not done.flag.is_set():  # (its own error first)
                self.error = self.error or RuntimeError(
                    "the host optimizer's worker thread has stopped"
                )
        self.wait_s += time.perf_counter() - t0
        if self.error is not None:
            raise RuntimeError(f"the host optimizer failed on {c.spec.name}") from self.error

    def drain(self, chunks: list[Chunk]) -> None:
        for c in chunks:
            self.wait(c)

    def close(self) -> None:
        if self.thread.is_alive():
            self.jobs.put(None)
            self.thread.join()
        if self.disk is not None:
            self.disk.close()  # after the worker: no transfer is left running on its files

    def __del__(self) -> None:
        if getattr(self, "thread", None) is not None and self.thread.is_alive():
            self.jobs.put(None)

    # ---- worker thread --------------------------------------------------------------------------
    def _run(self) -> None:
        try:
            self._serve()
        except BaseException as e:  # the worker is gone: every waiter must raise, not hang
            self.error = self.error or e
            with self.slot_freed:
                self.slot_freed.notify_all()

    def _serve(self) -> None:
        if self.cuda:  # a new thread starts on GPU 0: a context there per rank otherwise
            torch.cuda.set_device(self.device)
        while True:
            job = self.jobs.get()
            if job is None:
                return
            try:
                if self._step(job):
                    self._copy_back(job)
                elif job.c.on_disk:
                    job.c.free_state()  # read in for nothing: the files still hold it
            except BaseException as e:  # surfaced to the main thread at its next wait()
                self.error = e
            finally:
                self.free.put(job.slot)
                job.done.flag.set()
            try:
                self._pump()  # the freed slot takes the next queued chunk at once
            except BaseException as e:
                self.error = e
            with self.slot_freed:
                self.slot_freed.notify_all()

    def _step(self, job: _Job) -> bool:
        """Wait for the gradient (and a disk-homed chunk's state), then AdamW in host RAM.
        False if a guarded job's gradient is not finite: no step, nothing to copy back."""
        c = job.c
        if job.d2h is not None:
            job.d2h[1].synchronize()  # host waits for the gradient to land
            self.d2h_s += job.d2h[0].elapsed_time(job.d2h[1]) / 1000.0
        t_io = time.perf_counter()
        for f in job.reads:
            f.result()  # the chunk's state, read from disk
        self.disk_wait_s += time.perf_counter() - t_io
        t0 = time.perf_counter()
        # speculative steps only. A norm that overflows fp32 while every element is finite skips
        # the step too; the global norm, the same sum, then overflows and no chunk steps. On the
        # host (CPU engines): one pass over the working-dtype gradient
        if job.guarded and not self._grad_finite(job):
            job.done.stepped = False
            return False
        if c.compact is not None:
            self._step_compact(job)
        else:
            self._step_fp32(job)
        self.busy_s += time.perf_counter() - t0
        return True

    def _grad_finite(self, job: _Job) -> bool:
        return math.isfinite(self.norms_np[job.slot]) if self.cuda else _finite(job.buf)

    def _step_fp32(self, job: _Job) -> None:
        c, buf = job.c, job.buf
        g = self.g32[: buf.numel()]
        opt = c.optimizer
        # a speculative step that guessed wrong (engine/chunked/update.py)
        if job.undo_mul is not None:
            upcast_scaled(buf, job.undo_mul, g)
            undo_optimizer_(opt, g, c.group_ranges, job.lr, piece_elems(g.device))
        if job.grad_mul is not None:
            upcast_scaled(buf, job.grad_mul, g)
            for group, (lo, hi) in zip(opt.param_groups, c.group_ranges):
                group["lr"] = job.lr
                group["params"][0].grad = g[lo:hi]
            opt.step()
            for group in opt.param_groups:
                group["params"][0].grad = None
        # fp32 master → working dtype: into the staging buffer for the GPU, or straight
        # into a host target (streamed weights)
        buf.copy_(c.master) if job.target.is_cuda else job.target.copy_(c.master)

    def _step_compact(self, job: _Job) -> None:
        """Compact formats (engine/formats/compact.py): stepped piece by piece in the worker's
        scratch. The new weights go where the fp32 path puts them; a split master reads its high
        half from there first (a host target holds it already; device weights came down in wbuf)."""
        out = job.target if not job.target.is_cuda else job.buf
        if job.wbuf is not None:
            out = job.wbuf  # the high half in, the new weights out; copied up from here
        job.c.compact.step(out, job.buf, job.grad_mul, job.lr, self.scratch, job.undo_mul)
        job.out = out

    def _copy_back(self, job: _Job) -> None:
        """The new weights to a device target (side stream), and a disk-homed state written out."""
        if job.target.is_cuda:
            with torch.cuda.stream(self.up_stream):
                h2d_start = torch.cuda.Event(enable_timing=True)
                h2d_start.record(self.up_stream)
                job.target.copy_(job.out, non_blocking=True)
                h2d = torch.cuda.Event(enable_timing=True)
                h2d.record(self.up_stream)
            h2d.synchronize()  # the staging buffer is reusable only after this copy
            self.h2d_s += h2d_start.elapsed_time(h2d) / 1000.0
            job.done.h2d = h2d  # the main thread may already be waiting on `done`
        if job.c.on_disk:
            t_io = time.perf_counter()
            self.disk.write_out(job.c)
            self.disk_wait_s += time.perf_counter() - t_io


@dataclass
class _Done:
    """A submitted chunk's completion: `flag` is set by the worker once the chunk is updated,
    after it has filled in `h2d` (the host→device copy's event; None for a host target)."""

    flag: threading.Event = field(default_factory=threading.Event)
    h2d: torch.cuda.Event | None = None
    stepped: bool = True  # False: a guarded job found a non-finite gradient and took no step


@dataclass
class _Job:
    """One chunk's host update, from submit() to the worker (the staging fields are filled in
    when a slot is free: _stage)."""

    c: Chunk
    lr: float
    grad_mul: float | None  # clip coefficient / loss scale; None: no new step (undo only)
    target: Tensor  # receives the new weights: device weights, or a host buffer
    ready: torch.cuda.Event | None  # CUDA: the compute stream's point where the gradient is final
    undo_mul: float | None = None  # undo the last step (its gradient times this) first
    guarded: bool = False  # skip the step if the gradient is not finite
    slot: int = -1  # index of the staging buffer, returned to `free` when the job ends
    buf: Tensor | None = None  # that buffer: the gradient, then the new weights (working dtype)
    d2h: tuple[torch.cuda.Event, torch.cuda.Event] | None = None  # the gradient copy's events
    reads: list[concurrent.futures.Future] = field(default_factory=list)  # disk-homed state
    wbuf: Tensor | None = None  # a split master's working weights, brought down (pinned)
    out: Tensor | None = None  # the new weights for a device target: buf, or wbuf
    done: _Done = field(default_factory=_Done)


def _finite(t: Tensor) -> bool:
    """Whether every element of a host tensor is finite, piece by piece (isfinite's bool result
    would otherwise be a transient of one byte per element, in host RAM)."""
    P = piece_elems(t.device)
    return all(bool(torch.isfinite(t[lo : lo + P]).all()) for lo in range(0, len(t), P))


def _stop(ref: weakref.ref) -> None:
    opt = ref()
    if opt is not None:
        opt.close()
