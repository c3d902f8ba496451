#!/usr/bin/env bash
# Issue 16: where a compiled GPT-2 124 M step's wall time goes, without a profiler (whose own
# host cost doubles a step of this size). `fitgpt train --preset gpt2-125m --micro-batch 12
# --grad-accum 4` (the nanoGPT comparison's batch) on random tokens, 40 steps, every step
# logged: the train records' phases (GPU time from the step's start to the end of the
# backward, the reduction and norm, the update; events, no added sync) against the host's
# wall time per step; the rest is the gap between steps (the sync, data, the loop). Runs:
# compiled with the planner's engine, compiled with --engine ddp, eager.
# Usage (device): OUT=... bash benchmarks/history/small_step_h100.sh
set -u
OUT=${OUT:-/tmp/small_step}
mkdir -p "$OUT"
export PYTHONPATH=. PYTHONUNBUFFERED=1
ARGS="--preset gpt2-125m --micro-batch 12 --grad-accum 4 --data uniform --steps 40 --log-every 1
  --eval-every 0 --no-save --overwrite"
for spec in "planned --compile on" "ddp --compile on --engine ddp" "eager --compile off"; do
  set -- $spec
  name=$1; shift
  timeout 150 python3 -m fitgpt train $ARGS "$@" --out /tmp/ss_$name > "$OUT/$name.log" 2>&1
  echo "$name: exit $?"; grep -E "^plan:|^compile" "$OUT/$name.log" | cut -c1-160
  cp /tmp/ss_$name/metrics.jsonl "$OUT/$name.metrics.jsonl" 2>/dev/null
done
python3 - "$OUT" <<'PY'
import json, statistics, sys
from pathlib import Path
keys = ("ms_per_step", "forward_backward_s", "reduce_and_norm_s", "update_s")
print(f"{'run':<8} {'wall ms':>8} {'fwd+bwd':>8} {'reduce':>8} {'update':>8} {'gap':>8}  (medians, steps 11-40)")
for name in ("planned", "ddp", "eager"):
    f = Path(sys.argv[1]) / f"{name}.metrics.jsonl"
    if not f.exists():
        continue
    rows = [json.loads(x) for x in f.read_text().splitlines()]
    rows = [r for r in rows if r.get("kind") == "train" and r["step"] > 10]
    if not rows or "forward_backward_s" not in rows[0]:
        print(name, "no phases")
        continue
    med = {k: statistics.median(r[k] for r in rows) for k in keys}
    ph = [1000 * med[k] for k in keys[1:]]
    print(f"{name:<8} {med['ms_per_step']:8.1f} " + " ".join(f"{p:8.1f}" for p in ph)
          + f" {med['ms_per_step'] - sum(ph):8.1f}")
PY
