#!/usr/bin/env bash
# Issue 6 (tiered memory): the loss effect of compressed Adam moments on the host tier. The same
# run three times — the tiny preset on Python's own source (the demo's data), 400 steps, every
# block's optimizer state on the host (--offload-optimizer cpu --offload-fraction 1), fp32 on
# the CPU — with the host moments in fp32, bf16 and int8; then one chart of the three loss curves
# and a table. Runs on the 2-core CPU box in about 6 minutes.
# Usage: bash benchmarks/moments_loss.sh [OUT_DIR]
set -eu
OUT=${1:-benchmarks/results/moments_loss_cpu_2026-11-22}
PY=${PY:-.venv/bin/python}
mkdir -p "$OUT"
for kind in fp32 bf16 int8; do
  rm -rf "/tmp/fitgpt-moments-$kind"
  $PY -m fitgpt train --preset tiny --data stdlib --steps 400 --device cpu --plan off \
    --engine zero --offload-optimizer cpu --offload-fraction 1 --host-moments "$kind" \
    --eval-every 100 --log-every 10 --out "/tmp/fitgpt-moments-$kind" > "$OUT/train_$kind.log" 2>&1
  cp "/tmp/fitgpt-moments-$kind/metrics.jsonl" "$OUT/metrics_$kind.jsonl"
done
$PY - "$OUT" <<'PY'
import json
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

out = Path(sys.argv[1])
rows = {}
for kind in ("fp32", "bf16", "int8"):
    recs = [json.loads(x) for x in (out / f"metrics_{kind}.jsonl").read_text().splitlines() if x]
    rows[kind] = recs
fig, ax = plt.subplots(figsize=(7, 4))
lines = ["| moments | train loss, last 50 steps (mean) | validation loss at 100 / 200 / 300 / 400 | tokens/s (median) |", "|---|---|---|---|"]
for kind, recs in rows.items():
    train = [r for r in recs if r.get("kind") == "train"]
    evals = [r for r in recs if r.get("kind") == "eval"]
    ax.plot([r["step"] for r in train], [r["loss"] for r in train], label=f"{kind} moments", lw=1)
    tail = [r["loss"] for r in train if r["step"] > train[-1]["step"] - 50]
    tps = sorted(r["tokens_per_s"] for r in train)
    val = " / ".join(f"{r['val_loss']:.4f}" for r in evals)
    lines.append(f"| {kind} | {sum(tail) / len(tail):.4f} | {val} | {tps[len(tps) // 2]:,.0f} |")
ax.set_xlabel("step")
ax.set_ylabel("training loss")
ax.set_ylim(top=3.5)
ax.grid(alpha=0.3)
ax.legend()
fig.savefig(out / "moments_loss.png", dpi=120, bbox_inches="tight")
(out / "moments_loss.md").write_text("\n".join(lines) + "\n")
print("\n".join(lines))
PY
