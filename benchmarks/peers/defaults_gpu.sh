#!/usr/bin/env bash
# Issue 38 (19 · Defaults that train at every size): fresh models trained by `fitgpt train` on
# real text (the Python standard library's source through `fitgpt data preprocess`, GPT-2 BPE)
# with NO learning-rate, warm-up or initialisation flag: the defaults pick them (the run's
# "defaults:" line says which). One stage per device call:
#   one   (nvidia-h100-x1): GPT-2 1.5 B, 300 steps of 8 x 4 x 1024 tokens
#   wide  (nvidia-h200):    7.56 B at width 6144 (the 20b preset's shape, 16 layers), 300 steps
#                           of 8 x 1 x 1024 tokens
#   four  (nvidia-h200-x4, or -h100-x4; on -x2 kinds it runs on their 2 GPUs): 20.25 B (the 20b
#                           preset) on every GPU, 100 steps of 4 x 1 x 1024 tokens per GPU; then
#                           the largest model of width 6144 the planner accepts there (as its
#                           refusal of 400 layers names it: 152 on 4xH100 = 69.2 B; MAX_LAYERS
#                           overrides), 10 steps, the same batch
#   calib (nvidia-h100-x1): the warm-up's first-step floor (train/schedule.py FIRST_STEP_BUDGET)
#                           measured: the first 30 steps of GPT-2 1.5 B (48 x 1600) with --warmup
#                           40, 92, 185 and 370 (first-step products ~80, 40, 20, 10), and of a
#                           deep narrow 7.65 B (152 x 2048) with --warmup 40 and 705 (~350, 20)
# Usage (device): source benchmarks/device_env.sh; OUT=... bash benchmarks/peers/defaults_gpu.sh STAGE
# Writes OUT/STAGE_NAME.log and .metrics.jsonl per run and OUT/STAGE_summary.md (the table:
# step-1 loss, the highest logged loss after step 3, the last loss, the defaults line).
set -u
STAGE=${1:?one, wide, calib or four}
OUT=${OUT:-/tmp/defaults_gpu}
D=/tmp/defaults_data
mkdir -p "$OUT" "$D"
export PYTHONPATH=.${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
python3 benchmarks/stdlib_jsonl.py "$D/pystd.jsonl"
python3 -m fitgpt data preprocess --input "$D/pystd.jsonl" --json-key text \
  --output-prefix "$D/pystd" --workers 8 --append-eod > "$OUT/${STAGE}_preprocess.log" 2>&1 \
  || { tail -3 "$OUT/${STAGE}_preprocess.log"; exit 1; }
DATA="$D/pystd_text_document"
# WATCH=1: where a run's set-up spends its time. Every 15 s OUT/NAME.watch gets the host's used
# and available RAM and each GPU's memory, and at 45, 120, 240 and 400 s py-spy's stacks of the
# ranks (carry py-spy's wheel in .whl); each log line is stamped with the wall time.
watch() {  # name
  local t=0
  while sleep 15; do
    t=$((t + 15))
    echo "$(date +%T) t=${t}s ram(used/avail GiB)=$(free -g | awk '/Mem/ {print $3"/"$7}')" \
      "gpu(MiB)=$(nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits | paste -sd,)"
    case $t in 45|120|240|400)
      for p in $(pgrep -f "fitgpt train"); do  # the ranks: torchrun gave them LOCAL_RANK
        grep -qz "^LOCAL_RANK=" "/proc/$p/environ" 2>/dev/null &&
          timeout 20 py-spy dump --pid "$p" 2>&1 | grep -v "^ *$" | head -40
      done ;;
    esac
  done >> "$OUT/$1.watch" 2>&1
}
stamp() { python3 -u -c "import sys, time
for line in sys.stdin: print(time.strftime('%H:%M:%S'), line, end='', flush=True)"; }
run() {  # name, limit in seconds, then fitgpt train's flags
  local name=$1 limit=$2; shift 2
  local dir=/tmp/defaults_runs/$name wpid=
  echo "== $name: fitgpt train $*" | tee "$OUT/$name.log"
  [ -n "${WATCH:-}" ] && { watch "$name" & wpid=$!; }
  timeout "$limit" python3 -m fitgpt train --data "$DATA" --out "$dir" --overwrite --no-save \
    --eval-every 0 --log-every 1 "$@" 2>&1 | stamp >> "$OUT/$name.log"
  echo "== $name: exit ${PIPESTATUS[0]}" | tee -a "$OUT/$name.log"
  [ -n "$wpid" ] && kill "$wpid" 2>/dev/null
  cp "$dir/metrics.jsonl" "$OUT/$name.metrics.jsonl" 2>/dev/null
  grep -E "^defaults|^plan|^model|^placement|error|Error|spike|diverg" "$OUT/$name.log" | cut -c1-220
}
case $STAGE in
  one)
    run gpt2_1p5b 540 --preset gpt2-1.5b --micro-batch 8 --grad-accum 4 --steps 300 ;;
  wide)
    run w6144_l16 560 --preset 20b --layers 16 --micro-batch 8 --grad-accum 1 --steps 300 ;;
  calib)
    for w in 40 92 185 370; do
      run "c1p5b_w$w" 150 --preset gpt2-1.5b --micro-batch 8 --grad-accum 4 --steps 30 --warmup "$w"
    done
    for w in 40 705; do
      run "c152x2048_w$w" 170 --layers 152 --hidden 2048 --heads 16 --micro-batch 8 \
        --grad-accum 1 --steps 24 --warmup "$w"
    done ;;
  four)
    # every GPU of the machine (4 on the 4-GPU kinds, 2 on nvidia-h*-x2 when no 4-GPU kind is lent)
    G=$(nvidia-smi -L | wc -l)
    # ONLY=20b or ONLY=largest: one of the two runs (two calls where one would not hold both)
    [ "${ONLY:-20b}" = 20b ] &&
      run "20b_x$G" "${LIMIT:-240}" --gpus "$G" --preset 20b --micro-batch 4 --grad-accum 1 --steps 100
    if [ "${ONLY:-largest}" = largest ]; then
      # the planner's largest at width 6144 on this machine, as its refusal of 400 layers names
      # it ("what fits: N layers of this width"); MAX_LAYERS overrides
      if [ -z "${MAX_LAYERS:-}" ]; then
        python3 -m fitgpt train --data "$DATA" --gpus "$G" --preset 20b --layers 400 \
          --micro-batch 4 --grad-accum 1 --steps 10 --out /tmp/defaults_runs/probe --no-save \
          > "$OUT/probe_x$G.log" 2>&1
        MAX_LAYERS=$(grep -o "what fits: [0-9]* layers" "$OUT/probe_x$G.log" | head -1 | grep -o "[0-9]*")
      fi
      run "largest_x${G}_l${MAX_LAYERS:?no fit named in probe_x$G.log}" "${LIMIT:-330}" \
        --gpus "$G" --preset 20b --layers "$MAX_LAYERS" --micro-batch 4 --grad-accum 1 --steps 10
    fi ;;
esac
python3 - "$OUT" "$STAGE" <<'PY'
import json, sys
from pathlib import Path
out, stage = Path(sys.argv[1]), sys.argv[2]
rows = ["| run | steps | tokens/step | step-1 loss | highest after step 3 | last loss | "
        "last - first | s/step (median) |", "|---|---|---|---|---|---|---|---|"]
for m in sorted(out.glob("*.metrics.jsonl")):
    recs = [json.loads(x) for x in m.read_text().splitlines() if x.strip()]
    tr = [r for r in recs if r.get("kind") == "train"]
    if not tr:
        continue
    first, last = tr[0], tr[-1]
    after3 = [r["loss"] for r in tr if r["step"] > 3]
    hi = max(after3) if after3 else float("nan")
    tps = round(last["tokens_per_s"] * last["ms_per_step"] / 1000)
    rows.append(f"| {m.name[:-14]} | {last['step']} | {tps:,} | {first['loss']:.3f} | {hi:.3f} | "
                f"{last['loss']:.3f} | {last['loss'] - first['loss']:+.3f} | "
                f"{last['ms_per_step'] / 1000:.2f} |")
(out / f"{stage}_summary.md").write_text("\n".join(rows) + "\n")
print("\n".join(rows))
PY
