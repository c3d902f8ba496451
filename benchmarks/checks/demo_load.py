"""How long `make demo` takes on a small CPU box, idle and under a competing CPU load, with 1 and
2 torch threads; the measurement behind fitgpt/dist/threads.py's rule and README's demo time.

    python benchmarks/checks/demo_load.py                     # ~10-15 min on 2 cores
    python benchmarks/checks/demo_load.py --steps 30 --skip-demo   # the thread matrix only, ~3 min
    python benchmarks/checks/demo_load.py --versus-one        # the demo against --cpu-threads 1, ~25 min

Competing load: --load N processes that each spin a Python busy loop (`while True: pass`), one
per core by default, started before a run and killed after it: the share of the CPU a run gets
is then what a box shared with N other CPU-bound jobs gives it.

Part 1 (the matrix): the demo's training command cut to --steps S steps, without evaluation or
checkpoints, for every (load, torch threads) pair; the figure is the mean step time after the first
logged interval (warm-up). Threads are set with OMP_NUM_THREADS (torch reads it
at start-up, and fitgpt leaves an explicit setting alone). "2 passive" adds
OMP_WAIT_POLICY=PASSIVE: OpenMP threads sleep instead of spinning while they wait for each
other, the usual cure for oversubscription.

Part 2 (the demo): `make demo`'s two commands, exactly as the Makefile runs them (no thread
setting: fitgpt's own rule chooses), under the competing load; the wall time of each.

Part 3 (--versus-one, instead of parts 1 and 2): the demo as the Makefile runs it against the
same with `--cpu-threads 1`, back to back, idle, under the load, and under the load started a few
seconds into the run (after fitgpt's start-up look at the machine: what its thread tuner is for).

Writes OUT/results.json (every run, with the load average before it) and OUT/README.md (tables).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DEMO_TRAIN = ["train", "--preset", "tiny", "--data", "stdlib", "--overwrite"]
DEMO_GENERATE = ["generate", "--prompt", "def ", "--max-new-tokens", "200", "--seed", "0"]
VARIANTS = {  # name: environment of the run
    "1": {"OMP_NUM_THREADS": "1"},
    "2": {"OMP_NUM_THREADS": "2"},
    "2 passive": {"OMP_NUM_THREADS": "2", "OMP_WAIT_POLICY": "PASSIVE"},
}


def start_load(n: int) -> list[subprocess.Popen]:
    return [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(n)]


def stop_load(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        p.kill()
        p.wait()


def fitgpt(args: list[str], env_extra: dict[str, str]) -> tuple[float, str]:
    """Run `python -m fitgpt ARGS`; (wall seconds, stdout). Fails loudly on a non-zero exit."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("OMP_")}
    env.update(env_extra, PYTHONPATH=str(ROOT))
    t0 = time.perf_counter()
    r = subprocess.run(
        [sys.executable, "-m", "fitgpt", *args], env=env, cwd=ROOT, capture_output=True, text=True
    )
    wall = time.perf_counter() - t0
    if r.returncode:
        raise SystemExit(f"fitgpt {' '.join(args)} failed ({r.returncode}):\n{r.stderr[-2000:]}")
    return wall, r.stdout


def step_ms(run_dir: Path) -> float:
    """Mean ms per step from the first logged step to the last (the first interval is warm-up).

    The mean, not the log lines' median: under contention most steps are quick and a few stall
    for seconds (a thread descheduled while the other spins), and the stalls are the cost."""
    recs = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in recs if r.get("kind") == "train"]
    first, last = train[0], train[-1]
    return 1000 * (last["time"] - first["time"]) / (last["step"] - first["step"])


def matrix(steps: int, load: int, tmp: Path) -> list[dict]:
    rows = []
    for n_load in (0, load):
        for name, env in VARIANTS.items():
            procs = start_load(n_load)
            try:
                time.sleep(1.0)  # let the load processes start spinning
                loadavg = os.getloadavg()[0]
                out = tmp / f"m_{n_load}_{name.replace(' ', '_')}"
                args = [*DEMO_TRAIN, "--out", str(out), "--steps", str(steps)]
                args += ["--log-every", "10", "--eval-every", "0", "--no-save"]
                wall, _ = fitgpt(args, env)
            finally:
                stop_load(procs)
            row = {
                "part": "matrix",
                "load_procs": n_load,
                "threads": name,
                "steps": steps,
                "wall_s": round(wall, 2),
                "ms_per_step": round(step_ms(out), 1),
                "loadavg_1min_before": loadavg,
            }
            print(json.dumps(row), flush=True)
            rows.append(row)
    return rows


def demo(load: int, tmp: Path, extra: tuple[str, ...] = (), late_s: float = 0.0) -> dict:
    """`make demo`'s two commands under `load` busy processes (started `late_s` seconds after
    the training command, so that fitgpt's start-up look at the machine sees it idle), with
    `extra` flags on the training command."""
    procs = [] if late_s else start_load(load)
    timer = threading.Timer(late_s, lambda: procs.extend(start_load(load)))
    try:
        if not late_s:
            time.sleep(1.0)
        loadavg = os.getloadavg()[0]
        out = tmp / "demo"
        train = [*DEMO_TRAIN, "--out", str(out), *extra]
        if late_s:
            timer.start()
        train_s, log = fitgpt(train, {})
        gen_s, sample = fitgpt([*DEMO_GENERATE, "--ckpt", str(out)], {})
    finally:
        timer.cancel()
        stop_load(procs)
    # the trainer's first line says how many threads the rule gave (fitgpt/dist/threads.py),
    # later lines each switch the tuner made while the run trained
    m = re.search(r"(\d+) CPU threads per rank", log)
    switches = re.findall(r"CPU threads (\d+) → (\d+)", log)
    chosen = "--cpu-threads 1" if extra else f"fitgpt's rule: {m.group(1) if m else '?'}"
    if switches and not extra:
        chosen += ", then " + ", ".join(f"{a}→{b}" for a, b in switches)
    row = {
        "part": "demo",
        "load_procs": load,
        "load_starts_s": late_s,
        "flags": " ".join(extra),
        "threads": chosen,
        "train_s": round(train_s, 1),
        "generate_s": round(gen_s, 1),
        "total_s": round(train_s + gen_s, 1),
        "ms_per_step": round(step_ms(out), 1),
        "loadavg_1min_before": loadavg,
        "sample_chars": len(sample),
    }
    print(json.dumps(row), flush=True)
    return row


def ratios(rows: list[dict]) -> list[str]:
    """One line per load level: each thread setting's step time against 1 thread's."""
    out = []
    for n in sorted({r["load_procs"] for r in rows if r["part"] == "matrix"}):
        at = {
            r["threads"]: r["ms_per_step"]
            for r in rows
            if r["part"] == "matrix" and r["load_procs"] == n
        }
        if "1" not in at:
            continue
        rel = ", ".join(f"{k} threads {v / at['1']:.2f}×" for k, v in at.items() if k != "1")
        out.append(f"- {n} competing processes: step time against 1 thread: {rel}")
    return out


def readme(rows: list[dict], meta: dict) -> str:
    lines = [
        f"# `make demo` on {meta['cores']} CPU cores, with and without a competing load — "
        f"{meta['date']}",
        "",
        f"Made by `python benchmarks/checks/demo_load.py {' '.join(meta['argv'])}` on {meta['host']} "
        f"({meta['cpu']}). Competing load: {meta['load']} busy-looping Python processes "
        "(`while True: pass`). The load average before each run shows what else the machine "
        "was doing besides (0 competing processes is idle only where it is near 0).",
    ]
    if any(r["part"] == "matrix" for r in rows):
        lines += [
            "",
            "## The thread matrix (demo's training command, --steps "
            f"{meta['steps']}, no eval, no checkpoint)",
            "",
            "| competing processes | torch threads | ms/step (mean) | wall s | load avg before |",
            "|---|---|---|---|---|",
        ]
        for r in rows:
            if r["part"] == "matrix":
                lines.append(
                    f"| {r['load_procs']} | {r['threads']} | {r['ms_per_step']:.0f} | "
                    f"{r['wall_s']:.1f} | {r['loadavg_1min_before']:.2f} |"
                )
        lines += ["", *ratios(rows)]
    demos = [r for r in rows if r["part"] == "demo"]
    if demos:
        lines += [
            "",
            "## `make demo` (its two commands, timed)",
            "",
            "| competing processes | load starts | training flags | threads | train s | "
            "generate s | total s | ms/step (mean, with evals and saves) | load avg before |",
            "|---|---|---|---|---|---|---|---|---|",
        ]
        for r in demos:
            late = r.get("load_starts_s", 0)
            lines.append(
                f"| {r['load_procs']} | {f'{late:g} s after' if late else 'before'} | "
                f"{r.get('flags') or '(none)'} | {r['threads']} | {r['train_s']:.0f} | "
                f"{r['generate_s']:.0f} | {r['total_s']:.0f} | {r['ms_per_step']:.0f} | "
                f"{r['loadavg_1min_before']:.2f} |"
            )
    return "\n".join(lines) + "\n"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=40, help="steps of each matrix run (default: 40)")
    p.add_argument("--load", type=int, default=os.cpu_count() or 2, help="busy processes")
    p.add_argument("--skip-demo", action="store_true", help="the matrix only")
    p.add_argument(
        "--versus-one",
        action="store_true",
        help="no matrix: the demo as the Makefile runs it against the same with --cpu-threads 1, "
        "idle, under the load started before it, and under the load started LATE_S into it",
    )
    p.add_argument("--late-s", type=float, default=5.0, help="with --versus-one (default: 5)")
    p.add_argument(
        "--cases",
        default="idle,before,late",
        help="with --versus-one: which of idle, before (the load), late (the load) to run",
    )
    p.add_argument("--out", default=None, help="default: benchmarks/results/demo_cpu_DATE")
    p.add_argument(
        "--readme-only", metavar="DIR", help="rewrite DIR/README.md from DIR/results.json"
    )
    args = p.parse_args()
    if args.readme_only:
        saved = json.loads((Path(args.readme_only) / "results.json").read_text())
        (Path(args.readme_only) / "README.md").write_text(readme(saved["runs"], saved["meta"]))
        return
    # a SIGTERM unwinds through the `finally` blocks, so no busy loop outlives the script
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    date = datetime.date.today().isoformat()
    out = Path(args.out or ROOT / "benchmarks" / "results" / f"demo_cpu_{date}")
    out.mkdir(parents=True, exist_ok=True)
    with open("/proc/cpuinfo") as f:
        names = [ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")]
    cpu = names[0] if names else "unknown CPU"
    meta = {
        "date": date,
        "cores": os.cpu_count(),
        "cpu": cpu,
        "host": os.uname().nodename,
        "load": args.load,
        "steps": args.steps,
        "argv": sys.argv[1:],
    }
    with tempfile.TemporaryDirectory(prefix="fitgpt-demo-load-") as tmp:
        if args.versus_one:  # each pair back to back, so both see the same machine
            rows = []
            cases = {"idle": (0, 0.0), "before": (args.load, 0.0), "late": (args.load, args.late_s)}
            for load, late in (cases[c] for c in args.cases.split(",")):
                for extra in ((), ("--cpu-threads", "1")):
                    rows.append(demo(load, Path(tmp), extra, late))
        else:
            rows = matrix(args.steps, args.load, Path(tmp))
        if not args.skip_demo and not args.versus_one:
            rows.append(demo(0, Path(tmp)))  # the README's idle figure
            rows.append(demo(args.load, Path(tmp)))
    (out / "results.json").write_text(json.dumps({"meta": meta, "runs": rows}, indent=1) + "\n")
    (out / "README.md").write_text(readme(rows, meta))
    print(f"wrote {out}/README.md and results.json")


if __name__ == "__main__":
    main()
