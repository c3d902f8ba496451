"""Capacity search: the largest model of a width that really trains here.

Every trial is a short real training run in its own process (the benchmark harness's trial), so
an out-of-memory failure cannot poison the next one. The search starts at the memory model's
prediction, walks up (or down) in steps until it brackets the boundary, then bisects: the number
of trials is logarithmic in how far the prediction was off, and capped.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field


@dataclass
class SearchResult:
    largest_ok: int  # 0 when even the smallest size failed
    first_fail: int | None  # None when the search never saw a failure
    trials: list[tuple[int, bool]] = field(default_factory=list)


def search(
    trial: Callable[[int], bool],
    start: int,
    max_trials: int = 8,
    step: int | None = None,
    lo_limit: int = 1,
    hi_limit: int = 4096,
) -> SearchResult:
    """Largest n in [lo_limit, hi_limit] with trial(n) True, assuming trials are monotone."""
    seen: dict[int, bool] = {}

    def run(n: int) -> bool:
        if n not in seen:
            seen[n] = trial(n)
        return seen[n]

    step = step or max(1, start // 8)
    n = max(lo_limit, min(start, hi_limit))
    ok, bad = None, None
    if run(n):
        ok = n
        while len(seen) < max_trials and ok < hi_limit:
            nxt = min(hi_limit, ok + step)
            if run(nxt):
                ok, step = nxt, step * 2
            else:
                bad = nxt
                break
    else:
        bad = n
        while len(seen) < max_trials and bad > lo_limit:
            nxt = max(lo_limit, bad - step)
            if run(nxt):
                ok = nxt
                break
            bad, step = nxt, step * 2
    while ok is not None and bad is not None and bad - ok > 1 and len(seen) < max_trials:
        mid = (ok + bad) // 2
        if run(mid):
            ok = mid
        else:
            bad = mid
    return SearchResult(ok or 0, bad, sorted(seen.items()))
