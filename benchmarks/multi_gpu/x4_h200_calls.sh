#!/usr/bin/env bash
# Issues 36 and 37 on one warm 4-GPU machine (nvidia-h200-x4, asked with needs_h200: the 70 B
# at micro-batch 2 needs H200 memory), in three calls that each fit the 10-minute command limit:
#   one   the Llama-3.1-70B folder and its data made in the background (CPU and disk, ~260 s:
#         benchmarks/multi_gpu/llama70_x4.sh make) while the GPUs run context parallelism for the first
#         time: loss parity of --context-parallel 2 against one GPU, then the planner's plans
#         at 131,072 tokens per sequence for the 8.03 B Llama-3.1-8B and the 32.76 B Qwen2.5-32B
#         on 4 GPUs (--context-parallel 4);
#   l70   `fitgpt train --gpus 4 --init-from` the 70 B, micro-batch 2 × 4, compiled blocks;
#   cp512 the 8 B at 524,288 tokens per sequence on 4 GPUs, the planner's plan.
# The make stage's folder stays under /tmp while the machine is warm, so `l70` must follow `one`
# within the machine's idle release. Only a few files come back per call: each stage leaves its
# summary and logs' step lines under $OUT.
# Usage (device): OUT=$OUT bash benchmarks/multi_gpu/x4_h200_calls.sh one|l70|cp512
set -u
STAGE=${1:?one, l70 or cp512}
OUT=${OUT:-/tmp/x4calls}
CP=/tmp/x4_cp  # every CP run's log and metrics (too many files to bring back)
mkdir -p "$OUT" "$CP"
source benchmarks/device_env.sh
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONUNBUFFERED=1 PYTHONPATH=.${PYTHONPATH:+:$PYTHONPATH}
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | sort | uniq -c
cp_lines() {  # each CP run's plan and step lines, for the results folder
  for f in "$CP"/*/train.log; do
    echo "== $f"; grep -E "plan:|step |rror|refus|memory" "$f" | cut -c1-300 | head -12
  done > "$OUT/cp_logs.txt"
  cp "$CP/summary.json" "$OUT/cp_summary.json" 2>/dev/null
}
case "$STAGE" in
one)
  ( OUT=$OUT/l70 bash benchmarks/multi_gpu/llama70_x4.sh make > "$OUT/l70_make.txt" 2>&1 ) &
  MAKE=$!
  python3 benchmarks/multi_gpu/context_parallel_gpu.py --gpus 2 --stage parity --parity-steps 5 \
    --limit 180 --out "$CP"
  python3 benchmarks/multi_gpu/context_parallel_gpu.py --gpus 4 --stage long --lengths 131072 \
    --limit 150 --out "$CP"
  python3 benchmarks/multi_gpu/context_parallel_gpu.py --gpus 4 --stage long --preset qwen2.5-32b \
    --lengths 131072 --limit 240 --out "$CP"
  cp_lines
  wait $MAKE
  cat "$OUT/l70_make.txt"
  ;;
l70)
  MB=2 GA=4 STEPS=5 EXTRA="--compile on" LIMIT=575 OUT=$OUT/l70 bash benchmarks/multi_gpu/llama70_x4.sh train
  ;;
cp512)
  python3 benchmarks/multi_gpu/context_parallel_gpu.py --gpus 4 --stage long --lengths 524288 \
    --long-steps 2 --limit 540 --out "$CP"
  cp_lines
  ;;
*) echo "unknown stage $STAGE: one, l70 or cp512"; exit 2 ;;
esac
