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

What to change depends on the cause (DivergenceGuard.advice): an fp16 run whose updates are
skipped with a finite loss overflowed fp16's range (its loss scale, or its gradients at any
scale); a NaN/inf loss, or a non-finite gradient in bf16/fp32, came from updates too large for
the weights (the rate and its warm-up).

Spikes. A finite loss that stays above SPIKE_RATIO times the run's first loss for SPIKE_STEPS
steps in a row means the updates have undone more than the run learned: at the start the loss is
about ln(vocabulary), and a run that trains never comes back above it. The run goes on (it may
recover), but the log names it once, with what to change.

Signals. The first SIGINT (Ctrl-C) or SIGTERM asks the loop to stop after the current step; the
trainer then saves and prints the resume command. A second one interrupts at once. Before the
first step (start-up: rendezvous, building the model, reading a checkpoint) either one stops at
once (StartupStop): there is nothing to save, and the run folder is put back as it was.
"""

from __future__ import annotations

import contextlib
import math
import signal
import threading
from collections.abc import Iterator

from fitgpt.dist import DistContext
from fitgpt.engine.comm import all_ok
from fitgpt.errors import UserError


class Diverged(UserError):
    """The loss was NaN/inf, or the updates skipped, for --max-bad-steps steps in a row."""


class Interrupted(KeyboardInterrupt):
    """A signal stopped the run; the message says what was saved and how to resume."""


# A loss above 1.1x the run's first for 5 steps in a row is a spike the run has not recovered
# from: batch-to-batch noise stays within a few percent, so five in a row above the margin do not
# happen by chance, and 5 steps of a 40+ loss are enough to call it.
SPIKE_RATIO = 1.1
SPIKE_STEPS = 5
# fp16's default initial loss scale: a run that still overflows above it was started too high
DEFAULT_SCALE = 2.0**16


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
        self.last_scale = 1.0
        self.last_step = 0
        self.nonfinite_in_streak = False  # a NaN/inf loss among the bad steps
        self.start_loss: float | None = None  # the first finite loss of this process's run
        self.start_step = 0
        self.above = 0  # steps in a row with a loss above SPIKE_RATIO x start_loss
        self.spike_named = False
        self._spike_now = False

    def record(self, step: int, loss: float, skipped: bool, loss_scale: float = 1.0) -> None:
        self.last_loss, self.last_skipped, self.last_scale = loss, skipped, loss_scale
        self.last_step = step
        finite = math.isfinite(loss)
        self._track_spike(step, loss, finite)
        self.healthy = finite and not (skipped and not self.dynamic_scale)
        if finite and not skipped:
            self.streak, self.first_unhealthy = 0, None
            self.nonfinite_in_streak = False
            return
        if self.streak == 0:
            self.first_bad = step
        self.streak += 1
        self.nonfinite_in_streak |= not finite
        if not self.healthy and self.first_unhealthy is None:
            self.first_unhealthy = step

    def _track_spike(self, step: int, loss: float, finite: bool) -> None:
        self._spike_now = False
        if not finite:
            return
        if self.start_loss is None:
            self.start_loss, self.start_step = loss, step
            return
        self.above = self.above + 1 if loss > SPIKE_RATIO * self.start_loss else 0
        if self.above >= SPIKE_STEPS and not self.spike_named:
            self.spike_named = self._spike_now = True

    def spike_line(self, lr: float, peak: float, warmup: int) -> str | None:
        """The one log line naming a spike, on the step it is confirmed; None otherwise."""
        if not self._spike_now:
            return None
        return (
            f"step {self.last_step}: the loss has stayed above step {self.start_step}'s "
            f"{self.start_loss:.4g} for {self.above} steps (now {self.last_loss:.4g}): the "
            f"updates undo what the run learns; {self.advice(lr, peak, warmup)}"
        )

    def advice(self, lr: float, peak: float, warmup: int) -> str:
        """What to change, by the cause of the latest trouble: fp16's range, or the rate."""
        fp16_overflow = (
            self.dynamic_scale
            and self.streak > 0
            and self.last_skipped
            and not self.nonfinite_in_streak
        )
        if fp16_overflow and self.last_scale >= DEFAULT_SCALE:
            return (
                f"the fp16 loss scale is still {self.last_scale:g} after {self.streak} "
                "overflows: lower --initial-scale (65536 is the default)"
            )
        if fp16_overflow:
            return (
                f"the gradients overflow fp16 even at a loss scale of {self.last_scale:g}: "
                "train in --precision bf16 (or fp32), not by lowering --lr"
            )
        return f"lower --lr (peak {peak:.3g}, now {lr:.3g}) or raise --warmup (now {warmup} steps)"

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
        from fitgpt.procs import startup_over

        if threading.current_thread() is threading.main_thread():
            self._previous = {s: signal.signal(s, self._handle) for s in self.SIGNALS}
        startup_over()  # from here a stop saves (before, it stopped at once: startup_stops)
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


class StartupStop(KeyboardInterrupt):
    """SIGINT or SIGTERM before the first step: nothing was saved; `code` is the exit status."""

    def __init__(self, signum: int) -> None:
        self.signum = signum
        self.code = 128 + signum  # 130 for SIGINT, 143 for SIGTERM
        name = signal.Signals(signum).name
        super().__init__(
            f"stopped by {name} during start-up, before the first step; nothing was saved "
            "(run the same command to start again)"
        )


@contextlib.contextmanager
def startup_stops() -> Iterator[None]:
    """Inside the block, SIGINT and SIGTERM raise StartupStop: SIGTERM's default would end the
    process at once, skipping the `finally` blocks that release --out's lock and remove a run
    folder this run created (procs.stop_on_sigterm makes it raise as Ctrl-C does)."""
    from fitgpt.procs import Stopped, in_startup, stop_on_sigterm

    with stop_on_sigterm():
        try:
            yield
        except (StartupStop, Interrupted):
            raise
        except KeyboardInterrupt as e:
            if not in_startup():  # after the loop (its final save): a stop as before
                raise
            raise StartupStop(signal.SIGTERM if isinstance(e, Stopped) else signal.SIGINT) from None
