"""`fitgpt bench sweep|report`: the harness every performance figure comes from."""

from __future__ import annotations

import argparse
from pathlib import Path

from fitgpt.bench.config import BenchConfig
from fitgpt.cli.args import add_config_args, config_from_args
from fitgpt.errors import UserError


def register(sub) -> None:
    p = sub.add_parser("bench", help="benchmark sweeps and their reports")
    bsub = p.add_subparsers(dest="bench_command", metavar="SUBCOMMAND", required=True)
    s = bsub.add_parser(
        "sweep",
        help="train every (system, size) pair briefly, each in its own process",
        description="For every system and size, a short real training run in its own "
        "process with a time limit; one JSON line per trial appended to --out.",
    )
    from fitgpt.bench.systems import SYSTEMS

    s.add_argument(
        "--systems", required=True, help="comma-separated; available: " + ", ".join(SYSTEMS)
    )
    s.add_argument("--sizes", required=True, help="layer counts (1,4,8) or sizes (0.6b,2b,4.4b)")
    s.add_argument("--gpus", type=int, default=1, help="GPUs (processes) per trial (default: 1)")
    s.add_argument(
        "--device",
        choices=["auto", "cuda", "cpu"],
        default="auto",
        help="where to run: auto (a GPU if there is one), cuda or cpu (default: auto)",
    )
    s.add_argument("--out", required=True, help="results file (JSON lines); re-running resumes it")
    s.add_argument(
        "--cap",
        default=None,
        help="memory budget per GPU (process), e.g. 40GB (a real allocator "
        "cap on GPUs; on CPUs a cap on the engine's state bytes)",
    )
    s.add_argument(
        "--budget",
        type=float,
        default=0.0,
        help="seconds: start no trial predicted to end after this much wall time; "
        "re-running the same command resumes (default: no budget)",
    )
    add_config_args(s, BenchConfig)
    s.set_defaults(func=run_sweep)
    r = bsub.add_parser("report", help="chart and markdown table from a sweep's results")
    r.add_argument("results", help="a results .jsonl written by `fitgpt bench sweep`")
    r.add_argument(
        "--out-dir", default=None, help="where to write the PNG and .md (default: beside it)"
    )
    r.set_defaults(func=run_report)


def run_sweep(args: argparse.Namespace) -> int:
    from fitgpt.bench.config import parse_sizes
    from fitgpt.bench.sweep import SweepSpec, sweep

    bench = config_from_args(args, BenchConfig)
    if args.gpus < 1:
        raise UserError(f"--gpus {args.gpus} must be at least 1")
    systems = tuple(s.strip() for s in args.systems.split(",") if s.strip())
    from fitgpt.plan.hardware import parse_bytes

    cap = parse_bytes(args.cap, "--cap") if args.cap else 0
    if args.budget < 0:
        raise UserError(f"--budget {args.budget}: give seconds >= 0 (0: no budget)")
    spec = SweepSpec(
        systems,
        tuple(parse_sizes(args.sizes, bench)),
        bench,
        args.gpus,
        args.device,
        cap,
        args.budget,
    )
    check_systems(spec)
    from fitgpt.paths import check_writable_dir, check_writable_file

    out = check_writable_file(args.out, "--out")
    check_writable_dir(out.with_name(out.stem + ".logs"), "--out")  # the trials' logs go beside
    results = sweep(spec, out)
    return 0 if results else 1


def check_systems(spec) -> None:
    """Every system × size of the sweep that `fitgpt train` would refuse, refused in one line
    before the first trial (plan/validate.py, bench/systems.py check_trial)."""
    import dataclasses

    from fitgpt.bench.systems import check_trial, get_system

    for name in spec.systems:
        system = get_system(name)
        bench = dataclasses.replace(spec.bench, **system.bench_changes)
        for layers in spec.sizes:
            check_trial(system, bench, layers, spec.gpus, spec.device)


def run_report(args: argparse.Namespace) -> int:
    from fitgpt.bench.report import read_sweep, report_paths, write_report
    from fitgpt.paths import check_readable_file, check_writable_dir, check_writable_file

    what = "the .jsonl a sweep wrote"
    path = check_readable_file(args.results, "", what)
    out_dir = Path(args.out_dir) if args.out_dir else path.parent
    flag = "--out-dir" if args.out_dir else "the results' folder"
    check_writable_dir(out_dir, flag)
    for p in report_paths(path, out_dir):
        check_writable_file(p, flag)
    results = read_sweep(path)
    png, md = write_report(path, out_dir, results)
    ok = sum(r["status"] == "ok" for r in results)
    print(f"wrote {png} and {md}")
    if not ok:
        print(
            f"note: none of the {len(results)} trials in {path} trained; the table lists why "
            "each failed, and the chart is empty"
        )
    return 0
