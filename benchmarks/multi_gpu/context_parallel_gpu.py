"""Issue 23 on 2 or 4 GPUs of one box: context parallelism (`--context-parallel C`) as a user
types it, `fitgpt train --gpus C --context-parallel C`, at a Llama-3.1-8B shape.

Stage "parity": the loss of C GPUs at --context-parallel C equal to one GPU's, step by step,
at a length both fit (default 8192 tokens, the 8B shape cut to --parity-layers 8 blocks so one
GPU holds it with ZeRO-1 and full checkpointing): the same rows (at world C the job has one
data rank), the same seed; bf16 compute, so equal to ~1e-2 (the all-to-alls change no value,
the gradient sums' order changes the rounding). Printed side by side with the largest gap.

Stage "long": the whole --preset model (default the 32-block 8B) at --lengths (default 131072)
tokens per sequence, micro-batch 1, with the planner's plan (--plan auto, as a user types
it; --plan fixed: ZeRO-3 with the optimizer and the block inputs in host RAM): the step time,
TFLOP/s per GPU (fitgpt's count: 6 per parameter and attention's full S×S square, as the
peers' figures; a causal kernel does half the square, so the hardware's rate is lower), peak
GiB per GPU; the series stops at its first failure (out of memory or over the time limit).

Everything goes to OUT/<stage>_<name>/ (each run's log and metrics.jsonl) and OUT/summary.json.

Usage (device, from the repository root):
    source benchmarks/device_env.sh
    python3 benchmarks/multi_gpu/context_parallel_gpu.py --gpus 2 --stage parity --out $OUT
    python3 benchmarks/multi_gpu/context_parallel_gpu.py --gpus 2 --stage long --out $OUT
    python3 benchmarks/multi_gpu/context_parallel_gpu.py --gpus 4 --stage long --lengths 131072,262144 \
        --out $OUT
    python3 benchmarks/multi_gpu/context_parallel_gpu.py --gpus 4 --tp 2 --stage long --out $OUT  # T2×C2
    python3 benchmarks/multi_gpu/context_parallel_gpu.py --gpus 4 --stage long --preset qwen2.5-32b \
        --lengths 131072 --out $OUT  # a 32.8 B model at 128 k
One stage per call keeps each under the 10-minute command limit (parity ~3 min on 2×H100;
long at 128 k ~4-6 min with the model's materialisation). --compile on times the compiled
blocks (a one-off compile at the first step; the default off measures eager).
Check on CPU: python3 benchmarks/multi_gpu/context_parallel_gpu.py --tiny --out DIR  (gloo, seconds)
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path


def train(out: Path, name: str, gpus: int, cp: int, args, extra: list[str], limit: float) -> dict:
    """One `fitgpt train` run; its train records and how it ended."""
    run = out / name
    cmd = [
        sys.executable, "-m", "fitgpt", "train", "--plan", "off", "--data", "synthetic",
        "--gpus", str(gpus), "--log-every", "1", "--eval-every", "0", "--no-save",
        "--out", str(run / "run"), "--overwrite", *extra,
    ]  # fmt: skip
    if cp > 1:
        cmd += ["--context-parallel", str(cp)]
    if gpus > 1 and args.tp > 1:  # T·C = the GPUs
        cmd += ["--tensor-parallel", str(args.tp)]
    if args.tiny:
        cmd += ["--device", "cpu", "--cpu-threads", "1"]
    if "--plan" in extra:  # the caller's --plan replaces the default off
        i = cmd.index("--plan")
        del cmd[i : i + 2]
    run.mkdir(parents=True, exist_ok=True)
    print("==", " ".join(cmd[2:]), flush=True)
    t0 = time.time()
    with open(run / "train.log", "w") as log:
        try:
            rc = subprocess.run(
                cmd, stdout=log, stderr=subprocess.STDOUT, timeout=limit, check=False,
                env={**os.environ, "PYTHONUNBUFFERED": "1"},
            ).returncode  # fmt: skip
        except subprocess.TimeoutExpired:
            rc = "timeout"
    metrics = run / "run" / "metrics.jsonl"
    recs = []
    if metrics.exists():
        recs = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
    steps = [r for r in recs if r.get("kind") == "train"]
    tail = (run / "train.log").read_text().strip().splitlines()[-3:]
    res = {"name": name, "rc": rc, "wall_s": round(time.time() - t0, 1), "log_tail": tail}
    res["losses"] = [r["loss"] for r in steps]
    timed = steps[1:] or steps  # the first step carries the warm-up
    if timed:
        res["ms_per_step"] = statistics.median(r["ms_per_step"] for r in timed)
        for key in ("tflops", "mfu", "peak_gib", "tokens_per_s"):
            if key in timed[-1]:
                res[key] = statistics.median(r[key] for r in timed if key in r)
    print(json.dumps({k: v for k, v in res.items() if k != "log_tail"}), flush=True)
    if rc != 0:
        print("\n".join(tail), flush=True)
    return res


def model_flags(args, layers: int | None, seq: int) -> list[str]:
    preset = "tiny-llama" if args.tiny else args.preset
    cut = ["--layers", str(layers)] if layers else []
    return ["--preset", preset, *cut, "--seq-len", str(seq)]


def parity(args, out: Path) -> dict:
    seq = 64 if args.tiny else args.parity_len
    layers = 2 if args.tiny else args.parity_layers
    common = [
        *model_flags(args, layers, seq), "--micro-batch", "1", "--grad-accum", "2",
        "--steps", str(args.parity_steps), "--lr", "1e-4", "--warmup", "1",
        "--engine", "zero", "--zero-stage", "1", "--checkpointing", "full",
        "--compile", args.compile,
    ]  # fmt: skip
    one = train(out, "parity_1gpu", 1, 1, args, common, args.limit)
    cp = args.gpus // args.tp
    many = train(out, f"parity_cp{cp}_tp{args.tp}", args.gpus, cp, args, common, args.limit)
    gaps = [abs(a - b) for a, b in zip(one["losses"], many["losses"])]
    print("step  1 GPU     CP", args.gpus, flush=True)
    for i, (a, b) in enumerate(zip(one["losses"], many["losses"])):
        print(f"{i + 1:4d}  {a:.4f}  {b:.4f}", flush=True)
    ok = bool(gaps) and len(one["losses"]) == len(many["losses"]) and max(gaps) < args.tol
    print(f"max |gap| {max(gaps, default=float('nan')):.4g} (tolerance {args.tol}): "
          f"{'PASS' if ok else 'FAIL'}", flush=True)  # fmt: skip
    return {"one": one, "cp": many, "max_gap": max(gaps, default=None), "pass": ok}


def long(args, out: Path) -> dict:
    lengths = [128, 256] if args.tiny else [int(x) for x in args.lengths.split(",")]
    layers = 2 if args.tiny else None  # the preset's own depth
    res = []
    for seq in lengths:
        flags = [
            *model_flags(args, layers, seq), "--micro-batch", "1", "--grad-accum", "1",
            "--steps", str(args.long_steps), "--lr", "1e-5", "--warmup", "1",
            "--compile", args.compile,
        ]  # fmt: skip
        if args.plan == "fixed":  # the plan this script fixed before the planner priced CP
            flags += [
                "--plan", "off", "--engine", "zero", "--zero-stage", "3",
                "--offload-optimizer", "cpu", "--checkpointing", "cpu",
            ]  # fmt: skip
        else:  # as a user types it: the planner chooses the engine, the tiers, checkpointing
            flags += ["--plan", "auto"]
        cp = args.gpus // args.tp
        name = f"long_{model_flags(args, None, seq)[1]}_cp{cp}_tp{args.tp}_{seq}"
        r = train(out, name, args.gpus, cp, args, flags, args.limit)
        r["seq_len"] = seq
        res.append(r)
        if r["rc"] != 0:
            break  # the next length needs more
    return {"runs": res}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True)
    p.add_argument("--gpus", type=int, default=2, help="GPUs, all in one CP group (2 or 4)")
    p.add_argument(
        "--tp", type=int, default=1, help="--tensor-parallel T beside C = gpus/T (default 1)"
    )
    p.add_argument("--stage", choices=["parity", "long", "both"], default="both")
    p.add_argument("--parity-len", type=int, default=8192)
    p.add_argument("--parity-layers", type=int, default=8)
    p.add_argument("--parity-steps", type=int, default=6)
    p.add_argument("--tol", type=float, default=0.02, help="largest loss gap that passes (bf16)")
    p.add_argument("--lengths", default="131072", help="tokens per sequence for stage long")
    p.add_argument(
        "--preset", default="llama3.1-8b", help="model of stage long (parity: its blocks cut)"
    )
    p.add_argument(
        "--plan",
        choices=["auto", "fixed"],
        default="auto",
        help="stage long: the planner's plan (default), or ZeRO-3 with the optimizer and the "
        "block inputs in host RAM",
    )
    p.add_argument("--long-steps", type=int, default=3, help="steps per length (first untimed)")
    p.add_argument("--compile", default="off", choices=["off", "on", "blocks"])
    p.add_argument("--limit", type=float, default=540.0, help="seconds per run")
    p.add_argument("--tiny", action="store_true", help="CPU check: gloo, tiny-llama, seconds")
    args = p.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.tiny:
        args.tol = 1e-4  # fp32 on the CPU
    summary_path = out / "summary.json"
    summary = json.loads(summary_path.read_text()) if summary_path.exists() else {}
    summary["gpus"] = args.gpus
    if args.stage in ("parity", "both"):
        summary["parity"] = parity(args, out)
    if args.stage in ("long", "both"):
        preset = model_flags(args, None, 0)[1]
        summary[f"long_{preset}_gpus{args.gpus}_tp{args.tp}"] = long(args, out)
    tmp = summary_path.with_suffix(".tmp")
    tmp.write_text(json.dumps(summary, indent=1))
    tmp.rename(summary_path)


if __name__ == "__main__":
    main()
