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
percent slower (their log lines are not marked); a Chrome trace of a large model's step can take
hundreds of MB. A run that stops inside the window (an error, a divergence, Ctrl-C) ends the
profiler and writes nothing. --profile is not kept for a resumed run.
"""

from __future__ import annotations

import os
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
        self.step_s = 0.0  # the profiled steps' own seconds (not evaluations or saves between)

    def before(self, step: int) -> None:
        if self.n and step == self.start:
            acts = [ProfilerActivity.CPU]
            if self.device.type == "cuda":
                acts.append(ProfilerActivity.CUDA)
            self.prof = profile(activities=acts, record_shapes=False)
            self.prof.__enter__()

    def after(self, step: int, seconds: float) -> str | None:
        """After step `step`, which took `seconds` (it ends in a host sync): the line to log
        when the profile was just written, else None."""
        if self.prof is None:
            return None
        self.step_s += seconds
        if step + 1 != self.stop:
            return None
        wall = self.step_s
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

    def close(self) -> None:
        """End a profile the run did not finish (it stopped inside the window): nothing written."""
        if self.prof is not None:
            prof, self.prof = self.prof, None
            prof.__exit__(None, None, None)

    def _summary(self, prof, wall: float, steps: int) -> str:
        events = prof.key_averages()
        cuda = self.device.type == "cuda"
        key = "self_device_time_total" if cuda else "self_cpu_time_total"
        if cuda:
            # kernels and copies on the device, not the device-side copies of record_function
            # ranges (which span the kernels they hold); busy = the union of the kernels' spans
            # over every stream, so overlap is counted once
            spans, copies = [], 0.0
            for e in prof.events():
                if e.device_type != DEVICE or e.is_user_annotation:
                    continue
                if e.name.startswith(("Memcpy", "Memset")):
                    copies += e.time_range.elapsed_us()
                else:
                    spans.append((e.time_range.start, e.time_range.end))
            busy = _union_us(spans) / 1e6
            head = (
                f"{steps} step(s), {wall / steps:.3f} s each; {len(spans)} kernels, busy "
                f"{busy / wall:.0%} of the steps' time; copies {copies / 1e6 / steps:.3f} s per "
                "step"
            )
        else:
            busy = sum(e.self_cpu_time_total for e in events) / 1e6
            head = f"{steps} step(s), {wall / steps:.3f} s each; ops' own CPU time {busy:.2f} s"
        table = events.table(sort_by=key, row_limit=30)
        return head + "\n\n" + table + "\n"


def _union_us(spans: list[tuple[float, float]]) -> float:
    """Microseconds covered by at least one of the [start, end) spans."""
    total, reach = 0.0, float("-inf")
    for a, b in sorted(spans):
        if b > reach:
            total += b - max(a, reach)
            reach = b
    return total
