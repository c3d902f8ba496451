"""`fitgpt capacity`: the largest model of a width that really trains on this machine."""

from __future__ import annotations

import argparse
import dataclasses
import json
import tempfile
from pathlib import Path

from fitgpt.bench.config import BenchConfig
from fitgpt.cli.args import add_config_args, config_from_args
from fitgpt.errors import UserError


def register(sub) -> None:
    p = sub.add_parser(
        "capacity",
        help="find the largest model that trains here, by real trials",
        description="Search over layer counts (at a fixed width) for the largest model that "
        "trains: every trial a short real training run in its own process, starting from the "
        "memory model's prediction. Reports the largest size that trained, its throughput, its "
        "measured peak memory and the prediction beside each trial.",
    )
    p.add_argument(
        "--system",
        default=None,
        help="a `fitgpt bench` system (default: fitgpt, the planner's choice)",
    )
    p.add_argument(
        "--engine",
        choices=["ddp", "zero"],
        default=None,
        help="shorthand: ddp, or zero with --zero-stage",
    )
    p.add_argument(
        "--zero-stage",
        type=int,
        choices=[0, 1, 2, 3],
        default=None,
        help="with --engine zero: what each GPU keeps only its share of (see `fitgpt train "
        "--help`)",
    )
    p.add_argument(
        "--plan",
        choices=["auto"],
        default=None,
        help="auto: fitgpt's planner chooses (the default)",
    )
    p.add_argument("--gpus", type=int, default=1, help="GPUs per trial (default: 1)")
    p.add_argument(
        "--device",
        choices=["auto", "cuda", "cpu"],
        default="auto",
        help="where to run: auto (a GPU if there is one), cuda or cpu (default: auto)",
    )
    p.add_argument(
        "--start", type=int, default=None, help="first layer count to try (default: the prediction)"
    )
    p.add_argument("--max-trials", type=int, default=8, help="trials at most (default: 8)")
    p.add_argument(
        "--cap",
        default=None,
        help="memory budget per GPU (process), e.g. 40GB: a real allocator cap on "
        "GPUs; on CPUs a cap on the engine's state bytes (for tests)",
    )
    p.add_argument("--out", default=None, help="append every trial as a JSON line to this file")
    add_config_args(p, BenchConfig, skip=("steps", "warmup"))
    p.set_defaults(func=run)


def system_name(args: argparse.Namespace) -> str:
    if args.system:
        return args.system
    if args.engine == "ddp":
        return "ddp"
    if args.engine == "zero":
        if args.zero_stage is None:
            raise UserError("--engine zero needs --zero-stage 0..3 (or use --plan auto)")
        return f"zero{args.zero_stage}"
    return "fitgpt"


def check_args(args: argparse.Namespace) -> Path | None:
    """The numbers in range and --out writable, before the first trial; the --out path."""
    if args.gpus < 1:
        raise UserError(f"--gpus {args.gpus}: must be at least 1")
    if args.max_trials < 1:
        raise UserError(f"--max-trials {args.max_trials}: must be at least 1")
    if args.start is not None and args.start < 1:
        raise UserError(f"--start {args.start}: a layer count, at least 1")
    if args.out is None:
        return None
    from fitgpt.cli.outputs import check_writable_file

    return check_writable_file(args.out, "--out")


def run(args: argparse.Namespace) -> int:
    from fitgpt.bench.sweep import SweepSpec, append_result, run_one
    from fitgpt.bench.systems import get_system
    from fitgpt.plan import hardware, rates
    from fitgpt.plan.capacity import search
    from fitgpt.plan.hardware import parse_bytes
    from fitgpt.plan.memory import GiB, Workload, estimate
    from fitgpt.plan.planner import largest_layers, plan

    out = check_args(args)
    bench = dataclasses.replace(config_from_args(args, BenchConfig), warmup=1, steps=2)
    system = get_system(system_name(args))
    bench = dataclasses.replace(bench, **system.bench_changes)
    cap = parse_bytes(args.cap, "--cap") if args.cap else 0
    hw = hardware.detect(args.gpus, None, None, None, args.device)
    if cap:
        # GPUs: the allocator cap is the GPU budget. CPUs: the cap counts state bytes only, so
        # the process baseline the memory model adds is granted on top of it.
        from fitgpt.plan.memory import HOST_BASE

        hw = (
            dataclasses.replace(hw, gpu_mem=cap)
            if hw.device == "cuda"
            else dataclasses.replace(hw, cpu_mem=cap + HOST_BASE["cpu"])
        )
    prec = "fp32" if (system.precision == "fp32" or hw.device == "cpu") else "bf16"
    fixed = system.plan_fixed(bench)
    r = rates.load(hw.gpu_name)
    work = Workload(bench.model(1), bench.micro_batch, args.gpus, prec, hw.device)

    def predicted_peak(layers: int) -> float | None:
        if fixed is None:
            return None
        w = dataclasses.replace(work, model=bench.model(layers))
        best = plan(w, bench.grad_accum, hw, r, fixed)[0]
        est = estimate(w, best.ecfg)
        return (est.compute_peak if est.compute else est.host_total) / GiB

    start = args.start
    if start is None:
        if fixed is None:
            raise UserError(f"system {system.name} has no memory model: pass --start LAYERS")
        start = max(1, largest_layers(work, bench.grad_accum, hw, r, fixed))
    print(
        f"capacity of {system.name}: hidden {bench.hidden}, micro-batch {bench.micro_batch}, "
        f"{args.gpus} GPU(s); predicted largest {start} layers "
        f"({bench.model(start).num_params() / 1e9:.2f} B)",
        flush=True,
    )
    spec = SweepSpec((system.name,), (), bench, args.gpus, args.device)
    records: dict[int, dict] = {}

    with tempfile.TemporaryDirectory(prefix="fitgpt-capacity-") as tmp:

        def trial(layers: int) -> bool:
            rec = run_one(spec, system.name, layers, Path(tmp), cap)
            rec["predicted_peak_gib"] = predicted_peak(layers)
            rec["kind"] = "capacity"
            records[layers] = rec
            if out:
                out.parent.mkdir(parents=True, exist_ok=True)
                append_result(out, rec)
            mem = rec.get("gpu_peak_gib", rec.get("host_rss_peak_gib", 0))
            pred = rec["predicted_peak_gib"]
            print(
                f"  trial {len(records)}: {layers} layers ({rec['params'] / 1e9:.2f} B) {rec['status']}"
                f"{'' if rec['status'] == 'ok' else ': ' + rec['reason'][:100]}; measured peak "
                f"{mem:.1f} GiB, predicted {pred if pred is None else f'{pred:.1f} GiB'}",
                flush=True,
            )
            return rec["status"] == "ok"

        result = search(trial, start, args.max_trials)
    if not result.largest_ok:
        print(
            f"no size trained ({len(result.trials)} trials); smallest tried failed: "
            f"{records[min(records)]['reason'][:200]}"
        )
        return 1
    best = records[result.largest_ok]
    print(
        json.dumps(
            {
                "system": system.name,
                "largest_layers": result.largest_ok,
                "params": best["params"],
                "tflops": best.get("tflops"),
                "tokens_per_s": best.get("tokens_per_s"),
                "gpu_peak_gib": best.get("gpu_peak_gib"),
                "host_rss_peak_gib": best.get("host_rss_peak_gib"),
                "predicted_peak_gib": best["predicted_peak_gib"],
                "first_fail": result.first_fail,
                "trials": len(result.trials),
            }
        )
    )
    print(
        f"largest that trained: {result.largest_ok} layers = {best['params'] / 1e9:.2f} B parameters"
        f" ({best.get('tflops', 0):.0f} TFLOP/s per GPU){'' if result.first_fail is None else f'; {result.first_fail} layers failed'}"
    )
    return 0
