#!/usr/bin/env bash
# Issue 6, first GPU look at the host tier on nvidia-h100-x1:
#   part "check": benchmarks/gpu_check.py (every ZeRO stage and host-tier placement against the
#     plain engine on the GPU)
#   part "big": fitgpt (the planner's choice: the GPU filled first, the last blocks' optimizer
#     state on the host) at 8.07 B (38 layers), 10.08 B (48) and 10.89 B (52), hidden 4096, the
#     ANCHORS protocol; each trial records throughput, GPU peak, host RSS and the prediction.
# Usage (device): OUT=... bash benchmarks/history/offload_h100.sh check|big
set -u
OUT=${OUT:-/tmp/offload}
mkdir -p "$OUT"
export PYTHONPATH=. PYTHONUNBUFFERED=1
case "${1:-check}" in
  check) python3 benchmarks/gpu_check.py "$OUT/gpu_check.json" ;;
  big)
    python3 -m fitgpt bench sweep --systems fitgpt --sizes 38,48,52 --warmup 1 --steps 3 \
      --time-limit 280 --out "$OUT/offload_big.jsonl" ;;
esac
