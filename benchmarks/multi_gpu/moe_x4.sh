#!/usr/bin/env bash
# Issue 50's 4-GPU bars on one nvidia-h200-x4 box (carry .whl for DeepSpeed), as a user runs
# them. One stage per device call (each ends by DEADLINE, default 560 s, nothing run past it);
# the work folder W=/tmp/moe_x4_work lives while the machine stays warm, and a stage remakes
# what it needs and finds missing:
#   data    real chat data: the Python standard library's source as conversations (the user
#           quotes a file's first quarter, the assistant writes the rest), a Qwen-style
#           tokenizer trained on it filling Qwen3's 151,936 rows with a ChatML template
#           (moe_gpu.py chat), through `fitgpt data preprocess --chat` (loss on the replies)
#   make    a Qwen3-30B-A3B-shaped folder saved by transformers (moe_gpu.py make: random
#           weights, bf16, 61 GB in 5 GB shards) with that tokenizer; its own call, so the
#           qwen stage has a whole call to train
#   qwen    `fitgpt train --gpus 4` on that folder (--init-from; the preset
#           qwen3-moe-30b-a3b instead where the folder is missing or PRESET=1), the planner's
#           plan, the chat data at seq 4096, fitgpt's default micro-batch unless MB is set
#           (6 for a mixture of experts at 4,096 tokens: train/config.py default_micro_batch),
#           STEPS steps (default 8): the plan (`fitgpt plan --breakdown`: predicted step, GPU
#           and host peaks), each step's tokens/s and active-parameter TFLOP/s
#   peer    transformers' Qwen3MoeForCausalLM of the same shape + DeepSpeed ZeRO-3 on the 4
#           GPUs (torchrun; moe_gpu.py peer), the same data and batch, PEER_STEPS steps
#           (default 3): first with everything on the GPUs, then, only where that run fails
#           (out of memory), with the parameters and the optimizer offloaded to CPU
#           (PEER_OFFLOAD="cpu" alone in a second call if the first attempt left too little
#           time). A run that fits nowhere is a result too: its log says how it ended
#   oss120  gpt-oss-120b from its preset, built straight into the planner's tiers, trained 10
#           steps from the defaults with int8 moments and the disk tier in W/nvme (`--moments
#           int8 --nvme-path`: no plan with bf16 moments fits 4 H200s, 470 GB of RAM and this
#           disk; docs/planner.md): each loss and step time beside the plan's, GPU, host and
#           disk peaks. First `fitgpt probe --nvme` (PROBE=0 skips it): the plan's step is
#           mostly the disk's traffic, priced at the default rates otherwise; OSS_STEPS steps
#           (default 10) may not fit one call where the disk is slow: the plan says first
# Usage (device): OUT=$OUT STAGES=qwen bash benchmarks/multi_gpu/moe_x4.sh
set -u
OUT=${OUT:-/tmp/moe_x4}
STAGES=${STAGES:-data}
DEADLINE=${DEADLINE:-560}
STAGE=$(echo "$STAGES" | tr ' ' '_')  # the RAM log's name (x4_env.sh)
W=/tmp/moe_x4_work
mkdir -p "$OUT" "$W"
source benchmarks/multi_gpu/x4_env.sh
DATA="$W/chat_chat_document"
SEQ=(--seq-len 4096)
QWEN3_VOCAB=151936
# seconds a command may run: to 10 s before DEADLINE (at least 1: a command past it is not begun)
budget() { local b=$(($(left) - 10)); echo $((b > 1 ? b : 1)); }
# the host's used GiB and the disk's used GiB every 5 s beside a command, then its peaks
watched() {
  local L="$OUT/$1" s P
  shift
  echo "== $*" | tee "$L.log"
  s=$(date +%s)
  ( timeout "$(budget)" "$@" >> "$L.log" 2>&1; echo "== exit $? after $(($(date +%s) - s)) s" >> "$L.log" ) &
  P=$!
  while kill -0 $P 2>/dev/null; do
    echo "$(($(date +%s) - s)) $(free -g | awk '/Mem/ {print $3}') $(df -BG --output=used /tmp | tail -1 | tr -d G)" >> "$L.usage.txt"
    sleep 5
  done
  grep -E "plan:|step .*tok/s|exit|rror|refus|built|tokens_per_s" "$L.log" | cut -c1-400 | head -30
  sort -k2 -n "$L.usage.txt" | tail -1 | awk '{print "host used peak GiB: " $2 " at " $1 " s"}'
  sort -k3 -n "$L.usage.txt" | tail -1 | awk '{print "disk used peak GiB: " $3 " at " $1 " s"}'
}
make_data() {
  [ -e "$W/data_made" ] && return 0
  local s=$(date +%s)
  python3 benchmarks/stdlib_jsonl.py "$W/pystd.jsonl"
  python3 benchmarks/peers/moe_gpu.py chat "$W" --text "$W/pystd.jsonl" | tee "$OUT/chat.json"
  timeout "$(budget)" python3 -m fitgpt data preprocess --chat --input "$W/chat.jsonl" \
    --tokenizer "$W/tok" --output-prefix "$W/chat" "${SEQ[@]}" --workers $(($(nproc) < 16 ? $(nproc) : 16)) \
    > "$OUT/preprocess.log" 2>&1 || { tail -3 "$OUT/preprocess.log"; return 1; }
  grep -E "documents|loss on|long" "$OUT/preprocess.log"
  echo "data: $(($(date +%s) - s)) s"
  touch "$W/data_made"
}
for part in $STAGES; do case $part in
data)
  make_data || exit 1 ;;
make)
  make_data || exit 1
  [ -e "$W/hf_made" ] || {
    s=$(date +%s)
    timeout "$(budget)" python3 benchmarks/peers/moe_gpu.py make "$W" --layers 48 2>&1 | tail -2 | tee "$OUT/make.log"
    [ -e "$W/hf/config.json" ] && touch "$W/hf_made"
    echo "make: $(($(date +%s) - s)) s"; du -sh "$W/hf"; df -h /tmp | tail -1
  } ;;
qwen)
  make_data || exit 1
  if [ -e "$W/hf_made" ] && [ "${PRESET:-0}" != 1 ]; then
    MODEL=(--init-from "$W/hf")
  else
    MODEL=(--preset qwen3-moe-30b-a3b)
  fi
  BATCH=("${SEQ[@]}")
  [ -n "${MB:-}" ] && BATCH+=(--micro-batch "$MB")
  # the plan of the preset of the folder's shape (the data's vocabulary, as the folder's): train
  # prints its own plan line again, of the model it builds
  timeout "$(budget)" python3 -m fitgpt plan --preset qwen3-moe-30b-a3b --gpus 4 \
    --data "$DATA" "${BATCH[@]}" --breakdown > "$OUT/qwen_plan.txt" 2>&1
  grep -E "^model|chosen|GPU per rank|host per rank|^step" "$OUT/qwen_plan.txt" | cut -c1-300
  watched "${QWEN_NAME:-qwen}" python3 -m fitgpt train --gpus 4 "${MODEL[@]}" --data "$DATA" "${BATCH[@]}" \
    --steps "${STEPS:-8}" --log-every 1 --eval-every 0 --no-save --overwrite --out "$W/qwen_run" \
    ${QWEN_ARGS:-}
  cp "$W/qwen_run/metrics.jsonl" "$OUT/qwen.metrics.jsonl" 2>/dev/null ;;
peer)
  make_data || exit 1
  # fitgpt's batch: its default micro-batch for this shape unless MB is set, no accumulation
  mb=${MB:-$(python3 -c "from fitgpt.model import get_preset; from fitgpt.train.config import default_micro_batch; print(default_micro_batch(get_preset('qwen3-moe-30b-a3b').replace(seq_len=4096)))")}
  for off in ${PEER_OFFLOAD:-none cpu}; do
    [ "$(left)" -gt 60 ] || { echo "peer offload $off: no time left"; break; }
    watched "peer_$off" torchrun --standalone --nproc-per-node 4 benchmarks/peers/moe_gpu.py \
      peer "$OUT" --data "$DATA" --vocab "$QWEN3_VOCAB" --layers 48 --micro-batch "$mb" \
      --grad-accum 1 "${SEQ[@]}" --steps "${PEER_STEPS:-3}" --offload "$off"
    [ -f "$OUT/peer.json" ] && { mv "$OUT/peer.json" "$OUT/peer_$off.json"; break; }
  done ;;
oss120)
  make_data || exit 1
  # the disk tier wants ~145 GiB (36 GiB per rank) beside the 57 GiB folder: RM_HF=1 frees it
  [ "${RM_HF:-0}" = 1 ] && rm -rf "$W/hf" "$W/hf_made"
  df -h /tmp | tail -1
  mkdir -p "$W/nvme"
  # the chat data's ids lie below gpt-oss's 201,088 rows: the model keeps its own vocabulary
  OSS=(--preset gpt-oss-120b --gpus 4 --data "$DATA" --tokenizer none --vocab-size 201088
    "${SEQ[@]}" --moments int8)
  # the box's own disk bandwidth (the default rates' 1.7-1.8 GB/s price a step of this plan at
  # ~180 s: its 4 ranks move ~39 GB each way a step through one disk); PROBE=0 skips it
  if [ "${PROBE:-1}" = 1 ]; then
    timeout 150 python3 -m fitgpt probe --nvme "$W/nvme" > "$OUT/probe.txt" 2>&1
    grep -E "disk|saved|rates" "$OUT/probe.txt" | tail -3
  fi
  timeout "$(budget)" python3 -m fitgpt plan "${OSS[@]}" --nvme "$W/nvme" --breakdown \
    > "$OUT/oss120_plan.txt" 2>&1
  grep -E "^model|rates|chosen|as train|GPU per rank|host per rank|disk per rank|^step|error" "$OUT/oss120_plan.txt" | cut -c1-400
  step=$(sed -n 's/.*predicted [0-9.]* GiB per rank, \([0-9.]*\) s\/step.*/\1/p' "$OUT/oss120_plan.txt" | head -1)
  echo "planned: ${OSS_STEPS:-10} steps x ${step:-?} s against $(left) s left (the build first)"
  watched oss120 python3 -m fitgpt train "${OSS[@]}" --nvme-path "$W/nvme" --steps "${OSS_STEPS:-10}" \
    --log-every 1 --eval-every 0 --no-save --overwrite --out "$W/oss_run"
  cp "$W/oss_run/metrics.jsonl" "$OUT/oss120.metrics.jsonl" 2>/dev/null
  du -sh "$W/nvme" ;;
*)
  echo "unknown stage $part: data, make, qwen, peer or oss120" >&2
  exit 2 ;;
esac; done
echo "left: $(left) s"
