#!/usr/bin/env bash
# Issue 1 on one GPU (nvidia-h100-x1): the trainer on the 2.7b preset in bf16, micro-batch 8,
# seq 1024, 4 accumulation steps, random tokens; both engines, activation checkpointing off
# (it fits) and full. Each run in its own process; metrics.jsonl of each copied to $OUT.
# Usage (device): OUT=... bash benchmarks/history/mfu_2p7b.sh
set -u
OUT=${OUT:-/tmp/mfu}
mkdir -p "$OUT"
export PYTHONPATH=. PYTHONUNBUFFERED=1
for engine in ddp zero; do
  for ck in off full; do
    name=2p7b-$engine-ckpt-$ck
    python3 -m fitgpt train --preset 2.7b --data uniform --engine "$engine" --checkpointing "$ck" \
      --micro-batch 8 --grad-accum 4 --steps 16 --warmup 4 --lr 1e-4 --min-lr 1e-5 \
      --log-every 4 --eval-every 0 --no-save --out "/tmp/runs/$name" > "$OUT/$name.log" 2>&1
    echo "$name exit $?"; tail -2 "$OUT/$name.log"
    cp "/tmp/runs/$name/metrics.jsonl" "$OUT/$name.metrics.jsonl" 2>/dev/null
  done
done
