"""Issue 13's GPU check: the engine split by concern and driven by the Placement, against the
numbers it had before (and issue 10's 8 B save time), on nvidia-h100-x1.

1. benchmarks/gpu_check.py: every ZeRO stage and the host tier against the plain engine in bf16,
   a stage-3 checkpoint resumed by the plain engine, KV-cache generation (CUDA paths).
2. benchmarks/history/tiers_gpu_check.py's 2.03 B cases: streamed weights (the copy stream, its
   events, the host optimizer's side-stream copies); the recorded run also had the delayed update,
   removed since (docs/offload.md).
3. The tiers sweep's trials at 4.44 B and 8.07 B (hidden 4096, untied head, micro-batch 8 × 4,
   ANCHORS protocol): `fitgpt bench sweep --systems fitgpt --sizes 20,38 --warmup 1 --steps 2`,
   as in benchmarks/results/tiers_h100_2026-11-22, and the same two sizes through `fitgpt train`
   with the plan those trials ran fixed (all on the GPU; 24 of 38 blocks offloaded), so the
   engine is compared on the same plan whatever the planner now picks.
4. An 8 B weights-only checkpoint's save time (`fitgpt train ... --save-optimizer none`).

    python3 benchmarks/history/refactor_check.py --out $OUT
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: user_path.py
from user_path import fitgpt, step

TIERS = {20: 1.8030249319999996, 38: 6.20955581150001}  # step s in tiers_h100_2026-11-22
ANCHORS = ["--hidden", "4096", "--heads", "32", "--seq-len", "1024", "--vocab-size", "50257"]
TRAIN = ["--data", "uniform", *ANCHORS, "--no-tie-embeddings", "--micro-batch", "8"]
TRAIN += ["--grad-accum", "4", "--eval-every", "0", "--log-every", "1", "--engine", "zero"]
TRAIN += ["--zero-stage", "0", "--checkpointing", "full", "--lr", "1e-4", "--min-lr", "1e-4"]
TRAIN += ["--warmup", "0", "--plan", "off"]  # the plan is given, as the tiers sweep ran it
FIXED = {20: [], 38: ["--offload-optimizer", "cpu", "--offload-blocks", "24"]}


def cuda_checks(out: Path) -> None:
    r = subprocess.run(
        [sys.executable, "benchmarks/gpu_check.py", str(out / "gpu_check.json")],
        capture_output=True,
        text=True,
    )
    print(r.stdout[-3000:], r.stderr[-2000:], flush=True)
    with open(out / "refactor_check.jsonl", "a") as f:
        f.write(json.dumps({"name": "gpu_check.py", "rc": r.returncode, "tail": r.stdout[-2000:]}))
        f.write("\n")
    import tiers_gpu_check

    with open(out / "tiers_gpu_check.jsonl", "w") as f:
        for layers, placement, steps in tiers_gpu_check.CASES:
            if layers != 8:
                continue
            rec = tiers_gpu_check.run(layers, placement, steps)
            f.write(json.dumps(rec) + "\n")
            print(layers, placement, rec["step_s"], rec["losses"], flush=True)


def speed(out: Path) -> None:
    sweep = out / "sweep.jsonl"
    cmd = fitgpt(
        "bench", "sweep", "--systems", "fitgpt", "--sizes", "20,38", "--warmup", "1", "--steps",
        "2", "--out", str(sweep),
    )  # fmt: skip
    step(out, "harness 4.44 B and 8.07 B (plan auto)", cmd)
    for layers in (20, 38):
        run = Path("/tmp/refactor_check") / f"L{layers}"
        shutil.rmtree(run, ignore_errors=True)
        cmd = fitgpt(
            "train", *TRAIN, "--layers", str(layers), *FIXED[layers], "--steps", "5", "--no-save",
            "--out", str(run),
        )  # fmt: skip
        step(out, f"train L={layers}, the tiers sweep's plan", cmd, run_dir=run, layers=layers)


def save_time(out: Path) -> None:
    run = Path("/tmp/refactor_check/save8b")
    shutil.rmtree(run, ignore_errors=True)
    cmd = fitgpt(
        "train", "--preset", "6.7b", "--layers", "38", "--data", "uniform", "--vocab-size",
        "50257", "--micro-batch", "8", "--grad-accum", "4", "--eval-every", "0", "--steps", "2",
        "--save-optimizer", "none", "--out", str(run),
    )  # fmt: skip
    rec = step(out, "8 B weights-only save", cmd)
    m = re.search(r"\(weights only, ([\d.]+) GB in ([\d.]+) s\)", rec["stdout_tail"])
    if m:
        print(f"save: {m.group(1)} GB in {m.group(2)} s", flush=True)
    shutil.rmtree(run, ignore_errors=True)


def table(out: Path) -> None:
    print("\n| check | step s | tiers sweep | ratio |")
    print("|---|---|---|---|")
    for line in (out / "sweep.jsonl").read_text().splitlines():
        r = json.loads(line)
        if r.get("status") == "ok":
            t = TIERS[r["layers"]]
            print(
                f"| harness L={r['layers']} | {r['step_s']:.3f} | {t:.3f} | {r['step_s'] / t:.3f} |"
            )
    for line in (out / "user_path.jsonl").read_text().splitlines():
        r = json.loads(line)
        if "layers" in r and r.get("step_s"):
            t = TIERS[r["layers"]]
            print(f"| {r['name']} | {r['step_s']:.3f} | {t:.3f} | {r['step_s'] / t:.3f} |")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--parts", default="cuda,speed,save", help="comma-separated")
    a = ap.parse_args()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    parts = a.parts.split(",")
    if "cuda" in parts:
        cuda_checks(out)
    if "speed" in parts:
        speed(out)
    if "save" in parts:
        save_time(out)
    if "speed" in parts:
        table(out)


if __name__ == "__main__":
    main()
