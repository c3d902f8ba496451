"""How many torch threads a CPU training process uses: only the cores nobody else is using.

PyTorch's CPU kernels run on OpenMP threads, one per core by default, and the threads of one
operation wait for each other by spinning. When another program holds one of the cores, the
thread sharing it is descheduled for whole time slices while its partner spins: on the 2-core
box, shared with other work, the demo's steps took 1.6-5x longer with 2 threads than with 1
(benchmarks/results/demo_cpu_2026-11-23/). On an idle box every core is kept (the script's
row without competing processes measures that case when the box is quiet). The rule counts the cores that are busy at start-up, rounds up, and leaves them alone:

    threads = max(1, min(cores per process, cores - busy cores rounded up))

`fitgpt.dist.env.configure_process` applies it to CPU runs, after `--cpu-threads` and a user's
OMP_NUM_THREADS; GPU runs share the cores out between their ranks instead (their CPU threads
serve the host optimizer of the offload tier).
"""

from __future__ import annotations

import math
import os
import statistics
import time

import torch

# A core counts as busy when other programs used more than this share of it while we looked:
# background daemons use a few percent, a competing job most of a core.
BUSY_THRESHOLD = 0.25
SAMPLE_S = 0.5  # how long start-up looks at the machine; costs this much once per run


def _cpu_times() -> tuple[float, float] | None:
    """(busy, total) jiffies of all cores from /proc/stat, or None where there is none."""
    try:
        with open("/proc/stat") as f:
            fields = [float(x) for x in f.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0.0)  # idle + iowait
    total = sum(fields[:8])  # guest time is already counted in user time
    return total - idle, total


def busy_cores(sample_s: float = SAMPLE_S) -> float | None:
    """Cores' worth of CPU other programs use now (this process is idle while it looks), from
    a short sample of /proc/stat. Not the load average: it trails the machine by a minute, so
    right after a busy spell an idle box read as busy and the demo took one thread instead of
    two (170 s instead of ~110; benchmarks/results/demo_cpu_quiet_2026-11-23)."""
    a = _cpu_times()
    time.sleep(sample_s)
    b = _cpu_times()
    if a is None or b is None or b[1] <= a[1]:
        return None
    return (os.cpu_count() or 1) * (b[0] - a[0]) / (b[1] - a[1])


def cores_available() -> int:
    """Cores fitgpt shares out between this machine's ranks: FITGPT_CPU_CORES if set (to keep
    cores for other work), else the cores this process may run on (its CPU affinity, which
    containers and taskset narrow)."""
    if os.environ.get("FITGPT_CPU_CORES", "").isdigit() and int(os.environ["FITGPT_CPU_CORES"]):
        return int(os.environ["FITGPT_CPU_CORES"])
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def cpu_threads(local_ranks: int = 1, busy: float | None = None) -> int:
    """Torch threads for each of `local_ranks` CPU training processes on this machine."""
    cores = cores_available()
    per_rank = max(1, cores // max(1, local_ranks))
    if busy is None:
        return per_rank
    taken = math.ceil(busy - BUSY_THRESHOLD) if busy > BUSY_THRESHOLD else 0
    return max(1, min(per_rank, cores - taken))


# ---- while the run trains ---------------------------------------------------------------------
# The start-up sample sees half a second of the machine; a competing job that was idle then
# (between its own steps, or starting later) makes every step of a 2-thread run spin behind it,
# 20-70x slower than one thread (issue 33). So a CPU run whose threads fitgpt chose keeps
# timing itself and keeps whichever of two counts is faster. Trying FEWER threads is cheap (on
# an idle box one thread is at most ~2x slower than two): it is tried early, after a few steps.
# Trying MORE threads on a loaded box can cost a 70x step, so the first such try waits until
# that loss is within PROBE_BUDGET of the steps run (~1,400 steps), and a try that loses, in
# either direction, is repeated only once its loss again fits that budget. The demo under two
# busy jobs therefore never tries a second thread (measured: default and --cpu-threads 1 took
# the same time), while a load that starts after start-up is left within ~7 steps.
SETTLE_STEPS = 1  # the first steps allocate and warm caches: not timed
SAMPLE_STEPS = 3  # steps timed at each count (median)
FIRST_PERIOD = 20  # steps before the next try of fewer threads, at first
WORST_SLOWDOWN = 70  # the slowest step more threads gave on a loaded box (issue 33)
PROBE_BUDGET = 0.05  # a losing try may cost at most this share of the steps until the next one
FIRST_UP = math.ceil(WORST_SLOWDOWN / PROBE_BUDGET)  # steps before the first try of more threads
MAX_PERIOD = 2000
SWITCH_GAIN = 0.9  # the other count must be 10% faster to switch (step times jitter)
GIVE_UP = 1.5  # a first tried step this much slower than the current median ends the try
DOWN, UP = -1, 1


class ThreadTuner:
    """Keeps a CPU run on the faster of its thread count and half or twice it, by timing its own
    steps. `after_step(dt)` returns a one-line note when it switches, else None. Inactive (never
    changes anything) when `active` is False: a GPU run, or threads a user set. Costs a median
    of three floats per step."""

    def __init__(self, threads: int, most: int, active: bool) -> None:
        self.current, self.most = threads, most
        self.active = active and most > 1
        self.seen = 0  # steps observed
        self.times: list[float] = []  # the current count's recent steps
        self.trying: tuple[int, int] | None = None  # (direction, count) under trial, if any
        self.tried: list[float] = []
        self.period = {DOWN: FIRST_PERIOD, UP: FIRST_UP}
        self.due = {DOWN: SETTLE_STEPS + SAMPLE_STEPS, UP: FIRST_UP}  # step of each next try

    def _count(self, direction: int) -> int:
        return max(1, self.current // 2) if direction == DOWN else min(self.most, 2 * self.current)

    def after_step(self, dt: float) -> str | None:
        if not self.active:
            return None
        self.seen += 1
        if self.seen <= SETTLE_STEPS:
            return None
        if self.trying is not None:
            return self._judge(dt)
        self.times = [*self.times, dt][-SAMPLE_STEPS:]
        if len(self.times) < SAMPLE_STEPS:
            return None
        for direction in (DOWN, UP):
            n = self._count(direction)
            if n != self.current and self.seen >= self.due[direction]:
                self.trying, self.tried = (direction, n), []
                torch.set_num_threads(n)  # the next step runs with the other count
                break
        return None

    def _judge(self, dt: float) -> str | None:
        """One more step of the count under trial: keep trying, switch, or go back."""
        now = statistics.median(self.times)
        self.tried.append(dt)
        if dt < GIVE_UP * now and len(self.tried) < SAMPLE_STEPS:
            return None  # not clearly worse yet: time it again
        (direction, count), tried = self.trying, statistics.median(self.tried)
        self.trying = None
        if len(self.tried) == SAMPLE_STEPS and tried < SWITCH_GAIN * now:
            old, self.current, self.times = self.current, count, self.tried
            # the machine changed: look again soon for fewer threads, late for more
            self.period = {DOWN: FIRST_PERIOD, UP: FIRST_UP}
            self.due = {DOWN: self.seen + FIRST_PERIOD, UP: self.seen + FIRST_UP}
            return (
                f"CPU threads {old} → {count}: {tried * 1000:.0f} ms per step with {count} "
                f"against {now * 1000:.0f} ms with {old} (other programs' use of the cores "
                "changed; --cpu-threads fixes the count)"
            )
        torch.set_num_threads(self.current)
        # the try lost: wait long enough that its cost stays within PROBE_BUDGET of the steps
        lost = max(0.0, sum(self.tried) / now - len(self.tried))
        period = max(2 * self.period[direction], math.ceil(lost / PROBE_BUDGET))
        self.period[direction] = min(MAX_PERIOD, period)
        self.due[direction] = self.seen + self.period[direction]
        return None
