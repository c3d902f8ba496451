#!/usr/bin/env bash
# Issue 36 on nvidia-h100-x1: where a Llama-3.1-8B step's time goes, one call. The 2026-11-26
# run (results/llama_h100_2026-11-26) stepped at 419 model TFLOP/s (bar 420) and 18% over the
# plan's 6.80 s; its log did not come back, so nothing says which kernels took the time.
#   1. `fitgpt probe` (this machine's rates, the attention rate included: the plans below use them)
#   2. `fitgpt train --preset llama3.1-8b --data synthetic` at micro-batch 4 x 4 x 4096, the
#      planner's plan, 6 steps, --profile 1 (the 4th step: kernel table in profile/summary.txt)
#   3. the same with --compile on (the planner prices compiled checkpointed blocks 8% slower,
#      measured on GPT-2 blocks; a Llama block has more elementwise work to fuse: rotary, SwiGLU)
#   4. packed rows' FlexAttention against the mask path (benchmarks/parts/packed_attention_gpu.py --model)
# Usage (device): source benchmarks/device_env.sh; OUT=$OUT bash benchmarks/peers/llama_speed_h100.sh
set -u
OUT=${OUT:-/tmp/llama_speed}
mkdir -p "$OUT"
export PYTHONPATH=.${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
T0=$(date +%s)
el() { echo "[$(( $(date +%s) - T0 )) s]"; }
timeout 100 python3 -m fitgpt probe > "$OUT/probe.txt" 2>&1; echo "$(el) probe: exit $?"
tail -6 "$OUT/probe.txt" | cut -c1-200
FLAGS=(--preset llama3.1-8b --data synthetic --micro-batch 4 --grad-accum 4 --seq-len 4096
  --steps 6 --log-every 1 --eval-every 0 --lr 1e-5 --no-save --overwrite)
for mode in eager compiled; do
  extra=(); [ $mode = compiled ] && extra=(--compile on)
  timeout 210 python3 -m fitgpt train "${FLAGS[@]}" "${extra[@]}" --profile 1 \
    --out "/tmp/speed_$mode" > "$OUT/train_$mode.log" 2>&1
  echo "$(el) train $mode: exit $?"
  grep -E "plan:|step |profile|rror" "$OUT/train_$mode.log" | cut -c1-260
  cp "/tmp/speed_$mode/profile/summary.txt" "$OUT/profile_$mode.txt" 2>/dev/null \
    && head -40 "$OUT/profile_$mode.txt" | cut -c1-200
done
timeout 90 python3 benchmarks/parts/packed_attention_gpu.py --model > "$OUT/packed_attention.jsonl" 2>&1
echo "$(el) packed attention: exit $?"; tail -5 "$OUT/packed_attention.jsonl" | cut -c1-300
