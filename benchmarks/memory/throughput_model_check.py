"""The throughput model against a sweep: for every fitgpt trial that trained, the planner's
predicted step time for the plan it ran, beside the measured one, at the trial's world size and
with its card's default rates (a record's `device`: H100 or H200). Runs anywhere (no GPU needed).

Usage: python benchmarks/memory/throughput_model_check.py RESULTS.jsonl
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from fitgpt.bench.config import BenchConfig
from fitgpt.engine.config import EngineConfig
from fitgpt.plan import rates
from fitgpt.plan.memory import Workload
from fitgpt.plan.throughput import step_time


def engine_fields(rec: dict, layers: int) -> dict:
    """A trial record's engine config; records before 2026-11-23 kept the offloaded blocks as a
    share of them (offload_fraction, nvme_fraction), which stood for a whole number of blocks,
    and records before the delayed update's removal carry its two fields (off in every trial)."""
    rec = dict(rec)
    for removed in ("delayed_update", "delayed_update_after"):
        rec.pop(removed, None)
    share = rec.pop("offload_fraction", None)
    nvme = rec.pop("nvme_fraction", None)
    if share is not None:
        rec["offload_blocks"] = int(share * layers + 0.5)
        if nvme is not None:
            rec["nvme_blocks"] = int(nvme * rec["offload_blocks"] + 0.5)
    return rec


def main(path: str) -> None:
    print(
        f"{'system':<20}{'G':>2}{'L':>4}  {'plan':<34}{'measured s':>11}{'predicted s':>12}{'error':>8}"
    )
    errs = []
    for line in Path(path).read_text().splitlines():
        r = json.loads(line)
        if r["status"] != "ok" or "engine" not in r or r["engine"].get("engine") != "zero":
            continue
        bench = BenchConfig(**r.get("bench_effective", r["bench"]))
        ecfg = EngineConfig(**engine_fields(r["engine"], r["layers"]))
        prec = "fp32" if r["system"] == "fitgpt-no-mixed" else "bf16"
        world = r.get("world", 1)
        work = Workload(bench.model(r["layers"]), bench.micro_batch, world, prec, "cuda")
        r0 = rates.DEFAULTS["H200" if "H200" in r.get("device", "") else "H100"]
        t = step_time(work, ecfg, bench.grad_accum, r0)["total"]
        err = t / r["step_s"] - 1
        errs.append(abs(err))
        plan = f"zero-{ecfg.zero_stage}, ckpt {ecfg.checkpointing}, " + (
            f"{ecfg.offload_blocks} of {r['layers']} blocks on host"
            if ecfg.offload_optimizer != "none"
            else "on GPU"
        )
        print(
            f"{r['system']:<20}{world:>2}{r['layers']:>4}  {plan:<34}{r['step_s']:>11.2f}{t:>12.2f}{err:>+8.0%}"
        )
    errs.sort()
    print(f"\n{len(errs)} trials: median |error| {errs[len(errs) // 2]:.0%}, worst {errs[-1]:.0%}")


if __name__ == "__main__":
    main(sys.argv[1])
