#!/usr/bin/env bash
# Issue 6 (tiered memory): the loss effect of the one-step-delayed update (--delayed-update,
# ZeRO-Offload's DPU). The same run three times — the tiny preset on Python's own source (the
# demo's data), 400 steps, every block's optimizer state on the host (--offload-optimizer cpu
# --offload-fraction 1), fp32 on the CPU, validation every 100 steps — without the delay, with it
# from step 40 (the default), and with it from the first step; then one chart and a table.
# Runs on the 2-core CPU box in about 6 minutes.
# Usage: bash benchmarks/dpu_loss.sh [OUT_DIR]
set -eu
OUT=${1:-benchmarks/results/dpu_loss_cpu_2026-11-22}
PY=${PY:-.venv/bin/python}
mkdir -p "$OUT"
run() {  # NAME FLAGS...
  local name=$1; shift
  rm -rf "/tmp/fitgpt-dpu-$name"
  $PY -m fitgpt train --preset tiny --data stdlib --steps 400 --device cpu --plan off \
    --engine zero --offload-optimizer cpu --offload-fraction 1 "$@" \
    --eval-every 100 --log-every 10 --out "/tmp/fitgpt-dpu-$name" > "$OUT/train_$name.log" 2>&1
  cp "/tmp/fitgpt-dpu-$name/metrics.jsonl" "$OUT/metrics_$name.jsonl"
}
run no-delay
run delay-after-40 --delayed-update --delayed-update-after 40
run delay-from-0 --delayed-update --delayed-update-after 0
$PY benchmarks/loss_curves.py "$OUT" dpu_loss "update" no-delay delay-after-40 delay-from-0
