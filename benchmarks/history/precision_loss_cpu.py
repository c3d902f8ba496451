"""Issue 19's validation-loss gap: does fitgpt's precision scheme learn slower than nanoGPT's?

nanoGPT trains fp32 weights under bf16 autocast: its residual stream, LayerNorms and embeddings
stay fp32, the matrix products run in bf16. fitgpt's chunk engine keeps bf16 working weights
(fp32 master and moments): everything the forward touches is bf16, and the gradients accumulate
in bf16 over micro-batches. fitgpt's `--engine ddp` is nanoGPT's scheme (fp32 parameters, bf16
autocast, fused AdamW). The two engines start from the same weights (seeded by name) and read
the same batches, so per seed the runs are paired: only the precision scheme differs.

A small model on real text on the CPU (the standard library's source, byte tokenizer, so the
head is small): `fitgpt train` per engine and seed, the validation loss at the end.

    python3 benchmarks/history/precision_loss_cpu.py --data PREFIX --out DIR [--seeds 0,1,2]
        [--steps 400]
PREFIX: `fitgpt data preprocess --tokenizer bytes` output. Writes DIR/precision_loss.jsonl.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

MODEL = ["--layers", "4", "--hidden", "128", "--heads", "4", "--seq-len", "256"]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", required=True)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--steps", type=int, default=400)
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    for seed in args.seeds.split(","):
        for engine in ("zero", "ddp"):
            run = args.out / f"{engine}_seed{seed}"
            cmd = [
                sys.executable, "-m", "fitgpt", "train", "--data", args.data, *MODEL,
                "--micro-batch", "8", "--grad-accum", "2", "--steps", str(args.steps),
                "--warmup", str(args.steps // 10), "--lr", "1e-3", "--min-lr", "1e-4",
                "--weight-decay", "0.1", "--grad-clip", "1.0", "--beta2", "0.95",
                "--engine", engine, "--precision", "bf16", "--seed", seed,
                "--log-every", "50", "--eval-every", str(args.steps), "--eval-batches", "50",
                "--no-save", "--out", str(run), "--overwrite",
            ]  # fmt: skip
            with open(args.out / f"{engine}_seed{seed}.log", "w") as f:
                rc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT).returncode
            recs = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
            val = [r["val_loss"] for r in recs if r.get("kind") == "eval"]
            train = [r["loss"] for r in recs if r.get("kind") == "train"]
            rec = {"engine": engine, "seed": int(seed), "rc": rc, "steps": args.steps,
                   "val_loss": val[-1] if val else None,
                   "train_loss_last_logged": train[-1] if train else None}  # fmt: skip
            print(json.dumps(rec), flush=True)
            with open(args.out / "precision_loss.jsonl", "a") as f:
                f.write(json.dumps(rec) + "\n")


if __name__ == "__main__":
    main()
