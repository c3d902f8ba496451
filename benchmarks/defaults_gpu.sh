#!/usr/bin/env bash
# Issue 38 (19 · Defaults that train at every size): fresh models trained by `fitgpt train` on
# real text (the Python standard library's source through `fitgpt data preprocess`, GPT-2 BPE)
# with NO learning-rate, warm-up or initialisation flag: the defaults pick them (the run's
# "defaults:" line says which). One stage per device call:
#   one   (nvidia-h100-x1): GPT-2 1.5 B, 300 steps of 8 x 4 x 1024 tokens
#   wide  (nvidia-h200):    7.56 B at width 6144 (the 20b preset's shape, 16 layers), 300 steps
#                           of 8 x 1 x 1024 tokens
#   four  (nvidia-h200-x4, or -h100-x4): 20.25 B (the 20b preset) on 4 GPUs, 100 steps of
#                           4 x 1 x 1024 tokens per GPU; then the largest model of width 6144 the
#                           planner accepts there (MAX_LAYERS: 190 on 4xH200 = 86.4 B, 152 on
#                           4xH100 = 69.2 B, as its refusal names), 10 steps, the same batch
# Usage (device): source benchmarks/device_env.sh; OUT=... bash benchmarks/defaults_gpu.sh STAGE
# Writes OUT/STAGE_NAME.log and .metrics.jsonl per run and OUT/STAGE_summary.md (the table:
# step-1 loss, the highest logged loss after step 3, the last loss, the defaults line).
set -u
STAGE=${1:?one, wide or four}
OUT=${OUT:-/tmp/defaults_gpu}
D=/tmp/defaults_data
mkdir -p "$OUT" "$D"
export PYTHONPATH=.${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
python3 benchmarks/stdlib_jsonl.py "$D/pystd.jsonl"
python3 -m fitgpt data preprocess --input "$D/pystd.jsonl" --json-key text \
  --output-prefix "$D/pystd" --workers 8 --append-eod > "$OUT/${STAGE}_preprocess.log" 2>&1 \
  || { tail -3 "$OUT/${STAGE}_preprocess.log"; exit 1; }
DATA="$D/pystd_text_document"
run() {  # name, limit in seconds, then fitgpt train's flags
  local name=$1 limit=$2; shift 2
  local dir=/tmp/defaults_runs/$name
  echo "== $name: fitgpt train $*" | tee "$OUT/$name.log"
  timeout "$limit" python3 -m fitgpt train --data "$DATA" --out "$dir" --overwrite --no-save \
    --eval-every 0 --log-every 1 "$@" >> "$OUT/$name.log" 2>&1
  echo "== $name: exit $?" | tee -a "$OUT/$name.log"
  cp "$dir/metrics.jsonl" "$OUT/$name.metrics.jsonl" 2>/dev/null
  grep -E "^defaults|^plan|^model|^placement|error|Error|spike|diverg" "$OUT/$name.log" | cut -c1-220
}
case $STAGE in
  one)
    run gpt2_1p5b 540 --preset gpt2-1.5b --micro-batch 8 --grad-accum 4 --steps 300 ;;
  wide)
    run w6144_l16 560 --preset 20b --layers 16 --micro-batch 8 --grad-accum 1 --steps 300 ;;
  four)
    run 20b_x4 230 --gpus 4 --preset 20b --micro-batch 4 --grad-accum 1 --steps 100
    run "largest_x4_l${MAX_LAYERS:-190}" 330 --gpus 4 --preset 20b --layers "${MAX_LAYERS:-190}" \
      --micro-batch 4 --grad-accum 1 --steps 10 ;;
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
