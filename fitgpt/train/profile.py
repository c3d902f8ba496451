"""`fitgpt train --profile N`: torch.profiler over N optimizer steps, a trace and a table.

Why: the log's ms/step says how fast a run is, not where the time goes: which kernels (matrix
products, attention, the fused elementwise work, the loss, the optimizer, copies), and how long
the GPU sits idle between them while the host launches the next. That decides the next speed-up,
and a user comparing fitgpt with another tool needs it on their own machine. torch.profiler does
the measuring; this only chooses the steps and writes the results.

Which steps: N steps from the process's fourth (its first steps compile, warm the allocator and
start the host optimizer), or the last N when the run is shorter. On rank 0 only. Written into
the run folder, each file through a temporary name: `profile/trace.json` (open it in
chrome://tracing or ui.perfetto.dev) and `profile/summary.txt` (the device-kernel share of the
profiled wall time, then the 30 ops with the most self time). Cost: the profiled steps run a few
percent slower and their log lines say so; a Chrome trace of a large model's step can take
hundreds of MB.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile

DEVICE = DeviceType.CUDA
SKIP = 3  # steps before profiling starts: compile, allocator warm-up, the host worker's start


class StepProfiler:
    """Start before step `first` and stop after step first + steps - 1 (0-based steps of this
    process), then write the trace and the table under `out`."""

    def __init__(self, steps: int, first_step: int, total: int, out: Path, device: torch.device):
        self.n = steps
        left = total - first_step
        self.start = first_step + (min(SKIP, left - steps) if left > steps else 0)
        self.stop = min(self.start + steps, total)
        self.out, self.device = out, device
        self.prof: profile | None = None
        self.t0 = 0.0

    def before(self, step: int) -> None:
        if self.n and step == self.start:
            acts = [ProfilerActivity.CPU]
            if self.device.type == "cuda":
                acts.append(ProfilerActivity.CUDA)
            self.prof = profile(activities=acts, record_shapes=False)
            self.prof.__enter__()
            self.t0 = time.perf_counter()

    def after(self, step: int) -> str | None:
        """After step `step`: the line to log when the profile was just written, else None."""
        if self.prof is None or step + 1 != self.stop:
            return None
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        wall = time.perf_counter() - self.t0
        self.prof.__exit__(None, None, None)
        prof, self.prof = self.prof, None
        folder = self.out / "profile"
        folder.mkdir(parents=True, exist_ok=True)
        trace = folder / "trace.json"
        tmp = folder / "trace.json.tmp"
        prof.export_chrome_trace(str(tmp))
        os.replace(tmp, trace)
        summary = self._summary(prof, wall, self.stop - self.start)
        tmp = folder / "summary.txt.tmp"
        tmp.write_text(summary)
        os.replace(tmp, folder / "summary.txt")
        return f"profile of steps {self.start + 1}-{self.stop}: {summary.splitlines()[0]}; {folder}"

    def _summary(self, prof, wall: float, steps: int) -> str:
        events = prof.key_averages()
        cuda = self.device.type == "cuda"
        key = "self_device_time_total" if cuda else "self_cpu_time_total"
        if cuda:  # the kernels' own spans (summed over streams: overlap can pass 100%)
            spans = [e.time_range.elapsed_us() for e in prof.events() if e.device_type == DEVICE]
            busy = sum(spans) / 1e6
            head = (
                f"{steps} step(s), {wall / steps:.3f} s each; {len(spans)} kernels, busy "
                f"{busy / wall:.0%} of the wall time"
            )
        else:
            busy = sum(e.self_cpu_time_total for e in events) / 1e6
            head = f"{steps} step(s), {wall / steps:.3f} s each; ops' own CPU time {busy:.2f} s"
        table = events.table(sort_by=key, row_limit=30)
        return head + "\n\n" + table + "\n"
