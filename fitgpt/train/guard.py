"""What stops a run early: divergence (a NaN/inf loss or skipped steps, N in a row) and signals.

Divergence. A step is bad when its loss is not finite or its update was skipped (the engines
skip an update whose gradient norm is not finite). `--max-bad-steps` bad steps in a row end the
run in one line with a non-zero exit.

A step is also *unhealthy* when its loss is not finite, or its update was skipped without fp16's
dynamic loss scale to explain it (with bf16/fp32 a non-finite gradient means broken weights;
with fp16 an overflow is routine and only a long streak is bad). Nothing is saved while the
latest step is unhealthy. The loss of step k is that of the weights after k-1 updates, so the
checkpoint saved right before the first unhealthy step holds the weights that produced it: on
divergence that one is set aside as RUN/diverged.step_X (kept for inspection, never resumed).
The trainer deletes checkpoints beyond --keep only after a healthy step, so the one before it
(the last good one) is still there.

Signals. The first SIGINT (Ctrl-C) or SIGTERM asks the loop to stop after the current step; the
trainer then saves and prints the resume command. A second one interrupts at once.
"""

from __future__ import annotations

import math
import signal
import threading

from fitgpt.dist import DistContext
from fitgpt.errors import UserError
from fitgpt.train.consensus import all_ok


class Diverged(UserError):
    """The loss was NaN/inf, or the updates skipped, for --max-bad-steps steps in a row."""


class Interrupted(KeyboardInterrupt):
    """A signal stopped the run; the message says what was saved and how to resume."""


class DivergenceGuard:
    def __init__(self, max_bad: int, dynamic_scale: bool) -> None:
        self.max_bad = max_bad  # 0: never stop
        self.dynamic_scale = dynamic_scale  # fp16: a skipped step alone is routine
        self.streak = 0  # bad steps in a row, up to the latest
        self.first_bad = 0  # the step that began the streak
        self.first_unhealthy: int | None = None  # the streak's first unhealthy step
        self.healthy = True  # the latest step's weights may be saved
        self.last_loss = 0.0
        self.last_skipped = False

    def record(self, step: int, loss: float, skipped: bool) -> None:
        self.last_loss, self.last_skipped = loss, skipped
        finite = math.isfinite(loss)
        self.healthy = finite and not (skipped and not self.dynamic_scale)
        if finite and not skipped:
            self.streak, self.first_unhealthy = 0, None
            return
        if self.streak == 0:
            self.first_bad = step
        self.streak += 1
        if not self.healthy and self.first_unhealthy is None:
            self.first_unhealthy = step

    def why(self) -> str:
        """What was wrong with the latest step, for a log line."""
        if not math.isfinite(self.last_loss):
            return f"its loss is {self.last_loss}"
        return "its update was skipped (the gradient was not finite)"

    @property
    def tripped(self) -> bool:
        return self.max_bad > 0 and self.streak >= self.max_bad


class StopRequest:
    """SIGINT/SIGTERM handlers for the duration of a `with` block (main thread only)."""

    SIGNALS = (signal.SIGINT, signal.SIGTERM)

    def __init__(self) -> None:
        self.name: str | None = None  # the signal received, e.g. "SIGINT"
        self._previous: dict = {}

    def __enter__(self) -> StopRequest:
        if threading.current_thread() is threading.main_thread():
            self._previous = {s: signal.signal(s, self._handle) for s in self.SIGNALS}
        return self

    def __exit__(self, *exc) -> None:
        for s, h in self._previous.items():
            signal.signal(s, h)
        self._previous = {}

    def _handle(self, signum, frame) -> None:
        if self.name is not None:  # asked twice: stop now
            raise KeyboardInterrupt
        self.name = signal.Signals(signum).name

    def requested(self, ctx: DistContext) -> bool:
        """Whether any rank was signalled. Under torchrun the ranks may see a signal at
        different steps; they agree on it every step (a 4-byte all-reduce) so all stop at the
        same one."""
        return not all_ok(ctx, self.name is None, "stop request (SIGINT/SIGTERM)")
