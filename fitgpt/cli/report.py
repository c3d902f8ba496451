"""`fitgpt report RUN_DIR`: loss, throughput and memory over steps of a training run."""

from __future__ import annotations

from pathlib import Path

from fitgpt.errors import UserError


def register(sub) -> None:
    p = sub.add_parser("report", help="chart a training run's metrics.jsonl")
    p.add_argument("run_dir", help="a run folder (holding metrics.jsonl)")
    p.add_argument("--out", default=None, help="PNG path (default: RUN_DIR/report.png)")
    p.set_defaults(func=run)


def run(args) -> int:
    from fitgpt.bench.report import read_metrics, run_chart
    from fitgpt.paths import check_writable_file

    run_dir = Path(args.run_dir)
    if not run_dir.is_dir():
        raise UserError(f"{run_dir}: not a folder; pass the --out folder of a `fitgpt train` run")
    if not (run_dir / "metrics.jsonl").is_file():
        raise UserError(
            f"{run_dir} has no metrics.jsonl; pass the --out folder of a `fitgpt train` run"
        )
    out = Path(args.out) if args.out else run_dir / "report.png"
    check_writable_file(out, "--out" if args.out else "the chart")
    rows = read_metrics(run_dir / "metrics.jsonl")
    print(f"wrote {run_chart(run_dir, out, rows)}")
    return 0
