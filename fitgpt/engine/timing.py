"""Where a step's time goes, measured without adding host syncs.

CUDA events are recorded at the step's phase boundaries; their elapsed times are read one step
later, after the next step's own host sync has completed them. On CPUs the marks are wall-clock.
"""

from __future__ import annotations

import itertools
import time

import torch

PHASES = ("forward_backward", "reduce_and_norm", "update")


class StepClock:
    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.marks: dict[str, object] = {}
        self.last: dict[str, float] = {}  # seconds per phase of the last completed step

    def mark(self, name: str) -> None:
        if self.cuda:
            e = torch.cuda.Event(enable_timing=True)
            e.record()
            self.marks[name] = e
        else:
            self.marks[name] = time.perf_counter()

    def close_step(self) -> None:
        """Turn the marks of the previous step into seconds (call after a host sync)."""
        names = ("start", "backward_done", "synced", "updated")
        if not all(n in self.marks for n in names):
            return
        spans = {}
        for phase, (a, b) in zip(PHASES, itertools.pairwise(names)):
            ea, eb = self.marks[a], self.marks[b]
            if self.cuda:
                eb.synchronize()  # already complete one step later: returns at once
                spans[phase] = ea.elapsed_time(eb) / 1000.0
            else:
                spans[phase] = eb - ea
        self.last = spans
        self.marks = {}
