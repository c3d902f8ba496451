"""Issue 18 at steady state: how often the speculative update guesses right on real text, and the
step time when it does, at 8.07 B on nvidia-h100-x1, through `fitgpt train` as a user types it.

Why a training run and not only the harness: the harness times steps 2-3 of a model at random
initialisation, where the gradient norm is far above the clip (1.0), so every step is clipped and
the update never starts early (the guess is "not clipped"; speculate_h100.sh's sweep shows 0
guesses). In a real run the norm falls under the clip after the first steps and stays there but
for spikes; this measures that, step by step.

Runs (each `fitgpt train`, ANCHORS shape: hidden 4096, 32 heads, 38 layers, untied head, GPT-2
vocabulary = 8.07 B, micro-batch 8 x 4, seq 1024, bf16, planner's plan; data: the Python standard
library's source through `fitgpt data preprocess`, as benchmarks/user_path.py makes it):
  spec     40 steps, clip 1.0, lr 1e-4 (5 warm-up steps), speculative update on (the default)
  nospec   the same with --no-speculative-update, as many steps as the call has time for
Every step is logged (--log-every 1): grad_norm, ms_per_step, speculated, rollbacks.
    python3 benchmarks/history/speculate_steady.py --out $OUT [--deadline 540]
Writes $OUT/<run>.log, $OUT/<run>.metrics.jsonl and $OUT/summary.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: user_path.py
from user_path import DATA, make_data

ROOT = Path(__file__).resolve().parents[2]  # the source tree (this file: benchmarks/history/)
SHAPE = ["--preset", "6.7b", "--layers", "38", "--no-tie-embeddings", "--micro-batch", "8"]
COMMON = ["--grad-accum", "4", "--lr", "1e-4", "--min-lr", "1e-5", "--warmup", "5"]
COMMON += ["--log-every", "1", "--eval-every", "0", "--no-save", "--grad-clip", "1.0"]


def train(out: Path, name: str, steps: int, extra: list[str], limit: float) -> list[dict]:
    argv = [sys.executable, "-m", "fitgpt", "train", "--data", str(DATA), *SHAPE, *COMMON]
    argv += ["--steps", str(steps), "--out", f"/tmp/runs/{name}", "--overwrite", *extra]
    print("$", " ".join(argv[1:]), flush=True)
    with open(out / f"{name}.log", "w") as log:
        try:
            subprocess.run(argv, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, timeout=limit)
        except subprocess.TimeoutExpired:
            print(f"{name}: stopped by the call's deadline", flush=True)
    src = Path(f"/tmp/runs/{name}/metrics.jsonl")
    recs = [json.loads(x) for x in src.read_text().splitlines()] if src.is_file() else []
    (out / f"{name}.metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    return [r for r in recs if r.get("kind") == "train"]


def summary(recs: list[dict]) -> dict:
    """Step times split by what the step did: a right guess adds 1 to speculated and 0 to
    rollbacks; the first step is left out (it holds the set-up)."""
    rows, right, other = [], [], []
    prev_spec = prev_roll = 0
    for r in recs:
        spec, roll = r.get("speculated", 0), r.get("rollbacks", 0)
        kind = (
            "right"
            if spec > prev_spec and roll == prev_roll
            else "rolled back"
            if roll > prev_roll
            else "exact"
        )
        prev_spec, prev_roll = spec, roll
        rows.append(
            {"step": r["step"], "grad_norm": r["grad_norm"], "ms": r["ms_per_step"], "kind": kind}
        )
        if r["step"] > 1:
            (right if kind == "right" else other).append(r["ms_per_step"])
    med = lambda xs: statistics.median(xs) if xs else None  # noqa: E731
    return {
        "steps": len(rows),
        "clipped_steps": sum(r["grad_norm"] > 1.0 for r in rows),
        "speculated": prev_spec,
        "rollbacks": prev_roll,
        "median_ms_right_guess": med(right),
        "median_ms_other": med(other),
        "rows": rows,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--deadline", type=float, default=540)
    ap.add_argument("--steps", type=int, default=40)
    args = ap.parse_args()
    t0 = time.monotonic()
    args.out.mkdir(parents=True, exist_ok=True)
    make_data(args.out)
    left = lambda: args.deadline - (time.monotonic() - t0)  # noqa: E731
    res = {"spec": summary(train(args.out, "spec", args.steps, [], left() - 100))}
    if left() > 60:
        res["nospec"] = summary(
            train(args.out, "nospec", 40, ["--no-speculative-update"], left() - 5)
        )
    (args.out / "summary.json").write_text(json.dumps(res, indent=1) + "\n")
    for name, s in res.items():
        print(name, {k: v for k, v in s.items() if k != "rows"})
        print(
            "  ",
            " ".join(
                f"{r['step']}:{r['grad_norm']:.2f}/{r['ms']:.0f}/{r['kind'][0]}" for r in s["rows"]
            ),
        )


if __name__ == "__main__":
    main()
