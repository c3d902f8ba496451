#!/usr/bin/env bash
# The frozen LoRA base on a GPU, first contact (issue 51): a Llama-3.1-8B-shaped base built from
# its preset straight into its tiers (random weights), LoRA r=16 on every linear, 3 steps of
# synthetic tokens at 4,096: the base in NF4 (bitsandbytes' CUDA kernels) with the planner's
# placement on an 80 GB share of the GPU (--gpu-mem), then in bf16 with 16 of its 32 blocks
# streamed from pinned host RAM. Logs in OUT.
# Usage (device; .whl carries bitsandbytes): source benchmarks/device_env.sh;
#   OUT=$OUT bash benchmarks/checks/qlora_smoke_gpu.sh
set -u
OUT=${OUT:-/tmp/qlora_smoke}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH=.${PYTHONPATH:+:$PYTHONPATH}
COMMON=(--preset llama3.1-8b --lora-rank 16 --data synthetic --micro-batch 1 --seq-len 4096
  --steps 3 --log-every 1 --eval-every 0 --no-save --overwrite)
timeout "${T1:-100}" python3 -m fitgpt train "${COMMON[@]}" --base-format nf4 --gpu-mem 80GB \
  --out /tmp/ql_nf4 > "$OUT/nf4.log" 2>&1; echo "== nf4: exit $?"
grep -E "LoRA:|placement|step |rror" "$OUT/nf4.log" | cut -c1-260
timeout "${T2:-80}" python3 -m fitgpt train "${COMMON[@]}" --base-format bf16 --base-host-blocks 16 \
  --out /tmp/ql_bf16 > "$OUT/bf16_host16.log" 2>&1; echo "== bf16 host 16: exit $?"
grep -E "LoRA:|placement|step |rror" "$OUT/bf16_host16.log" | cut -c1-260
