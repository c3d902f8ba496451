#!/usr/bin/env bash
# Issue 18 (15 · stall-free update): the speculative update on nvidia-h100-x1 against the same
# engine with it off (fitgpt-no-speculate) and DeepSpeed ZeRO-3 offload, one sweep, the ANCHORS
# protocol of benchmarks/history/sweep_h100.sh (hidden 4096, 32 heads, seq 1024, micro-batch
# 8 x 4, bf16, full checkpointing), 1 warm-up + 2 timed steps per trial. Sizes: 20 layers
# 4.44 B, 38 8.07 B, 56 11.69 B. The step breakdown of each record (breakdown_s) holds
# speculated_steps_total and rollbacks_total. Resumable like sweep_h100.sh: each call works
# until DEADLINE (default 540 s).
# Usage (device, carry .whl): OUT=... bash benchmarks/history/speculate_h100.sh
set -u
OUT=${OUT:-/tmp/speculate}
RES=benchmarks/results/speculate_h100_$(date +%F)
DEADLINE=${DEADLINE:-540}
mkdir -p "$OUT" "$RES"
source benchmarks/device_env.sh  # the carried wheels (DeepSpeed), GPUs, RAM, disk
T0=$(date +%s)
left() { echo $(( DEADLINE - ($(date +%s) - T0) )); }
run() {  # SYSTEMS SIZES TIME_LIMIT
  local budget; budget=$(left)
  [ "$budget" -gt 20 ] || return 0
  timeout -s TERM $((budget + 30)) python3 -m fitgpt bench sweep --systems "$1" --sizes "$2" \
    --warmup 1 --steps 2 --time-limit "$3" --budget "$budget" --out "$RES/sweep.jsonl"
}
run fitgpt,fitgpt-no-speculate 38,56,20 300
run deepspeed-z3-offload 20 300
cp "$RES/sweep.jsonl" "$OUT/sweep.jsonl"
python3 -m fitgpt bench report "$RES/sweep.jsonl" || true
