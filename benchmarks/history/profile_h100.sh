#!/usr/bin/env bash
# Issue 16 (fastest at every size): where a compiled step's time goes, by `fitgpt train
# --profile 3` on nvidia-h100-x1, at GPT-2 124 M (micro-batch 12 x 4 accumulation steps, the
# nanoGPT comparison's batch) and at the 2.7b preset (micro-batch 8 x 4, the MFU run's), random
# tokens, bf16. Each run's profile/summary.txt (the kernels' share of the wall time, the 30 ops
# with the most self time) and its gzipped Chrome trace are copied to $OUT.
# Usage (device): OUT=... [PRESETS="2.7b:8"] bash benchmarks/history/profile_h100.sh
set -u
OUT=${OUT:-/tmp/profile}
mkdir -p "$OUT"
export PYTHONPATH=. PYTHONUNBUFFERED=1
for spec in ${PRESETS:-gpt2-125m:12 2.7b:8}; do
  set -- ${spec/:/ }
  run=/tmp/profile_runs/$1
  timeout 280 python3 -m fitgpt train --preset "$1" --data uniform --micro-batch "$2" \
    --grad-accum 4 --steps 8 --compile on --profile 3 --log-every 1 --eval-every 0 --no-save \
    --overwrite --out "$run" > "$OUT/$1.log" 2>&1
  echo "$1: exit $?"; grep -E "^step|^profile|^compile" "$OUT/$1.log" | cut -c1-160
  cp "$run/profile/summary.txt" "$OUT/$1.summary.txt" 2>/dev/null
  gzip -c "$run/profile/trace.json" > "$OUT/$1.trace.json.gz" 2>/dev/null
  head -40 "$OUT/$1.summary.txt" 2>/dev/null | cut -c1-170
done
