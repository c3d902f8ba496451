#!/usr/bin/env bash
# Issue 19 on nvidia-h200-x2: the compiled chunk engine's own kernels (engine/transforms/wgrad.py's
# weight and bias gradients written by their products, engine/transforms/norm.py's LayerNorms
# through ATen) on two real GPUs, where the reducer's hooks and NCCL run after each gradient. GPT-2
# 1.5 B (h=1600, so both apply), bf16, micro-batch 8 x 4, random tokens, 12 steps, `fitgpt train
# --gpus 2`: ZeRO stage 1 eager and compiled, and stage 0 compiled; the losses of each step side by
# side.
# Usage (device): OUT=... bash benchmarks/multi_gpu/compile_x2.sh
set -u
OUT=${OUT:-/tmp/compile_x2}
mkdir -p "$OUT"
export PYTHONPATH=. PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
for run in 1:off 1:on 0:on; do
  stage=${run%%:*} mode=${run##*:}
  timeout 280 python3 -m fitgpt train --gpus 2 --preset gpt2-1.5b --engine zero \
    --zero-stage "$stage" --compile "$mode" --micro-batch 8 --grad-accum 4 --data uniform \
    --steps 12 --log-every 1 --eval-every 0 --no-save --overwrite \
    --out "/tmp/compile_x2/stage${stage}_$mode" > "$OUT/stage${stage}_$mode.log" 2>&1
  echo "stage $stage compile $mode: exit $?"
  grep -E "^compile|^warning|rror" "$OUT/stage${stage}_$mode.log" | cut -c1-160
done
for f in "$OUT"/stage*.log; do
  printf '%-14s' "$(basename "$f" .log)"
  grep -E "^step" "$f" | sed -E 's/.*loss ([0-9.]+).*\| ([0-9]+) ms\/step.*MFU ([0-9.]+)%.*/\1 \2ms \3%/' | tr '\n' ' '
  echo
done
