#!/usr/bin/env bash
# Issue 36 on a 4-GPU kind (nvidia-h200-x4), one call, as a user would: a Llama-3.1-70B-shaped
# Hugging Face folder made by transformers (MODEL=llama3.1-70b benchmarks/peers/llama_gpu.py make:
# random weights, bf16, 5 GB shards, 141 GB on the 235 GB disk), real text (the Python standard
# library's source) through `fitgpt data preprocess` with its tokenizer, then
#   fitgpt train --gpus 4 --init-from HF --micro-batch 1 --grad-accum 8 --seq-len 4096
# with the planner's plan, no checkpoint (a 70 B checkpoint and an export would not fit beside
# the source on this disk). Every rank reads its share of the weights straight from the
# safetensors files (no scratch copy). Recorded: make and preprocess times, the seconds from
# the command to its first logged step (the import included), host RAM used (MemTotal -
# MemAvailable, every 5 s) and disk used, each step's TFLOP/s.
# Usage (device): OUT=$OUT bash benchmarks/multi_gpu/llama70_x4.sh [all|make|train]
#   all (default) in one call; or `make` (the folder and the data, ~230 s) in one call and
#   `train` in the next on the same warm machine (it finds the folder under /tmp and makes it
#   only if it is missing), so the run has the whole next call: MB and GA (default 1 and 8)
#   set the micro-batch and accumulation, STEPS the steps, PROFILE=N adds --profile N, EXTRA
#   more flags.
set -u
STAGE=${1:-all}
OUT=${OUT:-/tmp/llama70}
W=/tmp/llama70_work
LIMIT=${LIMIT:-570}
T0=$(date +%s)
mkdir -p "$OUT" "$W"
export PYTHONUNBUFFERED=1 PYTHONPATH=.${PYTHONPATH:+:$PYTHONPATH}
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | sort | uniq -c
t() { echo $(( $(date +%s) - T0 )); }
if [ ! -e "$W/made" ]; then
rm -rf "${W:?}"/*
python3 benchmarks/stdlib_jsonl.py "$W/pystd.jsonl"
s=$(t); MODEL=llama3.1-70b python3 benchmarks/peers/llama_gpu.py make "$W" "$W/pystd.jsonl" 2>&1 \
  | tail -1 | tee "$OUT/make.log"
echo "make: $(( $(t) - s )) s"; du -sh "$W/hf"; df -h /tmp | tail -1
s=$(t); python3 -m fitgpt data preprocess --input "$W/pystd.jsonl" --json-key text \
  --output-prefix "$W/pystd" --tokenizer "$W/hf" --workers 16 --append-eod > "$OUT/preprocess.log" 2>&1 \
  || { tail -3 "$OUT/preprocess.log"; exit 1; }
echo "preprocess: $(( $(t) - s )) s"
touch "$W/made"
fi
[ "$STAGE" = make ] && exit 0
CMD=(python3 -m fitgpt train --gpus 4 --init-from "$W/hf" --data "$W/pystd_text_document"
  --micro-batch "${MB:-1}" --grad-accum "${GA:-8}" --seq-len 4096 --steps "${STEPS:-6}"
  --log-every 1 --eval-every 0 --lr 1e-5 --no-save --overwrite --out "$W/run")
[ -n "${PROFILE:-}" ] && CMD+=(--profile "$PROFILE")
read -r -a extra <<< "${EXTRA:-}"  # more train flags, e.g. EXTRA="--compile on"
CMD+=("${extra[@]}")
echo "== ${CMD[*]}" | tee "$OUT/train.log"
s=$(date +%s)
( timeout $((LIMIT - $(t))) "${CMD[@]}" 2>&1 | while IFS= read -r l; do
    echo "$(( $(date +%s) - s ))s $l"; done >> "$OUT/train.log"; echo "== exit ${PIPESTATUS[0]}" >> "$OUT/train.log" ) &
P=$!
while kill -0 $P 2>/dev/null; do
  echo "$(( $(date +%s) - s )) $(awk '/MemTotal/ {t=$2} /MemAvailable/ {a=$2} END {printf "%.1f", (t-a)/1048576}' /proc/meminfo) $(df -BG --output=used /tmp | tail -1)" >> "$OUT/host_used_gib.txt"
  sleep 5
done
[ -e "$W/run/.init-from" ] && echo "a scratch folder was made" || echo "no scratch folder under --out"
grep -E "plan:|^[0-9]+s model|step |exit|rror|refus" "$OUT/train.log" | cut -c1-330 | head -24
sort -k2 -n "$OUT/host_used_gib.txt" | tail -1 | awk '{print "host used peak GiB: " $2 " at " $1 " s; disk used " $3}'
cp "$W/run/metrics.jsonl" "$OUT/train.metrics.jsonl" 2>/dev/null
cp "$W/run/profile/summary.txt" "$OUT/profile_summary.txt" 2>/dev/null && head -45 "$OUT/profile_summary.txt" | cut -c1-200
