"""Capacity search: the largest model of a width that really trains here.

Every trial is a short real training run in its own process (the benchmark harness's trial), so
an out-of-memory failure cannot poison the next one. The search starts at the memory model's
prediction, walks up (or down) in steps until it brackets the boundary, then bisects: the number
of trials is logarithmic in how far the prediction was off, and capped.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from fitgpt import units


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


# ---- the search over real trials, with the planner's prediction beside each ----------------------
@dataclass
class Capacity:
    """What `fitgpt capacity` found: the search, and every trial's record by layer count."""

    result: SearchResult
    records: dict[int, dict]

    def best(self) -> dict | None:
        return self.records.get(self.result.largest_ok)

    def summary(self, system: str) -> dict:
        best = self.best() or {}
        keys = ("params", "tflops", "tokens_per_s", "gpu_peak_gib", "host_rss_peak_gib")
        return {
            "system": system,
            "largest_layers": self.result.largest_ok,
            **{k: best.get(k) for k in keys},
            "predicted_peak_gib": best.get("predicted_peak_gib"),
            "formats": formats_of(best),
            "first_fail": self.result.first_fail,
            "trials": len(self.result.trials),
        }


def formats_of(record: dict) -> dict | None:
    """{master, moments, device_moments} of the engine a trial ran (None for peers' trials)."""
    from fitgpt.plan.formats import FIELDS

    engine = record.get("engine")
    return {k: engine.get(k) for k in FIELDS} if isinstance(engine, dict) else None


def describe_formats(f: dict | None) -> str:
    """ "master split, moments bf16 (offloaded) / fp32 (on the device)", or "" when unknown."""
    if not f:
        return ""
    return (
        f"master {f['master']}, moments {f['moments']} (offloaded) / {f['device_moments']} "
        "(on the device)"
    )


def predicted_plan(run, hw, rates, fixed):
    """The plan the planner chooses for `run` here (a Candidate; it may not fit)."""
    from fitgpt.plan.apply import plan_run

    return plan_run(run, hw, rates, fixed).best


def predicted_peak_gib(run, hw, rates, fixed) -> float:
    """The chosen plan's predicted peak per rank (GPU allocator peak, or host RAM on CPUs)."""
    from fitgpt.plan.memory import GiB

    est = predicted_plan(run, hw, rates, fixed).est
    return (est.compute_peak if est.compute else est.host_total) / GiB


def predicted_largest(run, hw, rates, fixed) -> int:
    """The most layers of `run`'s width that the planner predicts to fit here (at least 1)."""
    from fitgpt.plan.apply import workload_of
    from fitgpt.plan.planner import largest_layers

    work = workload_of(run, hw.gpus, hw.device)
    return max(1, largest_layers(work, run.train.grad_accum, hw, rates, fixed))


def find_capacity(
    trial: Callable[[int], dict],
    start: int,
    max_trials: int,
    predicted: Callable[[int], float | None],
    log: Callable[[str], None] = print,
) -> Capacity:
    """Search (above) with `trial(layers)` a real training run's record (status "ok" when it
    trained); each record gets the prediction beside its measured peak, and one log line."""
    records: dict[int, dict] = {}

    def run(layers: int) -> bool:
        rec = trial(layers)
        rec["kind"] = "capacity"
        what = f"{layers} layers ({units.params(rec['params'])})"
        return _recorded(records, layers, rec, predicted(layers), what, log)

    return Capacity(search(run, start, max_trials), records)


def _recorded(records: dict, key: int, rec: dict, pred: float | None, what: str, log) -> bool:
    """One search trial: its record kept under `key` with the predicted peak beside the
    measured one, one log line; whether it trained."""
    rec["predicted_peak_gib"] = pred
    records[key] = rec
    mem = rec.get("gpu_peak_gib", rec.get("host_rss_peak_gib", 0))
    why = "" if rec["status"] == "ok" else ": " + rec["reason"][:100]
    log(
        f"  trial {len(records)}: {what} {rec['status']}{why}; measured peak {mem:.1f} GiB, "
        f"predicted {pred if pred is None else f'{pred:.1f} GiB'}"
    )
    return rec["status"] == "ok"


# ---- the longest sequence that trains at a fixed model (`fitgpt capacity --search seq-len`) -----
def predicted_longest_seq(run_at, hw, rates, fixed, quantum: int, limit: int) -> int:
    """The longest sequence, a multiple of `quantum` up to `limit`, that the planner predicts to
    fit here (at least one quantum); `run_at(seq)`: the run at that sequence length."""
    from fitgpt.plan.apply import workload_of
    from fitgpt.plan.planner import largest_seq_len

    run = run_at(limit)
    work = workload_of(run, hw.gpus, hw.device)
    below = limit + quantum  # limit itself may fit
    seq = largest_seq_len(work, run.train.grad_accum, hw, rates, fixed, below, quantum)
    return max(quantum, seq)


def find_longest_seq(
    trial: Callable[[int], dict],
    start: int,
    quantum: int,
    max_trials: int,
    predicted: Callable[[int], float | None],
    limit: int,
    log: Callable[[str], None] = print,
) -> Capacity:
    """The search above over sequence lengths in multiples of `quantum` (from `start`, the
    prediction, galloping by doubling steps, then bisecting), `trial(seq)` a real training
    run's record; the Capacity's sizes (largest_ok, first_fail, records' keys) are tokens."""
    records: dict[int, dict] = {}

    def run(k: int) -> bool:
        seq = k * quantum
        rec = trial(seq)
        rec["kind"] = "capacity-seq"
        rec["seq_len"] = seq
        return _recorded(records, seq, rec, predicted(seq), f"seq {seq}", log)

    res = search(run, max(1, start // quantum), max_trials, hi_limit=max(1, limit // quantum))
    fail = None if res.first_fail is None else res.first_fail * quantum
    tokens = SearchResult(
        res.largest_ok * quantum, fail, [(k * quantum, ok) for k, ok in res.trials]
    )
    return Capacity(tokens, records)
