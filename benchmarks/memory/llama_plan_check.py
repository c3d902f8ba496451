"""The planner's step time against every recorded Llama-family run (issue 36's accuracy bar).

Each row is one committed measurement (its results folder named beside it): the plan the run
executed, re-priced by today's step-time model (plan/throughput.py step_time) with the rates
the run planned with, against the step time the run measured. Nothing runs on a GPU: this
re-prices, so after a change to the step model it says which recorded runs moved and by how
much. Run: PYTHONPATH=. .venv/bin/python benchmarks/memory/llama_plan_check.py
"""

from __future__ import annotations

import dataclasses
import statistics

from fitgpt.engine.config import EngineConfig
from fitgpt.model import get_preset
from fitgpt.plan.memory import Workload
from fitgpt.plan.rates import DEFAULTS
from fitgpt.plan.throughput import step_time

H100 = DEFAULTS["H100"]
H100_PROBED = dataclasses.replace(H100, gemm_tflops=760.0)  # that call's `fitgpt probe`
H200 = DEFAULTS["H200"]
COMPACT = {"master": "split", "moments": "bf16", "device_moments": "bf16"}
FP32 = {"master": "fp32", "moments": "fp32", "device_moments": "fp32"}


def zero(stage: int, ckpt: str, blocks: int = 0, stream: bool = False, **kw) -> EngineConfig:
    off = {"offload_optimizer": "cpu", "offload_blocks": blocks} if blocks else {}
    if stream:
        off["offload_params"] = "cpu"
    return EngineConfig(engine="zero", zero_stage=stage, checkpointing=ckpt, **off, **kw)


# (name, results folder, preset, seq, micro-batch, grad-accum, GPUs, engine config, rates,
#  measured seconds per step: the steady steps' range)
RUNS = [
    ("8B eager", "llama_speed_h100_2026-11-27", "llama3.1-8b", 4096, 4, 4, 1,
     zero(0, "full", 8, True, **COMPACT), H100_PROBED, (7.93, 8.04)),
    ("8B compiled", "llama_speed_h100_2026-11-27", "llama3.1-8b", 4096, 4, 4, 1,
     zero(0, "full", 8, True, compile="blocks", **COMPACT), H100_PROBED, (7.40, 7.48)),
    ("8B --init-from compiled", "llama_h100_2026-11-27", "llama3.1-8b", 4096, 4, 4, 1,
     zero(0, "full", 8, True, compile="blocks", **COMPACT), H100, (7.40, 7.48)),
    ("Qwen2.5-14B --init-from", "qwen_h100_2026-11-26", "qwen2.5-14b", 4096, 4, 4, 1,
     zero(0, "full", 39, True, **COMPACT), H100, (15.53, 15.63)),
    ("8B ZeRO-3 ×4 compiled", "x4_h100_2026-11-27/compile8b", "llama3.1-8b", 4096, 2, 2, 4,
     zero(3, "full", 2, True, compile="blocks", **FP32), H100, (1.88, 1.95)),
    ("70B ×4 compiled", "x4_h200_2026-11-27/l70", "llama3.1-70b", 4096, 2, 4, 4,
     zero(3, "full", 56, True, compile="blocks", master="split", moments="bf16",
          device_moments="fp32"), H200, (36.10, 36.78)),
    ("8B at 131,072", "long_h100_2026-11-27/llamavocab_131k", "llama3.1-8b", 131072, 1, 1, 1,
     zero(0, "cpu", 26, True, **FP32), H100, (55.47, 55.81)),
    ("8B CP4 at 131,072", "x4_h200_2026-11-27/cp", "llama3.1-8b", 131072, 1, 1, 4,
     zero(1, "off", context_parallel=4, **FP32), H200, (10.80, 10.84)),
    ("8B CP4 at 524,288", "x4_h200_2026-11-27/cp", "llama3.1-8b", 524288, 1, 1, 4,
     zero(1, "full", context_parallel=4, **FP32), H200, (171.06, 171.06)),
    ("Qwen2.5-32B CP4 at 131,072", "x4_h200_2026-11-27/cp", "qwen2.5-32b", 131072, 1, 1, 4,
     zero(3, "full", 25, context_parallel=4, **FP32), H200, (43.94, 44.26)),
]  # fmt: skip


def main() -> None:
    print(f"{'run':28} {'planned s':>9} {'measured s':>13} {'error':>7}  results/")
    errors = []
    for name, folder, preset, seq, mb, ga, gpus, ecfg, rates, (lo, hi) in RUNS:
        model = get_preset(preset).replace(seq_len=seq)
        t = step_time(Workload(model, mb, gpus, "bf16", "cuda"), ecfg, ga, rates)["total"]
        mid = (lo + hi) / 2
        err = mid / t - 1  # + : the run was slower than planned
        errors.append(abs(err))
        print(f"{name:28} {t:9.2f} {lo:6.2f}-{hi:6.2f} {100 * err:+6.1f}%  {folder}")
    print(f"|error| median {100 * statistics.median(errors):.1f}%, max {100 * max(errors):.1f}%")


if __name__ == "__main__":
    main()
