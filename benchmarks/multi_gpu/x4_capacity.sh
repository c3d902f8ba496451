#!/usr/bin/env bash
# Issue 34 (20 · the seed's headline on a 4-GPU machine): the capacities on one 4-GPU box, through
# `fitgpt capacity --gpus 4` and `fitgpt bench sweep --gpus 4` as a user types them (the sweep's
# protocol: random tokens, 8 sequences × 4 accumulation steps × 1024 tokens per GPU, untied head,
# bf16, width 6144 with 48 heads, full activation checkpointing for the peers). One stage per
# device call (nvidia-h200-x4 with needs_h200; carry .whl for DeepSpeed):
#   peers  DDP's largest (`fitgpt capacity --system ddp`, from the memory model's prediction);
#          DeepSpeed ZeRO-3 offload's largest (parameters and optimizer in pinned host RAM; no
#          memory model, so from DS_START layers, 3 trials of 1 warm-up + 1 timed step, each
#          up to 280 s: building 16.93 B took DeepSpeed 137 s on 2026-11-27); then
#          fitgpt, the planner's plan, at DeepSpeed's largest size (the throughput ratio)
#   disk   fitgpt's largest with the optimizer state of some blocks on the disk tier, default
#          formats (`fitgpt capacity --nvme-path`, one trial at the planner's prediction)
# Host RAM used and available (GiB) every 5 s in STAGE_ram.txt (benchmarks/multi_gpu/x4_env.sh).
# Usage (device): OUT=... bash benchmarks/multi_gpu/x4_capacity.sh STAGE
set -u
STAGE=${1:?stage: peers or disk}
OUT=${OUT:-/tmp/x4_capacity}
DEADLINE=${DEADLINE:-560}
mkdir -p "$OUT"
source benchmarks/multi_gpu/x4_env.sh
SHAPE=(--hidden 6144 --heads 48 --gpus 4)
J=$OUT/capacity.jsonl
case $STAGE in
  peers)
    timeout 100 python3 -m fitgpt capacity --system ddp "${SHAPE[@]}" --max-trials 2 \
      --time-limit 45 --out "$J" 2>&1 | tail -4
    echo "[$(($(date +%s) - T0)) s]"
    timeout $(($(left) - 130)) python3 -m fitgpt capacity --system deepspeed-z3-offload \
      "${SHAPE[@]}" --start "${DS_START:-40}" --max-trials 3 --warmup 1 --steps 1 \
      --time-limit 280 --out "$J" 2>&1 | tee "$OUT/ds_capacity.txt" | tail -5
    echo "[$(($(date +%s) - T0)) s]"
    # DeepSpeed's largest that trained, from the trials' records (the search's own summary line
    # is lost when the timeout above ends it, as on 2026-11-27)
    DSL=$(python3 -c 'import json,sys
ok = [r["layers"] for r in map(json.loads, open(sys.argv[1]))
      if r["system"] == "deepspeed-z3-offload" and r["status"] == "ok"]
print(max(ok) if ok else "")' "$J" 2>/dev/null)
    if [ -n "$DSL" ] && [ "$DSL" -gt 0 ]; then
      timeout $(($(left) - 5)) python3 -m fitgpt bench sweep --systems fitgpt --sizes "$DSL" \
        "${SHAPE[@]}" --warmup 1 --steps 2 --time-limit 110 --out "$OUT/at_ds_largest.jsonl" 2>&1 | tail -3
    fi
    ;;
  disk)
    mkdir -p /tmp/fitgpt_nvme
    timeout $(($(left) - 5)) python3 -m fitgpt capacity "${SHAPE[@]}" --nvme-path /tmp/fitgpt_nvme \
      --max-trials 1 --warmup 1 --steps 1 --time-limit $(($(left) - 25)) --out "$J" 2>&1 | tail -6
    df -h /tmp | tail -1
    ;;
  *)
    echo "unknown stage $STAGE" >&2
    exit 2
    ;;
esac
for f in "$J" "$OUT"/at_ds_largest.jsonl; do
  [ -f "$f" ] || continue
  python3 - "$f" <<'EOF'
import json, sys

for line in open(sys.argv[1]):
    if not line.strip():
        continue
    r = json.loads(line)
    ok = r["status"] == "ok"
    print(f"{r['system']:<22} L={r['layers']:<4} {r['params'] / 1e9:7.2f}B {r['status']:<8}"
          + (f" step {r.get('step_s', 0):.2f} s (plan {r.get('predicted_step_s') or float('nan'):.2f})"
             f" {r.get('tflops', 0):.0f} TFLOP/s/GPU, GPU {r.get('gpu_peak_gib', 0):.1f} GiB"
             f" (pred {r.get('predicted_peak_gib') or float('nan'):.1f}), RSS/rank"
             f" {r.get('host_rss_peak_gib') or float('nan'):.1f} GiB  {r.get('placement', '')[:160]}"
             if ok else f"  {str(r.get('reason', ''))[:300]}"))
EOF
done
