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
import time

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


def cpu_threads(local_ranks: int = 1, busy: float | None = None) -> int:
    """Torch threads for each of `local_ranks` CPU training processes on this machine."""
    from fitgpt.dist.env import cores_available

    cores = cores_available()
    per_rank = max(1, cores // max(1, local_ranks))
    if busy is None:
        return per_rank
    taken = math.ceil(busy - BUSY_THRESHOLD) if busy > BUSY_THRESHOLD else 0
    return max(1, min(per_rank, cores - taken))
