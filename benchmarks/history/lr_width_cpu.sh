#!/usr/bin/env bash
# The default learning rate against width on CPU: a wide, shallow model (2 layers × 4096, the
# 6.7b preset's width; byte vocabulary, seq 128, micro-batch 2) on the standard library's source,
# 8 steps of the default 50-step warm-up, at the old fixed default (--lr 2e-3 --min-lr 2e-4) and
# at the rate `fitgpt train` now works out from the width (train/schedule.py default_lr).
# Both start from the same weights and read the same batches. Each run's log goes to $OUT.
# Usage: OUT=... bash benchmarks/history/lr_width_cpu.sh
set -u
OUT=${OUT:-/tmp/lr_width}
mkdir -p "$OUT"
export PYTHONPATH=. PYTHONUNBUFFERED=1
PY=${PY:-python3}
for mode in fixed-2e-3 by-width; do
  extra=()
  [ "$mode" = fixed-2e-3 ] && extra=(--lr 2e-3 --min-lr 2e-4)
  $PY -m fitgpt train --preset tiny --layers 2 --hidden 4096 --heads 32 --seq-len 128 \
    --micro-batch 2 --grad-accum 1 --steps 8 --log-every 1 --eval-every 0 --no-save \
    --data stdlib --out "/tmp/lr_width_runs/$mode" --overwrite "${extra[@]}" > "$OUT/$mode.log" 2>&1
  echo "$mode exit $?"
done
