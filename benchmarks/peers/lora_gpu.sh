#!/usr/bin/env bash
# Issue 51's one-GPU LoRA bar (an H100 with 128 GB RAM; on an H200, GPU_MEM=80GB caps both
# systems at an H100's memory and the results say "H200 capped at 80 GB, standing in for an
# H100"): a Llama-3.1-8B-shaped folder saved by transformers (random weights), chat data through
# `fitgpt data preprocess --chat` at 4,096 tokens, then on the same batches
#   fitgpt train --init-from HF --lora-rank 16 (all-linear) with the planner's plan, and
#   transformers + peft, gradient checkpointing on, the adapters drawn from the same seed
#   (lora_gpu.py peer),
# tokens/s of each and both loss curves in OUT/lora_8b.json and .md (lora_gpu.py compare).
# Stages, one a call or all in one (~5 min on an H200; each under ~540 s):
#   make     the folder, its chat template, 3,000 conversations, preprocessing (~90 s)
#   fitgpt   fitgpt's run (STEPS, default 20; SEED; LR): 4 rows of 4,096 tokens a step as MB x GA,
#            default 2 x 2: the planner fits that without recompute (62 GiB of an 80 GB cap),
#            where micro-batch 4 needs --checkpointing full (92.7 GiB without)
#   peer     the peer on fitgpt's rows and rates (it reads fitgpt's metrics.jsonl), PEER_MB rows a
#            micro-batch (default 4: gradient checkpointing holds them), accumulated to the same 4
#   compare  the results files
# Usage (device): source benchmarks/device_env.sh; [GPU_MEM=80GB] OUT=$OUT bash benchmarks/peers/lora_gpu.sh [all|make|fitgpt|peer|compare]
#   .whl must carry peft. CPU rehearsal (a 2-layer, 64-wide model, 64 tokens, fp32 both):
#   TINY=1 bash benchmarks/peers/lora_gpu.sh
set -u
STAGE=${1:-all}
OUT=${OUT:-/tmp/lora_gpu}
W=${WORK:-/tmp/lora8_work}
MB=${MB:-2} GA=${GA:-2} PEER_MB=${PEER_MB:-4} SEQ=${SEQ:-4096} STEPS=${STEPS:-20} SEED=${SEED:-7}
LR=${LR:-2e-4}
TINY=${TINY:-}
mkdir -p "$OUT" "$W"
export PYTHONUNBUFFERED=1 PYTHONPATH=.${PYTHONPATH:+:$PYTHONPATH}
case $STAGE in all | make | fitgpt | peer | compare) ;; *)
  echo "lora_gpu.sh: no stage $STAGE; use all, make, fitgpt, peer or compare" >&2; exit 2 ;; esac
LABEL=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1)
LABEL=${LABEL:-cpu}
CAP=()
if [ -n "${GPU_MEM:-}" ]; then  # the H100 stand-in: the plan and the allocator at its memory
  CAP=(--gpu-mem "$GPU_MEM" --cpu-mem "${CPU_MEM:-115GB}")
  LABEL="$LABEL capped at $GPU_MEM (--gpu-mem), standing in for an H100 with ${CPU_MEM:-115GB} host RAM"
fi
SMALL=()
[ -n "$TINY" ] && { SMALL=(--tiny --conversations 200); SEQ=64 MB=1 GA=2 PEER_MB=2 STEPS=6; }
if [ $((MB * GA % PEER_MB)) -ne 0 ]; then
  echo "lora_gpu.sh: PEER_MB=$PEER_MB does not divide MB x GA = $((MB * GA)) rows a step" >&2; exit 2
fi
t() { date +%s; }
has() { [ "$STAGE" = all ] || [ "$STAGE" = "$1" ]; }
DATA="$W/chat_chat_document"

if has make; then
  s=$(t)
  python3 benchmarks/stdlib_jsonl.py "$W/pystd.jsonl"
  [ -n "$TINY" ] && { head -150 "$W/pystd.jsonl" > "$W/pystd_small.jsonl"; mv "$W/pystd_small.jsonl" "$W/pystd.jsonl"; }
  python3 benchmarks/peers/lora_gpu.py make "$W" --src "$W/pystd.jsonl" ${SMALL[@]+"${SMALL[@]}"} \
    2>&1 | tail -1 | tee "$OUT/make.log"
  python3 -m fitgpt data preprocess --chat --input "$W/chats.jsonl" --tokenizer "$W/hf" \
    --output-prefix "$W/chat" --seq-len "$SEQ" --workers 8 > "$OUT/preprocess.log" 2>&1 \
    || { tail -3 "$OUT/preprocess.log"; exit 1; }
  tail -2 "$OUT/preprocess.log"
  echo "make: $(($(t) - s)) s"; du -sh "$W/hf"
fi

if has fitgpt; then
  CMD=(python3 -m fitgpt train --init-from "$W/hf" --data "$DATA" --lora-rank 16
    --micro-batch "$MB" --grad-accum "$GA" --seq-len "$SEQ" --steps "$STEPS" --seed "$SEED" --lr "$LR" --warmup 2
    --log-every 1 --eval-every 0 --no-save --overwrite --out "$W/fitgpt_run"
    ${CAP[@]+"${CAP[@]}"})
  [ -n "$TINY" ] && CMD+=(--device cpu)
  read -r -a extra <<< "${EXTRA:-}"  # more train flags, e.g. EXTRA="--checkpointing full"
  CMD+=(${extra[@]+"${extra[@]}"})
  echo "== ${CMD[*]}" | tee "$OUT/fitgpt.log"
  s=$(t)
  "${CMD[@]}" >> "$OUT/fitgpt.log" 2>&1
  echo "== exit $? in $(($(t) - s)) s" | tee -a "$OUT/fitgpt.log"
  grep -E "plan|LoRA|placement|data:|model |step +[0-9]+ \||rror" "$OUT/fitgpt.log" | cut -c1-250 | head -30
  cp "$W/fitgpt_run/metrics.jsonl" "$OUT/fitgpt.metrics.jsonl"
fi

if has peer; then
  s=$(t)
  python3 benchmarks/peers/lora_gpu.py peer "$W" --out "$OUT" --data "$DATA" \
    --lrs "$OUT/fitgpt.metrics.jsonl" --steps "$STEPS" --micro-batch "$PEER_MB" \
    --grad-accum $((MB * GA / PEER_MB)) --seq-len "$SEQ" \
    --seed "$SEED" ${GPU_MEM:+--gpu-mem "$GPU_MEM"} > "$OUT/peer.log" 2>&1
  echo "peer: exit $? in $(($(t) - s)) s"
  grep -vE "^\s*$|[Ww]arn" "$OUT/peer.log" | tail -6 | cut -c1-250
fi

if has compare; then
  python3 benchmarks/peers/lora_gpu.py compare "$W" --out "$OUT" \
    --metrics "$OUT/fitgpt.metrics.jsonl" --label "$LABEL"
fi
