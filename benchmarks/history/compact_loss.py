"""The loss cost of compact optimizer state at GPU scale: ~1.5 B parameters, 1,000 steps, real text.

Four `fitgpt train` runs of GPT-2 XL's shape (48 layers, hidden 1600, 25 heads, seq 1024: 1.56 B
with GPT-2's vocabulary) on Megatron data made by `fitgpt data preprocess` from the Python
standard library's source (benchmarks/user_path.py's data), all state on the GPU, the same
schedule (lr 3e-4, 100 warm-up steps, cosine to 3e-5 at step 1,000, micro-batch 4 x 1024
tokens), validation loss every 100 steps on 20 held-out batches:
  fp32-s1    fp32 master and moments, seed 1
  fp32-s2    the same, seed 2 (the run-to-run noise: another initialisation and data order)
  bf16-s1    split master + bf16 moments, seed 1   (--master split --device-moments bf16)
  int8-s1    split master + int8 moments, seed 1   (--master split --device-moments int8)
  host-s1    fp32-s1 with 24 of 48 blocks' optimizer on the host (speculative updates: the
             rollbacks of a real 1,000-step run, in the report)
  delayed-s1 host-s1 with --delayed-update (its loss cost and speed at GPU scale); the flag was
             removed on this evidence (docs/offload.md): `report` still reads the run's files,
             `run` no longer makes it (in git at commit 104145a)
Runs go two at a time on the one GPU (each fits alone; only losses are compared here, not
speed). Each run's metrics.jsonl is copied to OUT/<name>.metrics.jsonl.

    python3 benchmarks/history/compact_loss.py run fp32-s1,bf16-s1 --out $OUT  # device, a call each
    python3 benchmarks/history/compact_loss.py run fp32-s2,int8-s1 --out $OUT
    python3 benchmarks/history/compact_loss.py run host-s1 --out $OUT          # issue 15
    python3 benchmarks/history/compact_loss.py report RESULTS_DIR           # table + curves (here)
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: user_path.py
import user_path  # (its real-text data: `fitgpt data preprocess` on the stdlib)

WORK = Path("/tmp/compact_loss")
MODEL = ["--layers", "48", "--hidden", "1600", "--heads", "25", "--seq-len", "1024"]
SCHEDULE = [
    "--steps", "1000", "--lr", "3e-4", "--min-lr", "3e-5", "--warmup", "100",
    "--micro-batch", "4", "--grad-accum", "1", "--eval-every", "100", "--eval-batches", "20",
    "--log-every", "10", "--no-save",
]  # fmt: skip
PLAN = ["--engine", "zero", "--zero-stage", "0", "--checkpointing", "full",
        "--offload-optimizer", "none"]  # fmt: skip
RUNS = {
    "fp32-s1": ["--seed", "1", "--master", "fp32", "--device-moments", "fp32"],
    "fp32-s2": ["--seed", "2", "--master", "fp32", "--device-moments", "fp32"],
    "bf16-s1": ["--seed", "1", "--master", "split", "--device-moments", "bf16"],
    "int8-s1": ["--seed", "1", "--master", "split", "--device-moments", "int8"],
    # issue 15: the same fp32 run with 24 of 48 blocks' optimizer on the host, whose updates
    # speculate (the rollback rate of a real 1,000-step run)
    "host-s1": ["--seed", "1", "--master", "fp32", "--device-moments", "fp32",
                "--offload-optimizer", "cpu", "--offload-blocks", "24"],
}  # fmt: skip
# runs made with flags since removed: `report` reads their files, `run` cannot make them again
PAST_RUNS = {
    "delayed-s1": [*RUNS["host-s1"], "--delayed-update"],  # the delayed update (docs/offload.md)
}


def run(names: list[str], out: Path) -> int:
    user_path.make_data(out)
    procs = {}
    for name in names:
        folder = WORK / name
        shutil.rmtree(folder, ignore_errors=True)
        cmd = [sys.executable, "-m", "fitgpt", "train", "--data", str(user_path.DATA),
               *MODEL, *SCHEDULE, *PLAN, *RUNS[name], "--out", str(folder)]  # fmt: skip
        print("$ fitgpt " + " ".join(cmd[3:]), flush=True)
        log = open(out / f"{name}.log", "w")  # noqa: SIM115 - open while the run lives
        procs[name] = (subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT), time.time())
    bad = 0
    for name, (p, t0) in procs.items():
        rc = p.wait()
        print(f"{name}: exit {rc} after {time.time() - t0:.0f} s", flush=True)
        bad += rc != 0
        metrics = WORK / name / "metrics.jsonl"
        if metrics.is_file():
            shutil.copy(metrics, out / f"{name}.metrics.jsonl")
        print((out / f"{name}.log").read_text()[-1200:], flush=True)
    return bad


def evals(path: Path) -> dict[int, float]:
    if path.suffix == ".log":  # a run stopped before its metrics were copied: its printed lines
        found = re.findall(r"eval step +(\d+) \| val loss ([\d.]+)", path.read_text())
        return {int(a): float(b) for a, b in found}
    recs = [json.loads(x) for x in path.read_text().splitlines() if x.strip()]
    return {r["step"]: r["val_loss"] for r in recs if "val_loss" in r}


def train_curve(path: Path) -> dict[int, float]:
    if path.suffix == ".log":
        found = re.findall(r"^step +(\d+) \| loss ([\d.]+)", path.read_text(), re.M)
        return {int(a): float(b) for a, b in found}
    recs = [json.loads(x) for x in path.read_text().splitlines() if x.strip()]
    return {r["step"]: r["loss"] for r in recs if r.get("kind") == "train" and "loss" in r}


def source(folder: Path, name: str) -> Path | None:
    """A run's metrics.jsonl, else its log (a run cut short keeps only what it printed)."""
    for p in (folder / f"{name}.metrics.jsonl", folder / f"{name}.log"):
        if p.is_file():
            return p
    return None


def report(folder: Path) -> None:
    """The table (markdown, to stdout and folder/table.md) and the curves (folder/curves.png)."""
    flags = {**RUNS, **PAST_RUNS}
    runs = {n: p for n in flags if (p := source(folder, n)) is not None}
    val = {n: evals(p) for n, p in runs.items()}
    ref = val["fp32-s1"]
    last = max(ref)
    late = [s for s in ref if s >= last // 2]  # the second half's evaluations
    noise = _delta(val.get("fp32-s2", {}), ref, late)
    lines = [
        "| run | formats | last step | val loss there | Δ vs fp32-s1 there | mean Δ (signed) over "
        "the evaluations 500-1000 it has | mean abs Δ over those |",
        "|---|---|---|---|---|---|---|",
    ]
    for n, v in val.items():
        fmt = " ".join(flags[n][2:])
        end = max(v)
        common = [s for s in late if s in v]
        signed = sum(v[s] - ref[s] for s in common) / len(common) if common else float("nan")
        lines.append(f"| {n} | {fmt} | {end} | {v[end]:.4f} | {v[end] - ref[end]:+.4f} | "
                     f"{signed:+.4f} | {_delta(v, ref, late):.4f} |")  # fmt: skip
    lines.append(
        f"\nrun-to-run noise (fp32-s2 against fp32-s1, mean |Δ| over the 2nd half): {noise:.4f}"
    )
    # every evaluation: each run's validation loss less fp32-s1's
    others = [n for n in val if n != "fp32-s1"]
    lines += ["", "| step | fp32-s1 | " + " | ".join(f"Δ {n}" for n in others) + " |",
              "|---|---|" + "---|" * len(others)]  # fmt: skip
    for st in sorted(ref):
        cells = [f"{val[n][st] - ref[st]:+.4f}" if st in val[n] else "-" for n in others]
        lines.append(f"| {st} | {ref[st]:.4f} | " + " | ".join(cells) + " |")
    # the speculative update's guesses and rollbacks over each run (metrics.jsonl's last record)
    for n, p in runs.items():
        if p.suffix == ".jsonl":
            recs = [json.loads(x) for x in p.read_text().splitlines() if x.strip()]
            last = [r for r in recs if "rollbacks" in r]
            ms = [r["ms_per_step"] for r in recs if r.get("kind") == "train" and "ms_per_step" in r]
            if last:
                lines.append(f"\n{n}: {last[-1]['speculated_steps']} speculated steps, "
                             f"{last[-1]['rollbacks']} rollbacks by step {last[-1]['step']}; "
                             f"median {sorted(ms)[len(ms) // 2]:.0f} ms/step")  # fmt: skip
    text = "\n".join(lines)
    print(text)
    (folder / "table.md").write_text(text + "\n")
    _plot(folder, runs, val)


def _delta(v: dict[int, float], ref: dict[int, float], steps: list[int]) -> float:
    common = [s for s in steps if s in v]
    return sum(abs(v[s] - ref[s]) for s in common) / len(common) if common else float("nan")


def _plot(folder: Path, runs: dict[str, Path], val: dict[str, dict[int, float]]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(1, 2, figsize=(11, 4))
    for n, p in runs.items():
        tc = train_curve(p)
        ax[0].plot(list(tc), list(tc.values()), label=n, lw=0.8)
        ax[1].plot(list(val[n]), list(val[n].values()), marker="o", label=n)
    ax[0].set(title="training loss", xlabel="step", ylim=(None, None))
    ax[1].set(title="validation loss", xlabel="step")
    for a in ax:
        a.legend()
        a.grid(alpha=0.3)
    fig.suptitle("1.56 B (GPT-2 XL shape), H100: fp32 state against compact formats")
    fig.tight_layout()
    fig.savefig(folder / "curves.png", dpi=110)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run")
    r.add_argument("names", help="comma list of: " + ", ".join(RUNS))
    r.add_argument("--out", required=True)
    p = sub.add_parser("report")
    p.add_argument("folder")
    a = ap.parse_args()
    if a.cmd == "run":
        out = Path(a.out)
        out.mkdir(parents=True, exist_ok=True)
        return run(a.names.split(","), out)
    report(Path(a.folder))
    return 0


if __name__ == "__main__":
    sys.exit(main())
