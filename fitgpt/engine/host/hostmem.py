"""Host memory as the engine and the planner see it: what the machine can give now, and sizes.

The engine refuses a placement whose host state does not fit before it allocates anything
(engine/chunked/accounting.py), and the planner fits plans to the same figure (plan/hardware.py), so
both read it from here; the engine imports nothing from plan/.
"""

from __future__ import annotations

import re

from fitgpt.errors import UserError

UNITS = {
    "": 2**30,
    "k": 1e3,
    "kb": 1e3,
    "m": 1e6,
    "mb": 1e6,
    "g": 1e9,
    "gb": 1e9,
    "t": 1e12,
    "tb": 1e12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}


def parse_bytes(text: str, what: str) -> int:
    """'80GB' (10^9), '125GiB' (2^30), '64' (GiB). Raises a UserError naming `what`, also for
    sizes under one byte: a zero budget is never meant (it used to read as "unlimited")."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", text)
    if not m or m.group(2).lower() not in UNITS:
        raise UserError(f"{what} {text!r}: write a positive size like 80GB, 125GiB or 64 (GiB)")
    n = int(float(m.group(1)) * UNITS[m.group(2).lower()])
    if n < 1:
        raise UserError(
            f"{what} {text!r}: a size must be more than 0; give what the machine has "
            "(e.g. 64GB), or leave the flag out to measure it"
        )
    return n


# Host RAM a plan may fill: MemAvailable less a reserve for what the kernel and the process do
# besides holding state (page cache of the data and the disk tier, allocator slack, threads'
# stacks). Measured on the H100 box: 114 GiB of 122.7 available trained; 124.6 of 125 was
# OOM-killed. Costs ~6 GiB of capacity (~0.5 B parameters there).
HOST_RESERVE_FRACTION = 0.05
HOST_RESERVE_MIN = 4 << 30


def host_usable(stated: int = 0) -> int:
    """The host bytes a plan may fill now (0 when unknown): `stated` when the user stated it
    (`fitgpt train --cpu-mem`, which the run carries as EngineConfig.cpu_mem), else what the
    kernel says is available less a reserve."""
    if stated:
        return stated
    avail = host_available()
    return max(0, avail - max(HOST_RESERVE_MIN, int(HOST_RESERVE_FRACTION * avail))) if avail else 0


def host_available() -> int:
    """MemAvailable from /proc/meminfo (bytes), or 0 when unknown."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0
