#!/usr/bin/env bash
# Issue 36: the largest Qwen2.5 shape on one H100 + its host RAM, as a user would: a
# Qwen2.5-14B-shaped Hugging Face folder made by transformers (MODEL=qwen2.5-14b
# benchmarks/peers/llama_gpu.py make), real text through `fitgpt data preprocess` with its tokenizer,
# and `fitgpt train --init-from` with the planner's plan (no checkpoint). Disk (64 GB): the import
# writes the fp32 weights (55 GB) under --out, so the 28 GB bf16 source is moved to /dev/shm
# first (its RAM is seen by the planner) and removed once the run's first step is logged.
# Usage (device): source benchmarks/device_env.sh; OUT=$OUT bash benchmarks/peers/qwen_gpu.sh
set -u
OUT=${OUT:-/tmp/qwen_gpu}
W=/tmp/qwen_work
rm -rf "$W" /dev/shm/hf; mkdir -p "$OUT" "$W"
export PYTHONUNBUFFERED=1 PYTHONPATH=.${PYTHONPATH:+:$PYTHONPATH} MODEL=qwen2.5-14b
python3 benchmarks/stdlib_jsonl.py "$W/pystd.jsonl"
python3 benchmarks/peers/llama_gpu.py make "$W" "$W/pystd.jsonl" 2>&1 | tail -1 | tee "$OUT/make.log"
mv "$W/hf" /dev/shm/hf && df -h /tmp /dev/shm | tail -2
python3 -m fitgpt data preprocess --input "$W/pystd.jsonl" --json-key text \
  --output-prefix "$W/pystd" --tokenizer /dev/shm/hf --workers 12 --append-eod > "$OUT/preprocess.log" 2>&1 \
  || { tail -3 "$OUT/preprocess.log"; exit 1; }
CMD=(python3 -m fitgpt train --init-from /dev/shm/hf --data "$W/pystd_text_document"
  --micro-batch 4 --grad-accum 4 --steps "${STEPS:-6}" --log-every 1 --eval-every 0 --lr 1e-5
  --seq-len 4096 --no-save --out "$W/run")
echo "== ${CMD[*]}" | tee "$OUT/train.log"
( "${CMD[@]}" >> "$OUT/train.log" 2>&1; echo "== exit $?" >> "$OUT/train.log" ) &
P=$!
while kill -0 $P 2>/dev/null; do
  grep -q "^step " "$OUT/train.log" && rm -rf /dev/shm/hf
  awk '/MemTotal/ {t=$2} /MemAvailable/ {a=$2} END {printf "%.1f\n", (t-a)/1048576}' /proc/meminfo >> "$OUT/host_used_gib.txt"; sleep 5
done
grep -E "plan:|model |step |exit|rror" "$OUT/train.log" | head -20
sort -n "$OUT/host_used_gib.txt" | tail -1 | sed 's/^/host used peak GiB: /'
