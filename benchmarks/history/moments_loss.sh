#!/usr/bin/env bash
# Issue 6 (tiered memory): the loss effect of compressed Adam moments on the host tier. The same
# run three times — the tiny preset on Python's own source (the demo's data), 400 steps, every
# block's optimizer state on the host (--offload-optimizer cpu --offload-fraction 1), fp32 on
# the CPU — with the host moments in fp32, bf16 and int8; then one chart of the three loss curves
# and a table. Runs on the 2-core CPU box in about 6 minutes.
# Usage: bash benchmarks/history/moments_loss.sh [OUT_DIR]
set -eu
OUT=${1:-benchmarks/results/moments_loss_cpu_2026-11-22}
PY=${PY:-.venv/bin/python}
mkdir -p "$OUT"
for kind in fp32 bf16 int8; do
  rm -rf "/tmp/fitgpt-moments-$kind"
  $PY -m fitgpt train --preset tiny --data stdlib --steps 400 --device cpu --plan off \
    --engine zero --offload-optimizer cpu --offload-fraction 1 --moments "$kind" \
    --eval-every 100 --log-every 10 --out "/tmp/fitgpt-moments-$kind" > "$OUT/train_$kind.log" 2>&1
  cp "/tmp/fitgpt-moments-$kind/metrics.jsonl" "$OUT/metrics_$kind.jsonl"
done
$PY benchmarks/history/loss_curves.py "$OUT" moments_loss moments fp32 bf16 int8
