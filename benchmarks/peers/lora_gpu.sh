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
# The 70B bar's runs (H100 stand-in: GPU_MEM=80GB; synthetic rows, micro-batch 1 x 4,096):
#   q70      fitgpt's QLoRA of the llama3.1-70b preset (NF4 base built at random into its tiers,
#            the planner's --checkpointing full: 54.9 GiB planned at 80 GB) against the runnable
#            peer: no 141 GB folder fits an H100 box's disk or RAM, so lora_gpu.py qpeer builds transformers'
#            Llama of the shape with bitsandbytes NF4 linears from random weights on the GPU and
#            trains it as the QLoRA recipe does (peft k-bit preparation, gradient checkpointing,
#            paged 8-bit AdamW); the same rows, STEPS70 steps (default 8); tokens/s against the
#            1.5x bar (OUT/qlora_70b.json, .md). Different random bases: losses not compared.
#   q70-fitgpt q70's fitgpt run alone, as q70_fitgpt_only (to time a second setting, EXTRA70's or
#            none, beside a q70 call without running the peer again)
#   q70-long the longest --seq-len the planner accepts for that run (`fitgpt plan --lora-rank`,
#            bisected in steps of 4,096 from 4,096 to 131,072; its recompute: cpu past ~36 k),
#            then 2 steps of it
#   l70-bf16 the bf16 base of the same preset streamed from host RAM (the planner: 31 of 80
#            blocks on an 80 GB GPU, 49 from 115 GB of host RAM), STEPS70 steps
#   q70-alt  q70's fitgpt run two other ways, to tell apart what the planner's choice rests on
#            (since 2026-11-28 it streams 78 of 80 NF4 blocks to keep 41 blocks' activations):
#            every block on the GPU (--base-host-blocks 0, the most blocks kept that then fit),
#            and every block recomputed (--keep-activations 0, the earlier plan); no peer
# Usage (device): source benchmarks/device_env.sh; [GPU_MEM=80GB] OUT=$OUT bash benchmarks/peers/lora_gpu.sh [all|make|fitgpt|peer|compare]
#   EXTRA70 adds train flags to the 70B runs (EXTRA70="--profile 2": OUT/NAME.profile.txt, the
#   ops with the most time, for the QLoRA step's 1.5x bar)
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
case $STAGE in all | make | fitgpt | peer | compare | q70 | q70-fitgpt | q70-long | q70-alt | l70-bf16) ;; *)
  echo "lora_gpu.sh: no stage $STAGE; use all, make, fitgpt, peer, compare, q70, q70-fitgpt, q70-long," \
    "q70-alt or l70-bf16" >&2; exit 2 ;; esac
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
has() { [ "$STAGE" = "$1" ] || { [ "$STAGE" = all ] && [ "${1#q70}" = "$1" ] && [ "$1" != l70-bf16 ]; }; }
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

# ---- the 70B bar ----------------------------------------------------------------------------
# the recompute is the planner's (full at 4,096 tokens: without it the activations do not fit
# 80 GB; past ~36 k tokens the block inputs go to pinned host RAM, --checkpointing cpu)
SHAPE70=(--preset llama3.1-70b --lora-rank 16 --micro-batch 1)
TRAIN70=(--data synthetic --seed "$SEED" --lr "$LR" --warmup 2 --log-every 1 --eval-every 0
  --no-save --overwrite ${CAP[@]+"${CAP[@]}"})
if [ -n "$TINY" ]; then
  SHAPE70+=(--layers 2 --hidden 64 --heads 4 --kv-heads 2 --ffn-hidden 128)
  TRAIN70+=(--device cpu)
fi
SEQ70=$([ -n "$TINY" ] && echo 64 || echo 4096)
run70() {  # name, flags...: one fitgpt run of the 70B shape, its log and metrics in OUT
  local name=$1 s extra
  shift
  read -r -a extra <<< "${EXTRA70:-}"  # more train flags, e.g. EXTRA70="--profile 2"
  echo "== fitgpt train ${SHAPE70[*]} $* ${extra[*]}" | tee "$OUT/$name.log"
  s=$(t)
  python3 -m fitgpt train "${SHAPE70[@]}" "${TRAIN70[@]}" --out "$W/$name" "$@" \
    ${extra[@]+"${extra[@]}"} >> "$OUT/$name.log" 2>&1
  echo "== exit $? in $(($(t) - s)) s" | tee -a "$OUT/$name.log"
  grep -E "LoRA:|placement|model |step +[0-9]+ \||rror" "$OUT/$name.log" | cut -c1-250 | head -16
  cp "$W/$name/metrics.jsonl" "$OUT/$name.metrics.jsonl" 2>/dev/null
  cp "$W/$name/profile/summary.txt" "$OUT/$name.profile.txt" 2>/dev/null
}
if has q70; then
  run70 q70_fitgpt --base-format nf4 --seq-len "$SEQ70" --steps "${STEPS70:-8}"
  s=$(t)
  python3 benchmarks/peers/lora_gpu.py qpeer "$W" --out "$OUT" --lrs "$OUT/q70_fitgpt.metrics.jsonl" \
    --steps "${STEPS70:-8}" --micro-batch 1 --seq-len "$SEQ70" --seed "$SEED" \
    ${GPU_MEM:+--gpu-mem "$GPU_MEM"} ${TINY:+--tiny} > "$OUT/qpeer.log" 2>&1
  echo "qpeer: exit $? in $(($(t) - s)) s"
  grep -vE "^\s*$|[Ww]arn|kernels|loss \+= " "$OUT/qpeer.log" | tail -4 | cut -c1-250
  python3 benchmarks/peers/lora_gpu.py compare "$W" --out "$OUT" --bar q70 \
    --metrics "$OUT/q70_fitgpt.metrics.jsonl" --label "$LABEL"
fi
if has q70-fitgpt; then  # q70's fitgpt run alone (under another name), e.g. without EXTRA70's flags
  run70 q70_fitgpt_only --base-format nf4 --seq-len "$SEQ70" --steps "${STEPS70:-8}"
fi
if has q70-long; then  # the longest length the planner accepts: it holds at lo, not at hi
  HW=(--gpus 1 --device cuda ${CAP[@]+"${CAP[@]}"})  # as the run: its cap, or what is detected
  [ -n "$TINY" ] && HW+=(--gpu-mem 80GB --cpu-mem 115GB)  # no GPU here: plan for the H100
  fits() { python3 -m fitgpt plan "${SHAPE70[@]}" --base-format nf4 --seq-len "$1" "${HW[@]}" \
    > "$OUT/q70_long_plan_$1.txt" 2>&1; }
  step=$([ -n "$TINY" ] && echo 64 || echo 4096)
  lo=$step hi=$((32 * step))
  fits $hi && lo=$hi
  while [ $((hi - lo)) -gt "$step" ] && [ "$lo" != "$hi" ]; do
    mid=$(((lo + hi) / 2 / step * step))
    if fits $mid; then lo=$mid; else hi=$mid; fi
  done
  echo "the planner's longest: --seq-len $lo ($(grep -h "LoRA:" "$OUT/q70_long_plan_$lo.txt"))"
  run70 q70_long --base-format nf4 --seq-len "$lo" --steps 2
fi
if has q70-alt; then
  run70 q70_resident --base-format nf4 --seq-len "$SEQ70" --steps "${STEPS70:-8}" --base-host-blocks 0
  run70 q70_recompute --base-format nf4 --seq-len "$SEQ70" --steps "${STEPS70:-8}" \
    --checkpointing full --keep-activations 0
fi
if has l70-bf16; then
  run70 l70_bf16 --base-format bf16 --seq-len "$SEQ70" --steps "${STEPS70:-8}"
fi
