#!/usr/bin/env bash
# Issue 5 (benchmark suite): the benchmark sweep on nvidia-h100-x1 — fitgpt (planner's choice), every ablation, the
# PyTorch baseline, DeepSpeed ZeRO-3 and ZeRO-2 offload and FSDP2 offload, one model definition,
# the ANCHORS protocol (hidden 4096, 32 heads, seq 1024, untied head, micro-batch 8 x 4
# accumulation steps, bf16, full activation checkpointing), 1 warm-up + 2 timed steps per trial.
#
# One results file, filled by as many calls as it takes: each call works until DEADLINE seconds
# (default 540) and the next call of this same script resumes where it stopped (the sweep skips
# finished trials). Between calls, copy $OUT/sweep.jsonl back to $RES/sweep.jsonl.
#
# Sizes (layers; hidden 4096 untied: N = L*201.4M + 416M):
#   1 0.62 B, 4 1.22 B, 8 2.03 B, 12 2.83 B, 16 3.64 B, 20 4.44 B, 24 5.25 B, 38 8.07 B,
#   48 10.08 B, 56 11.69 B, 60 12.50 B
#   - fitgpt, ddp, DeepSpeed, fitgpt-no-offload and fitgpt-no-ckpt: all sizes, until each fails;
#   - fitgpt-no-accum and fitgpt-no-zero (same capacity as fitgpt on one GPU): 1, 8, 20, 38, 56, 60;
#   - FSDP2 offload and fitgpt-no-mixed (fp32: ~10x slower): 1, 4, 8, 12, 16 with a 120 s limit
#     per trial, so a slow trial ends its line as "timeout" instead of eating the device budget.
# Usage (device, carry .whl): OUT=... bash benchmarks/history/sweep_h100.sh
set -u
OUT=${OUT:-/tmp/sweep}
RES=benchmarks/results/sweep_h100_2026-11-22
DEADLINE=${DEADLINE:-540}
mkdir -p "$OUT" "$RES"
export PYTHONPATH=. PYTHONUNBUFFERED=1
if compgen -G ".whl/*.whl" > /dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PYTHONPATH
fi
python3 -c "import deepspeed; print('deepspeed', deepspeed.__version__)" 2>&1 | tail -1
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
free -g | head -2
df -h /tmp | tail -1
T0=$(date +%s)
left() { echo $(( DEADLINE - ($(date +%s) - T0) )); }
run() {  # SYSTEMS SIZES TIME_LIMIT
  local budget; budget=$(left)
  [ "$budget" -gt 20 ] || return 0
  timeout -s TERM $((budget + 30)) python3 -m fitgpt bench sweep --systems "$1" --sizes "$2" \
    --warmup 1 --steps 2 --time-limit "$3" --budget "$budget" --out "$RES/sweep.jsonl"
}
run fitgpt,ddp,deepspeed-z3-offload,deepspeed-z2-offload,fitgpt-no-offload,fitgpt-no-ckpt \
  1,4,8,12,16,20,24,38,48,56,60 300
run fitgpt-no-accum,fitgpt-no-zero 1,8,20,38,56,60 300
run fsdp2-offload,fitgpt-no-mixed 1,4,8,12,16 120
cp "$RES/sweep.jsonl" "$OUT/sweep.jsonl"
tar czf "$OUT/logs_$(date +%H%M%S).tgz" -C "$RES" sweep.logs
python3 - "$RES/sweep.jsonl" <<'EOF'
import json, sys

recs = [json.loads(line) for line in open(sys.argv[1]) if line.strip()]
print(f"\n{len(recs)} trials recorded")
for r in recs:
    ok = r["status"] == "ok"
    print(f"{r['system']:<22}{r['layers']:>3}{r['params'] / 1e9:>7.2f}B {r['status']:<9}"
          + (f"{r['step_s']:>7.2f} s {r.get('tflops', 0):>5.0f} TF GPU {r.get('gpu_peak_gib', 0):>5.1f}"
             f" RAM {r['host_rss_peak_gib']:>5.1f}" if ok else f" {r['reason'][:80]}")
          + f"  wall {r.get('wall_s', 0):.0f}s")
EOF
