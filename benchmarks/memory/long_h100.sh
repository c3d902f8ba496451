#!/usr/bin/env bash
# Issues 36 and 37 on one GPU (nvidia-h100-x1), the GPU checks their CPU-built parts wait for, one
# stage per device call (each under the 10-minute limit):
#   kernels  `fitgpt probe` (the new attention rate, Rates.attn_tflops, replaces the 300 TFLOP/s
#            estimate in this machine's cache); packed rows' FlexAttention against the mask path
#            (outputs, gradients, speed at 4096: benchmarks/parts/packed_attention_gpu.py, with --model);
#            the MLP in pieces and the window's FlexAttention at 32-128 k tokens, one block and
#            the whole model (benchmarks/memory/long_seq_gpu.py)
#   train    `fitgpt plan` then `fitgpt train` of Llama-3.1-8B's shape at 131,072 tokens per
#            sequence, micro-batch 1, on real text (the standard library's source through
#            `fitgpt data preprocess`, GPT-2 BPE: the 50 k vocabulary, not Llama's), the planner's
#            plan, 3 steps: TFLOP/s (attention counted), s/step against the plan, GPU and host peaks.
#            VOCAB=llama: the 8B shape's own 128,256-token vocabulary (a Llama-3-style BPE trained
#            on that text, benchmarks/peers/llama_gpu.py tokenizer); SEQ, STEPS, LIMIT: the length,
#            the steps and the train's time limit
# Usage (device): source benchmarks/device_env.sh; OUT=$OUT bash benchmarks/memory/long_h100.sh STAGE
set -u
STAGE=${1:?kernels or train}
OUT=${OUT:-/tmp/long_h100}
mkdir -p "$OUT"
export PYTHONPATH=.${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
case $STAGE in
  kernels)
    timeout 120 python3 -m fitgpt probe > "$OUT/probe.txt" 2>&1; tail -8 "$OUT/probe.txt"
    timeout 150 python3 benchmarks/parts/packed_attention_gpu.py --model > "$OUT/packed_attention.jsonl" 2>&1
    echo "packed attention: exit $?"; tail -6 "$OUT/packed_attention.jsonl" | cut -c1-300
    timeout "${LIMIT:-280}" python3 benchmarks/memory/long_seq_gpu.py --window 4096 > "$OUT/long_seq.jsonl" 2>&1
    echo "long seq: exit $?"; tail -14 "$OUT/long_seq.jsonl" | cut -c1-300
    ;;
  train)
    D=/tmp/long_data
    mkdir -p "$D"
    python3 benchmarks/stdlib_jsonl.py "$D/pystd.jsonl"
    TOK=()  # VOCAB=llama: a Llama-3-style tokenizer filling the 8B shape's 128,256 rows
    if [ "${VOCAB:-gpt2}" = llama ]; then
      python3 benchmarks/peers/llama_gpu.py tokenizer "$D/tok" "$D/pystd.jsonl"
      TOK=(--tokenizer "$D/tok")
    fi
    python3 -m fitgpt data preprocess --input "$D/pystd.jsonl" --json-key text "${TOK[@]}" \
      --output-prefix "$D/pystd" --workers 12 --append-eod > "$OUT/preprocess.log" 2>&1 \
      || { tail -3 "$OUT/preprocess.log"; exit 1; }
    FLAGS=(--preset llama3.1-8b --data "$D/pystd_text_document" --seq-len "${SEQ:-131072}"
      --micro-batch 1 --grad-accum 1)
    python3 -m fitgpt plan "${FLAGS[@]}" --breakdown > "$OUT/plan.txt" 2>&1
    grep -E "^chosen|^step|error" "$OUT/plan.txt" | cut -c1-300
    timeout "${LIMIT:-480}" python3 -m fitgpt train "${FLAGS[@]}" --steps "${STEPS:-3}" --log-every 1 --eval-every 0 \
      --no-save --out /tmp/long_run --overwrite > "$OUT/train.log" 2>&1
    echo "train: exit $?"; grep -E "plan:|step |rror|refus" "$OUT/train.log" | cut -c1-300
    ;;
  *)
    echo "unknown stage $STAGE" >&2
    exit 2
    ;;
esac
