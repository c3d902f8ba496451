#!/usr/bin/env bash
# Issue 6 (tiered memory), the done-when sweep on nvidia-h100-x1: fitgpt (the planner's choice,
# offered the disk as a third tier under /tmp/fitgpt-nvme), fitgpt's own all-on-GPU plan
# (fitgpt-no-offload), the PyTorch baseline (ddp), DeepSpeed ZeRO-3 with CPU offload of optimizer
# state and parameters, and FSDP2 with CPUOffloadPolicy; one model definition, the ANCHORS
# protocol (hidden 4096, 32 heads, seq 1024, untied head, micro-batch 8 x 4 accumulation steps,
# bf16, full activation checkpointing for the peers), 1 warm-up + 2 timed steps per trial.
#
# One results file, filled by as many calls as it takes: each call works until DEADLINE seconds
# (default 540) and the next call of this same script resumes where it stopped (the sweep skips
# finished trials). Between calls, copy $OUT/tiers.jsonl back to $RES/tiers.jsonl.
#
# Sizes (layers; hidden 4096 untied: N = L*201.4M + 416M):
#   1 0.62 B, 8 2.03 B, 16 3.64 B, 20 4.44 B, 24 5.25 B, 38 8.07 B, 48 10.08 B, 56 11.69 B,
#   60 12.50 B, 68 14.11 B
#   - fitgpt: every size (from 60 layers on the planner spills optimizer state to the disk);
#   - fitgpt-no-offload, ddp, deepspeed-z3-offload: up to 24 layers, each until it fails;
#   - fsdp2-offload (~18 TFLOP/s): 1, 4, 8 with a 150 s limit per trial.
# Usage (device, carry .whl): OUT=... bash benchmarks/history/tiers_h100.sh
set -u
OUT=${OUT:-/tmp/tiers}
RES=benchmarks/results/tiers_h100_2026-11-22
DEADLINE=${DEADLINE:-540}
NVME=/tmp/fitgpt-nvme
mkdir -p "$OUT" "$RES" "$NVME"
export PYTHONPATH=. PYTHONUNBUFFERED=1
if compgen -G ".whl/*.whl" > /dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PYTHONPATH
fi
python3 -c "import deepspeed; print('deepspeed', deepspeed.__version__)" 2>&1 | tail -1
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
free -g | head -2
df -h /tmp | tail -1
git log -1 --format='commit %H' 2>/dev/null
T0=$(date +%s)
left() { echo $(( DEADLINE - ($(date +%s) - T0) )); }
run() {  # SYSTEMS SIZES TIME_LIMIT
  local budget; budget=$(left)
  [ "$budget" -gt 20 ] || return 0
  timeout -s TERM $((budget + 30)) python3 -m fitgpt bench sweep --systems "$1" --sizes "$2" \
    --warmup 1 --steps 2 --time-limit "$3" --budget "$budget" --nvme-path "$NVME" \
    --out "$RES/tiers.jsonl"
}
run fitgpt,fitgpt-no-offload,ddp 1,8,16,20,24,38,48,56 300
run fitgpt 60,68 420
run deepspeed-z3-offload 1,8,16,20,24 300
run fsdp2-offload 1,4,8 150
cp "$RES/tiers.jsonl" "$OUT/tiers.jsonl"
tar czf "$OUT/logs_$(date +%H%M%S).tgz" -C "$RES" tiers.logs 2>/dev/null
python3 - "$RES/tiers.jsonl" <<'PY'
import json, sys

recs = [json.loads(line) for line in open(sys.argv[1]) if line.strip()]
print(f"\n{len(recs)} trials recorded")
for r in recs:
    ok = r["status"] == "ok"
    print(f"{r['system']:<22}{r['layers']:>3}{r['params'] / 1e9:>7.2f}B {r['status']:<9}"
          + (f"{r['step_s']:>7.2f} s {r.get('tflops', 0):>5.0f} TF GPU {r.get('gpu_peak_gib', 0):>5.1f}"
             f" RAM {r['host_rss_peak_gib']:>5.1f}" if ok else f" {r['reason'][:80]}")
          + f"  wall {r.get('wall_s', 0):.0f}s")
PY
