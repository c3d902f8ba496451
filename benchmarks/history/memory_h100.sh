#!/usr/bin/env bash
# Issue 4 on nvidia-h100-x1: the memory model against measurement, and capacity by real trials.
#   part "model": `fitgpt probe`, then 8 configurations (ddp, ZeRO stages 0/1/3 × checkpointing
#     off/full) at hidden 4096 × 8 layers (2.03 B, the ANCHORS protocol), each trial recording the
#     measured GPU peak and host RSS beside the memory model's prediction.
#   part "capacity-a": `fitgpt capacity` for ddp and ZeRO stage 0; "capacity-b": stages 1, 2, 3.
# Usage (device): OUT=... bash benchmarks/history/memory_h100.sh model|capacity-a|capacity-b
set -u
OUT=${OUT:-/tmp/memory}
mkdir -p "$OUT"
export PYTHONPATH=. PYTHONUNBUFFERED=1
case "${1:-model}" in
  model)
    python3 -m fitgpt probe 2>&1 | tee "$OUT/probe.txt"
    for ck in off full; do
      python3 -m fitgpt bench sweep --systems ddp,zero0,zero1,zero3 --sizes 8 --checkpointing $ck \
        --warmup 1 --steps 2 --time-limit 200 --out "$OUT/memory_model.jsonl"
    done ;;
  capacity-a)
    for sys in ddp zero0; do
      python3 -m fitgpt capacity --system $sys --max-trials 4 --out "$OUT/capacity.jsonl"
    done ;;
  capacity-b)
    for sys in zero1 zero2 zero3; do
      python3 -m fitgpt capacity --system $sys --max-trials 4 --out "$OUT/capacity.jsonl"
    done ;;
esac
