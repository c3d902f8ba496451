#!/usr/bin/env bash
# Issue 3 on nvidia-h200-x2 (2 GPUs), all through the harness (`fitgpt bench sweep`):
#   part "speed": gpt2-1.5b (48×1600, 25 heads, tied), bf16, micro-batch 8, seq 1024, 4
#     accumulation steps, no activation checkpointing (it fits): ddp and ZeRO stages 1/2/3,
#     50 steps each (2 warm-up + 48 timed) — every step's loss is recorded for the agreement check.
#   part "capacity": hidden 4096 (untied, the ANCHORS protocol), checkpointing every block:
#     ddp at 32/34/36 layers and ZeRO-3 at 64/72/80 layers; each line stops at its first failure.
# Usage (device): OUT=... bash benchmarks/history/zero_x2.sh speed|capacity
set -u
OUT=${OUT:-/tmp/zero_x2}
mkdir -p "$OUT"
export PYTHONPATH=. PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
case "${1:-speed}" in
  speed)
    python3 -m fitgpt bench sweep --gpus 2 --systems ddp,zero1,zero2,zero3 --sizes 48 \
      --hidden 1600 --heads 25 --tie-embeddings --checkpointing off --micro-batch 8 \
      --grad-accum 4 --warmup 2 --steps 48 --time-limit 240 --out "$OUT/zero_x2_speed.jsonl" ;;
  capacity)
    python3 -m fitgpt bench sweep --gpus 2 --systems ddp --sizes 32,34,36 --warmup 1 --steps 2 \
      --time-limit 200 --out "$OUT/zero_x2_capacity.jsonl"
    python3 -m fitgpt bench sweep --gpus 2 --systems zero3 --sizes 64,72,80 --warmup 1 --steps 2 \
      --time-limit 240 --out "$OUT/zero_x2_capacity.jsonl" ;;
esac
