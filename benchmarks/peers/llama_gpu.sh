#!/usr/bin/env bash
# Issue 36 on nvidia-h100-x1, one call, as a user would: a Llama-3.1-8B-shaped Hugging Face
# folder made by transformers (benchmarks/peers/llama_gpu.py make), real text (the Python standard
# library's source) through `fitgpt data preprocess` with that folder's tokenizer, then
#   fitgpt train --init-from HF (the planner's plan), fitgpt export --format hf,
#   transformers' held-out loss against fitgpt's (llama_gpu.py heldout), fitgpt generate.
# Usage (device): source benchmarks/device_env.sh; [EXTRA=...] OUT=$OUT bash benchmarks/peers/llama_gpu.sh
# Disk (64 GB): the HF source (16 GB bf16) is removed once the run has imported it, before the
# checkpoint (32 GB fp32 master) and the export (16 GB bf16) are written.
set -u
OUT=${OUT:-/tmp/llama_gpu}
W=/tmp/llama_work
STEPS=${STEPS:-10}
mkdir -p "$OUT" "$W"
export PYTHONUNBUFFERED=1 PYTHONPATH=.${PYTHONPATH:+:$PYTHONPATH}
t() { date +%s; }
python3 benchmarks/stdlib_jsonl.py "$W/pystd.jsonl"
s=$(t); python3 benchmarks/peers/llama_gpu.py make "$W" "$W/pystd.jsonl" 2>&1 | tail -2 | tee "$OUT/make.log"
echo "make: $(( $(t) - s )) s"; du -sh "$W/hf"
s=$(t); python3 -m fitgpt data preprocess --input "$W/pystd.jsonl" --json-key text \
  --output-prefix "$W/pystd" --tokenizer "$W/hf" --workers 12 --append-eod > "$OUT/preprocess.log" 2>&1 \
  || { tail -3 "$OUT/preprocess.log"; exit 1; }
echo "preprocess: $(( $(t) - s )) s"; tail -2 "$OUT/preprocess.log"
CMD=(python3 -m fitgpt train --init-from "$W/hf" --data "$W/pystd_text_document"
  --micro-batch 4 --grad-accum 4 --steps "$STEPS" --log-every 1 --eval-every 0 --lr 1e-5
  --seq-len 4096 --save-optimizer none --out "$W/run")
# EXTRA: more train flags, e.g. EXTRA="--compile on" (a 10-step run is too short for
# --compile auto to pay back the compile; a real fine-tune's is not)
read -r -a extra <<< "${EXTRA:-}"
CMD+=("${extra[@]}")
echo "== ${CMD[*]}" | tee "$OUT/train.log"
s=$(t)
( "${CMD[@]}" >> "$OUT/train.log" 2>&1; echo "== exit $?" >> "$OUT/train.log" ) &
P=$!
# the run has read its source once its first step is logged: the 16 GB go before its save
while kill -0 $P 2>/dev/null; do
  if grep -q '"kind": "train"' "$W/run/metrics.jsonl" 2>/dev/null; then rm -rf "$W/hf"/*.safetensors; fi
  free -g | awk '/Mem/ {print $3}' >> "$OUT/host_used_gib.txt"; sleep 5
done
echo "train: $(( $(t) - s )) s"; grep -E "plan:|import|step .*tok/s|TFLOP|exit|error|rror" "$OUT/train.log" | head -30
sort -n "$OUT/host_used_gib.txt" | tail -1 | sed 's/^/host used peak GiB: /'
cp "$W/run/metrics.jsonl" "$OUT/train.metrics.jsonl" 2>/dev/null
s=$(t); python3 -m fitgpt export --ckpt "$W/run" --out "$W/export" --format hf --dtype bf16 \
  > "$OUT/export.log" 2>&1; echo "export: rc $? $(( $(t) - s )) s"; tail -2 "$OUT/export.log"
ls "$W/export" | head -20 > "$OUT/export_files.txt"
cp "$W/export/config.json" "$OUT/export_config.json" 2>/dev/null
python3 benchmarks/peers/llama_gpu.py heldout "$W" "$W/pystd_text_document" "$W/run" 2>&1 | tail -1 | tee "$OUT/heldout.json"
python3 -m fitgpt generate --ckpt "$W/run" --prompt "def main(" --max-new-tokens 30 \
  --temperature 0 > "$OUT/generate.log" 2>&1; echo "generate: rc $?"; tail -3 "$OUT/generate.log"
