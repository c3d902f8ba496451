#!/usr/bin/env bash
# Issue 15: steps that guess (the speculative update) at 8.07 B on nvidia-h100-x1, past the
# first clean step. benchmarks/delayed_h100.sh (removed with the delayed update; in git at
# 104145a) saw steps 4-6 grow from 4.0 to 9.7 s once the gradient norm fell under the clip (the
# first guessing steps any 8 B run has timed: the sweep times steps 2-3, the real-data run
# clipped every step). `fitgpt train` on random tokens, the
# planner's plan (ANCHORS shape, 38 layers), 10 steps with the speculative update (default; a
# profile of steps 4-5) and 10 without; `vmstat 5` beside them (host CPU, memory, swap). Each
# step's phases and host-optimizer waits are in the runs' metrics.jsonl, copied to $OUT.
# LAYERS=56 (11.69 B) instead of 38 (8.07 B) for the larger ANCHORS size.
# Usage (device): OUT=... [LAYERS=38] bash benchmarks/history/spec_growth_h100.sh
set -u
OUT=${OUT:-/tmp/spec_growth}
mkdir -p "$OUT"
export PYTHONPATH=. PYTHONUNBUFFERED=1
ARGS="--preset 6.7b --no-tie-embeddings --layers ${LAYERS:-38} --micro-batch 8 --grad-accum 4 --data uniform
  --steps 10 --log-every 1 --eval-every 0 --no-save --overwrite"
vmstat -t 5 > "$OUT/vmstat.txt" 2>&1 &
VM=$!
for mode in speculative-update no-speculative-update; do
  extra=""
  [ "$mode" = speculative-update ] && extra="--profile 2"
  timeout 230 python3 -m fitgpt train $ARGS --$mode $extra --out /tmp/sg_$mode > "$OUT/$mode.log" 2>&1
  echo "$mode: exit $?"
  grep -E "^plan:|^step|^profile" "$OUT/$mode.log" | cut -c1-150
  cp /tmp/sg_$mode/metrics.jsonl "$OUT/$mode.metrics.jsonl" 2>/dev/null
  cp /tmp/sg_$mode/profile/summary.txt "$OUT/$mode.profile.txt" 2>/dev/null
  gzip -c /tmp/sg_$mode/profile/trace.json > "$OUT/$mode.trace.json.gz" 2>/dev/null
done
kill $VM
python3 - "$OUT" <<'PY'
import json, sys
from pathlib import Path
keys = ("ms_per_step", "grad_norm", "speculated_steps", "rollbacks", "forward_backward_s",
        "update_s", "host_adamw_busy_s", "host_wait_s", "slot_wait_s", "copy_d2h_s", "copy_h2d_s")
for mode in ("speculative-update", "no-speculative-update"):
    f = Path(sys.argv[1]) / f"{mode}.metrics.jsonl"
    if not f.exists():
        continue
    print(mode)
    print(" step " + " ".join(f"{k[:12]:>12}" for k in keys))
    for line in f.read_text().splitlines():
        r = json.loads(line)
        if r.get("kind") == "train":
            print(f"{r['step']:5d} " + " ".join(f"{r.get(k, float('nan')):12.3f}" for k in keys))
PY
