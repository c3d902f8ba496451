#!/usr/bin/env bash
# Issue 19's "no offloaded size slower than before" on nvidia-h100-x1: presets the planner trains
# with blocks' optimizer state in host RAM (6.7b, 13b; their weights streamed too), as `fitgpt
# train` runs them with each --compile mode: off (every run before issue 19), on (the blocks
# compiled), auto (what a user gets: a long run, STEPS_AUTO steps, stopped by `timeout` after
# AUTO_S seconds, so its log shows what auto chose and the first steps). The planner picks the
# rest of each plan. The first mode first, so a call cut short still holds the baseline. Each
# run's log and metrics.jsonl to $OUT.
# Usage (device): source benchmarks/device_env.sh
#   OUT=... [PRESETS="6.7b 13b"] [MODES="off on auto"] [AUTO_S=120] bash benchmarks/history/offload_compile_h100.sh [STEPS]
set -u
OUT=${OUT:-/tmp/offload_compile}
STEPS=${1:-6}
mkdir -p "$OUT"
export PYTHONPATH=. PYTHONUNBUFFERED=1
for preset in ${PRESETS:-13b}; do
  for c in ${MODES:-off on}; do
    name=$preset-compile-$c
    steps=$STEPS; limit=0
    if [ "$c" = auto ]; then steps=${STEPS_AUTO:-300}; limit=${AUTO_S:-120}; fi
    timeout "$limit" python3 -m fitgpt train --preset "$preset" --data uniform --compile "$c" \
      --steps "$steps" --warmup 2 --log-every 1 --eval-every 0 --no-save --overwrite \
      --out "/tmp/runs/$name" > "$OUT/$name.log" 2>&1
    echo "$name exit $?"; grep -E "^plan|^model|^placement|^compile" "$OUT/$name.log" | cut -c1-300
    grep -E "^step" "$OUT/$name.log" | tail -2
    cp "/tmp/runs/$name/metrics.jsonl" "$OUT/$name.metrics.jsonl" 2>/dev/null
  done
done
