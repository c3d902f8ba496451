#!/usr/bin/env bash
# Expert parallelism on two GPUs of one box (nvidia-h200-x2), as a user runs it: a Qwen3-30B-A3B
# shape of LAYERS layers (every layer sparse, 128 experts of 768, 8 per token) on the Python
# standard library's source (`fitgpt data preprocess`, GPT-2 BPE), micro-batch 2 x 2 accumulation
# x 4,096 tokens per GPU, trained by `fitgpt train --gpus 2` with --expert-parallel 2 (each GPU
# holds 64 experts, tokens exchanged by all-to-all) and with the planner's choice of P; each
# run's log and metrics in OUT.
# Usage (device): source benchmarks/device_env.sh; OUT=$OUT bash benchmarks/multi_gpu/ep_x2.sh
set -u
OUT=${OUT:-/tmp/ep_x2}
LAYERS=${LAYERS:-4}
D=/tmp/ep_data
mkdir -p "$OUT" "$D"
export PYTHONUNBUFFERED=1 PYTHONPATH=.${PYTHONPATH:+:$PYTHONPATH}
python3 benchmarks/stdlib_jsonl.py "$D/pystd.jsonl"
python3 -m fitgpt data preprocess --input "$D/pystd.jsonl" --json-key text \
  --output-prefix "$D/pystd" --workers 12 --append-eod > "$OUT/preprocess.log" 2>&1 \
  || { tail -3 "$OUT/preprocess.log"; exit 1; }
for ep in ${EPS:-2 auto}; do
  L="$OUT/train_ep$ep"
  s=$(date +%s)
  python3 -m fitgpt train --gpus 2 --expert-parallel "$ep" --preset qwen3-moe-30b-a3b \
    --layers "$LAYERS" --data "$D/pystd_text_document" --micro-batch 2 --grad-accum 2 \
    --seq-len 4096 --steps "${STEPS:-5}" --log-every 1 --eval-every 0 --no-save --lr 1e-4 \
    --warmup 2 --out "/tmp/ep_run$ep" --overwrite > "$L.log" 2>&1
  echo "== ep $ep: exit $? in $(( $(date +%s) - s )) s"
  grep -E "plan:|step .*tok/s|rror" "$L.log" | cut -c1-330 | head -9
  cp "/tmp/ep_run$ep/metrics.jsonl" "$L.metrics.jsonl" 2>/dev/null
done
