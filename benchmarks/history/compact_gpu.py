"""Compact optimizer state on the GPU machines, as a user runs it: checks, host AdamW, 8 B, capacity.

Stages (each one device call; every `fitgpt` step is a command line as a user types it, on data
made by `fitgpt data preprocess` from the Python standard library, GPT-2's tokenizer; the
records go to OUT/user_path.jsonl through benchmarks/user_path.py's `step`):
  a  benchmarks/history/compact_check.py (the CUDA paths: split master bit-identical to fp32
     master on every tier, compact moments close, bytes as planned, a checkpoint across formats) and
     tests/test_compact.py's GPU tests; benchmarks/host_adamw_formats.py on one 8 B block
     (201 M elements) in every format; and 8 B (7.86 B, ANCHORS batch) by `fitgpt train` with
     the planner's plan in fp32 state and with compact state (--master split --moments bf16
     --device-moments bf16), 6 steps each.
  b  capacity with the planner's default formats: the most layers of the ANCHORS shape (hidden
     4096, 32 heads, seq 1024, untied head, micro-batch 8 x 4) that `fitgpt plan` accepts
     without the disk, trained by `fitgpt train` for 3 steps; then the same with the disk
     offered (--nvme-path), 2 steps; and without the disk with int8 moments asked for (they are
     not among the planner's default formats), 2 steps (b1, b2, b3: one of the three).
  n  the host AdamW through the native kernel (engine/formats/hostkernel.py, the GPU machines'
     default) against fp32 state on one 8 B block; then 8 B by `fitgpt train` in fp32 state, in
     compact state (native kernel) and in compact state through the torch path
     (FITGPT_HOST_KERNELS=eager), 6 steps each.
  b4 capacity with int8 moments asked for and the disk offered, 2 steps.
  p  the planner's own choice, as a user gets it: tests/test_compact.py's GPU tests (the host
     tier now through the native kernel), then `fitgpt train` at issue 15's sizes, 8.07 B and
     11.69 B (the ANCHORS shape, 38 and 56 layers), with no format flags, 6 steps each.
  x2 (nvidia-h200-x2) `fitgpt train --gpus 2` at 40.64 B (the 20b preset's width, 89 layers),
     which no plan fits with fp32 state (29.31 B was the largest), 2 steps.

    python3 benchmarks/history/compact_gpu.py a --out $OUT    # carry .whl (the GPT-2 tokenizer)
    python3 benchmarks/history/compact_gpu.py b --out $OUT
    python3 benchmarks/history/compact_gpu.py n --out $OUT
    python3 benchmarks/history/compact_gpu.py b4 --out $OUT
    python3 benchmarks/history/compact_gpu.py x2 --out $OUT   # nvidia-h200-x2
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
from functools import partial
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: user_path.py
import user_path  # (its data, its `step` recorder and its `fitgpt` command builder)
from user_path import DATA, WORK, fitgpt, step

EIGHT_B = ["--preset", "6.7b", "--layers", "38"]
ANCHORS = ["--preset", "6.7b", "--no-tie-embeddings", "--micro-batch", "8", "--grad-accum", "4"]
COMPACT = ["--master", "split", "--moments", "bf16", "--device-moments", "bf16"]
NVME = "/tmp/fitgpt-nvme"


def checks(out: Path) -> None:
    py = [sys.executable]
    step(
        out,
        "compact_check",
        [*py, "benchmarks/history/compact_check.py", str(out / "compact_check.jsonl")],
    )
    step(out, "gpu tests", [*py, "-m", "pytest", "-q", "-p", "no:logging", "tests/test_compact.py",
                            "-k", "gpu"])  # fmt: skip


def stage_a(out: Path) -> None:
    checks(out)
    step(out, "host adamw formats", [sys.executable, "benchmarks/host_adamw_formats.py",
                                     "--pieces", "4194304", "--reps", "3", "--out",
                                     str(out / "host_adamw_formats.json")])  # fmt: skip
    eight_b(out, (("8b fp32 state", [], None), ("8b compact state", COMPACT, None)))


def eight_b(out: Path, cases, timeout_s: float | None = None) -> None:
    """`fitgpt train` at 7.86 B for 6 steps, once per (name, extra flags, extra env)."""
    user_path.make_data(out)
    common = [*EIGHT_B, "--data", str(DATA), "--micro-batch", "8", "--grad-accum", "4",
              "--eval-every", "0", "--log-every", "1", "--no-save", "--steps", "6"]  # fmt: skip
    for name, extra, env in cases:
        run = WORK / "runs" / name.replace(" ", "_").replace(",", "")
        step(out, name, fitgpt("train", *common, *extra, "--out", str(run)), run_dir=run,
             env=env, timeout_s=timeout_s)  # fmt: skip


def stage_n(out: Path) -> None:
    step(out, "host adamw, native", [sys.executable, "benchmarks/host_adamw_formats.py",
                                     "--modes", "native", "--reps", "3", "--out",
                                     str(out / "host_adamw_native.json")])  # fmt: skip
    cases = (("8b fp32 state", [], None), ("8b compact state, native", COMPACT, None),
             ("8b compact state, torch path", COMPACT, {"FITGPT_HOST_KERNELS": "eager"}))  # fmt: skip
    eight_b(out, cases, timeout_s=150)


def stage_p(out: Path) -> None:
    step(out, "gpu tests", [sys.executable, "-m", "pytest", "-q", "-p", "no:logging",
                            "tests/test_compact.py", "-k", "gpu"], timeout_s=120)  # fmt: skip
    user_path.make_data(out)
    for layers in (38, 56):
        run = WORK / "runs" / f"planner_{layers}"
        cmd = fitgpt("train", *ANCHORS, "--layers", str(layers), "--data", str(DATA),
                     "--eval-every", "0", "--log-every", "1", "--no-save", "--steps", "6",
                     "--out", str(run))  # fmt: skip
        step(out, f"planner's choice, {layers} layers", cmd, run_dir=run, timeout_s=150)


def largest(extra: list[str]) -> int:
    """What `fitgpt plan` names as the most layers of the ANCHORS shape that fit here."""
    cmd = fitgpt("plan", *ANCHORS, "--layers", "400", "--tokenizer", "gpt2", *extra)
    p = subprocess.run(cmd, capture_output=True, text=True)
    m = re.search(r"what fits: (\d+) layers", p.stderr + p.stdout)
    if not m:
        raise SystemExit(f"no size found in: {(p.stderr + p.stdout)[-800:]}")
    return int(m.group(1))


def stage_b(out: Path, only: int | None = None, timeout_s: float | None = None) -> None:
    user_path.make_data(out)
    Path(NVME).mkdir(parents=True, exist_ok=True)
    common = [*ANCHORS, "--data", str(DATA), "--eval-every", "0", "--log-every", "1", "--no-save"]
    disk = (["--nvme", NVME], ["--nvme-path", NVME])  # `plan` and `train` name the folder so
    int8 = (["--moments", "int8"], ["--moments", "int8"])  # opt-in: outside the default
    both = (disk[0] + int8[0], disk[1] + int8[1])
    cases = [("largest, no disk", ([], []), 3), ("largest, disk", disk, 2),
             ("largest, int8 moments, no disk", int8, 2),
             ("largest, int8 moments, disk", both, 2)]  # fmt: skip
    for name, (plan_extra, extra), steps in cases if only is None else cases[only : only + 1]:
        steps = int(os.environ.get("CAPACITY_STEPS", steps))  # fewer where setup is long
        # CAPACITY_LAYERS: the count an earlier call's `fitgpt plan` named (saves its minute)
        layers = int(os.environ.get("CAPACITY_LAYERS", 0)) or largest(plan_extra)
        run = WORK / "runs" / name.replace(" ", "_").replace(",", "")
        cmd = fitgpt("train", *common, "--layers", str(layers), *extra, "--steps", str(steps),
                     "--out", str(run))  # fmt: skip
        step(out, f"{name} ({layers} layers)", cmd, run_dir=run, layers=layers,
             timeout_s=timeout_s)  # fmt: skip


def stage_x2(out: Path) -> None:
    user_path.make_data(out)
    run = WORK / "runs" / "x2_40b"
    cmd = fitgpt("train", "--gpus", "2", "--preset", "20b", "--layers", "89", "--data", str(DATA),
                 "--micro-batch", "8", "--grad-accum", "4", "--eval-every", "0", "--log-every",
                 "1", "--no-save", "--steps", "2", *user_path.X2_RAM, "--out", str(run))  # fmt: skip
    step(out, "40.64 B --gpus 2", cmd, run_dir=run)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("stage", choices=["a", "b", "check", "n", "p", "b1", "b2", "b3", "b4", "x2"])
    ap.add_argument("--out", required=True)
    ap.add_argument("--timeout", type=float, default=None, help="seconds per capacity run")
    a = ap.parse_args()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    if a.stage == "check":
        checks(out)
    else:
        b = partial(stage_b, timeout_s=a.timeout)
        {"a": stage_a, "b": b, "n": stage_n, "p": stage_p, "x2": stage_x2, "b1": partial(b, only=0),
         "b2": partial(b, only=1), "b3": partial(b, only=2), "b4": partial(b, only=3)}[a.stage](out)  # fmt: skip
    user_path.table(out)


if __name__ == "__main__":
    main()
