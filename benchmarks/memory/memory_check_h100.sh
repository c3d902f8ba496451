#!/usr/bin/env bash
# The memory model against measurement again (the 2026-11-22 trials of
# benchmarks/history/memory_h100.sh, in git at commit 7c35cee, held the whole logits; since then
# the loss runs a piece of rows at a time and the head's moment is priced apart from a block's
# backward, and the model's GPU peaks fell 5-15% under those old measured ones). The same 8
# configurations: ddp and ZeRO stages 0/1/3 × checkpointing off/full at hidden 4096 × 8 layers
# (2.03 B), micro-batch 8 × 4 accumulation × 1024, bf16, each trial its own process, its measured
# GPU peak (max_memory_allocated) beside the prediction for the plan it ran. One nvidia-h100-x1
# call.
# Usage (device): source benchmarks/device_env.sh; OUT=$OUT bash benchmarks/memory/memory_check_h100.sh
set -u
OUT=${OUT:-/tmp/memory_check}
mkdir -p "$OUT"
export PYTHONPATH=.${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
for ck in off full; do
  python3 -m fitgpt bench sweep --systems ddp,zero0,zero1,zero3 --sizes 8 --checkpointing $ck \
    --warmup 1 --steps 2 --time-limit 100 --out "$OUT/memory_model.jsonl" 2>&1 | grep -E "ok|fail|oom|timeout"
done
rm -rf "$OUT"/memory_model.logs
python3 - "$OUT/memory_model.jsonl" <<'PY' | tee "$OUT/table.txt"
import json, sys

print(f"{'system':<8}{'ckpt':<6}{'status':<8}{'GPU peak':>10}{'predicted':>11}{'error':>8}{'TFLOP/s':>9}")
for line in open(sys.argv[1]):
    r = json.loads(line)
    ck = r["bench"].get("checkpointing", "?")
    m, p = r.get("gpu_peak_gib"), r.get("predicted_gpu_peak_gib")
    err = f"{(p - m) / m * 100:+.1f}%" if m and p else "-"
    print(f"{r['system']:<8}{ck:<6}{r['status']:<8}{m or float('nan'):>10.1f}{p or float('nan'):>11.1f}"
          f"{err:>8}{r.get('tflops') or float('nan'):>9.0f}")
PY
