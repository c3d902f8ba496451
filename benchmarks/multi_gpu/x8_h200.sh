#!/usr/bin/env bash
# Issue 8 (the seed's headline run) on nvidia-h200-x8: one `fitgpt bench sweep` over 8 GPUs per
# trial — fitgpt (the planner's choice, the disk offered as a third tier), each of its five
# ablations, torch DDP and DeepSpeed ZeRO-3 offload — at hidden 8192 (64 heads, seq 1024, untied
# head, micro-batch 8 x 4 accumulation, bf16), 1 warm-up + 2 timed steps per trial; then
# `fitgpt capacity` for fitgpt with and without the disk tier, for DDP and for DeepSpeed.
#
# Sizes (layers; hidden 8192 untied: N = L*805.4M + 824M):
#   4 4.0 B, 8 7.3 B, 16 13.7 B, 32 26.6 B, 64 52.4 B, 100 81.4 B, 124 100.7 B
# One results folder, filled by as many calls as it takes (each works until DEADLINE seconds,
# default 540; the next call resumes). Between calls copy $OUT/*.jsonl back to $RES.
# A check on fewer GPUs at small sizes: GPUS=2 SIZES=1,2 CAPACITY=0 RES=/tmp/x8check bash ...
# Usage (device, carry .whl): OUT=... bash benchmarks/multi_gpu/x8_h200.sh
set -u
OUT=${OUT:-/tmp/x8}
RES=${RES:-benchmarks/results/x8_h200}
GPUS=${GPUS:-8}
SIZES=${SIZES:-4,8,16,32,64,100,124}
CAPACITY=${CAPACITY:-1}
DEADLINE=${DEADLINE:-540}
NVME=/tmp/fitgpt-nvme
MODEL="--hidden 8192 --heads 64"
mkdir -p "$OUT" "$RES" "$NVME"
source benchmarks/device_env.sh
T0=$(date +%s)
left() { echo $(( DEADLINE - ($(date +%s) - T0) )); }
sweep() {  # SYSTEMS SIZES TIME_LIMIT
  local budget; budget=$(left)
  [ "$budget" -gt 20 ] || return 0
  timeout -s TERM $((budget + 30)) python3 -m fitgpt bench sweep --gpus "$GPUS" $MODEL \
    --systems "$1" --sizes "$2" --warmup 1 --steps 2 --time-limit "$3" --budget "$budget" \
    --nvme-path "$NVME" --out "$RES/sweep.jsonl"
}
capacity() {  # NAME ARGS...
  local name=$1 budget; shift; budget=$(left)
  [ "$budget" -gt 60 ] && [ ! -s "$RES/capacity_$name.jsonl.done" ] || return 0
  timeout -s TERM "$budget" python3 -m fitgpt capacity --gpus "$GPUS" $MODEL "$@" \
    --out "$RES/capacity_$name.jsonl" && touch "$RES/capacity_$name.jsonl.done"
}
sweep fitgpt,ddp,deepspeed-z3-offload "$SIZES" 540
sweep fitgpt-no-offload,fitgpt-no-ckpt,fitgpt-no-zero,fitgpt-no-accum "$SIZES" 540
sweep fitgpt-no-mixed "$SIZES" 240
if [ "$CAPACITY" = 1 ]; then
  capacity fitgpt-nvme --system fitgpt --nvme-path "$NVME"
  capacity fitgpt --system fitgpt
  capacity ddp --system ddp
  capacity deepspeed --system deepspeed-z3-offload
fi
cp "$RES"/*.jsonl "$OUT"/ 2>/dev/null
python3 -m fitgpt bench report "$RES/sweep.jsonl" --out-dir "$OUT" 2>&1 | tail -3
