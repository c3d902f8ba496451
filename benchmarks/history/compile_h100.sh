#!/usr/bin/env bash
# Issue 19 on one GPU (nvidia-h100-x1): `fitgpt train --compile off` against `--compile on`
# (compiled blocks and head+loss, engine/transforms/compile.py), same tokens (random, the model's
# vocabulary), bf16, seq 1024, 4 accumulation steps, --engine zero at the planner's choice
# otherwise: GPT-2 124 M at micro-batch 12, GPT-2 1.5 B and the 2.7b preset at micro-batch 8.
# Each run in its own process (a cold dynamo cache; Inductor's disk cache is whatever the
# machine has: the log's `compile:` line says the seconds). Logs and metrics.jsonl to $OUT; the
# steady-state ms/step is the last log line's (steps 21-40), compile_s the `compile` record's.
# Usage (device): OUT=... bash benchmarks/history/compile_h100.sh
#   (SIZES=2.7b:8 MODES="on off": one size)
set -u
OUT=${OUT:-/tmp/compile}
mkdir -p "$OUT"
export PYTHONPATH=. PYTHONUNBUFFERED=1
# SIZES: a subset, e.g. SIZES="2.7b:8"; MODES: the order of the compile settings, e.g. "on off"
for spec in ${SIZES:-gpt2-125m:12 gpt2-1.5b:8 2.7b:8}; do
  spec=${spec/:/ }
  set -- $spec
  for c in ${MODES:-off on}; do
    name=$1-compile-$c
    python3 -m fitgpt train --preset "$1" --data uniform --engine zero --compile "$c" \
      --micro-batch "$2" --grad-accum 4 --steps 40 --warmup 4 --lr 1e-4 --min-lr 1e-5 \
      --log-every 20 --eval-every 0 --no-save --out "/tmp/runs/$name" > "$OUT/$name.log" 2>&1
    echo "$name exit $?"; grep -E "^compile:|^warning: compile" "$OUT/$name.log"; tail -1 "$OUT/$name.log"
    cp "/tmp/runs/$name/metrics.jsonl" "$OUT/$name.metrics.jsonl" 2>/dev/null
  done
done
