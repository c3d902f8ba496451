#!/usr/bin/env bash
# Issue 19's "no offloaded size slower than before" on nvidia-h100-x1: the 13b preset, which the
# planner trains with most blocks' optimizer state in host RAM, as `fitgpt train` runs it with
# the blocks compiled (--compile on; auto picks it for runs of ~333 s or more) and eagerly
# (--compile off: every run before issue 19). The planner picks the rest of each plan. Eager
# first, so a call cut short still holds the baseline. Each run's log and metrics.jsonl to $OUT.
# Usage (device): source benchmarks/device_env.sh; OUT=... bash benchmarks/offload_compile_h100.sh [STEPS]
set -u
OUT=${OUT:-/tmp/offload_compile}
STEPS=${1:-6}
mkdir -p "$OUT"
export PYTHONPATH=. PYTHONUNBUFFERED=1
for c in off on; do
  name=13b-compile-$c
  python3 -m fitgpt train --preset 13b --data uniform --compile "$c" --steps "$STEPS" --warmup 2 \
    --log-every 1 --eval-every 0 --no-save --overwrite --out "/tmp/runs/$name" > "$OUT/$name.log" 2>&1
  echo "$name exit $?"; grep -E "^plan|^placement|^compile" "$OUT/$name.log"; tail -2 "$OUT/$name.log"
  cp "/tmp/runs/$name/metrics.jsonl" "$OUT/$name.metrics.jsonl" 2>/dev/null
done
