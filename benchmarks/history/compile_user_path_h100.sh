#!/usr/bin/env bash
# Issue 19's compiled path as a user types it, on nvidia-h100-x1: GPT-2 1.5 B (h=1600, so the
# LayerNorms run through ATen and the block linears write their own gradients) on real text
# (the Python standard library, `fitgpt data preprocess`, GPT-2 BPE), `--compile on` with
# evaluations and checkpoints (optimizer included), a resume from the newest, generation from
# it; then the 2.7b preset's speed once (benchmarks/ab_speed_h100.py base).
# Usage (device):
#   source benchmarks/device_env.sh; OUT=... [SPEED=] bash benchmarks/history/compile_user_path_h100.sh
# (device_env.sh installs the carried wheels, GPT-2's tokenizer among them; SPEED= skips the
# 2.7b speed run)
set -u
OUT=${OUT:-/tmp/compile_user_path}
D=/tmp/compile_user_path_data RUN=/tmp/compile_user_path_run
mkdir -p "$OUT" "$D"
export PYTHONPATH=.${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1  # keeps device_env.sh's wheels
python3 benchmarks/stdlib_jsonl.py "$D/pystd.jsonl"
run() {  # name, command...: the command's output to $OUT/name.log, its status and key lines
  local name=$1; shift
  "$@" > "$OUT/$name.log" 2>&1
  echo "== $name: exit $?"
  grep -E "^compile|^warning|^error|^eval|^saved|^resum|^plan|Error" "$OUT/$name.log" | cut -c1-160 | head -12
  grep -E "^step" "$OUT/$name.log" | tail -2 | cut -c1-160
}
run preprocess python3 -m fitgpt data preprocess --input "$D/pystd.jsonl" --json-key text \
  --output-prefix "$D/pystd" --workers 8 --append-eod
run train python3 -m fitgpt train --preset gpt2-1.5b --data "$D/pystd_text_document" \
  --micro-batch 8 --grad-accum 4 --steps 30 --save-every 15 --keep 1 --eval-every 15 \
  --eval-batches 8 --log-every 5 --compile on --overwrite --out "$RUN"
run resume python3 -m fitgpt train --out "$RUN" --resume --steps 40
run generate python3 -m fitgpt generate --ckpt "$RUN" --prompt "def main(" --max-new-tokens 40
[ -n "${SPEED-1}" ] && python3 benchmarks/ab_speed_h100.py --out "$OUT/ab" --sizes 2.7b \
  --variants-2p7b base --no-attention 2>&1 | tail -2
