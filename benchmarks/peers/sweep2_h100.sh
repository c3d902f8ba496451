#!/usr/bin/env bash
# Issues 14 and 15 (compact state, stall-free update): the second benchmark sweep on
# nvidia-h100-x1, after compact optimizer state and the native host AdamW. The ANCHORS protocol
# (hidden 4096, 32 heads, seq 1024, untied head, micro-batch 8 x 4 accumulation steps, bf16,
# full activation checkpointing for the peers), `fitgpt bench sweep` and `fitgpt capacity` as a
# user types them, one stage per device call, each stage's trials in $OUT/<stage>.jsonl (the
# records of one results file: cat them together).
#
#   peers  fitgpt (the planner's choice) at 0.62 to 11.69 B (1, 8, 20, 24, 38, 48, 56 layers)
#          and DeepSpeed ZeRO-3 offload at 0.62, 2.03 and 4.44 B (its largest in the first
#          sweep), in one call; 1 warm-up + 2 timed steps per trial
#   cap    `fitgpt capacity --system fitgpt-int8` (int8 moments asked for), then
#          `fitgpt capacity` (the default formats): the largest without the disk, from the
#          planner's prediction, two trials each (the prediction, then one step up)
#   disk   `fitgpt capacity --system fitgpt-int8 --nvme-path ...`: the largest with optimizer
#          state on the disk, one trial of 1 step at the predicted size (a step takes minutes)
#   rest   the GPU tests of compact state (stacks dumped on a hang), the host AdamW per format,
#          and `fitgpt capacity` (default formats) once more
#
# Usage (device; carry .whl for the peers stage):  OUT=... bash benchmarks/peers/sweep2_h100.sh STAGE
set -u
STAGE=${1:?stage: peers, cap, disk or rest}
OUT=${OUT:-/tmp/sweep2}
DEADLINE=${DEADLINE:-560}
mkdir -p "$OUT"
source benchmarks/device_env.sh
T0=$(date +%s)
left() { echo $((DEADLINE - ($(date +%s) - T0))); }
LOGS=/tmp/sweep2_logs
mkdir -p $LOGS
case $STAGE in
  peers)
    python3 -m fitgpt bench sweep --systems fitgpt --sizes 1,8,20,24,38,48,56 --warmup 1 \
      --steps 2 --time-limit 240 --budget $(($(left) - 220)) --out $LOGS/peers.jsonl
    python3 -m fitgpt bench sweep --systems deepspeed-z3-offload --sizes 1,8,20 --warmup 1 \
      --steps 2 --time-limit 200 --budget $(($(left) - 10)) --out $LOGS/peers.jsonl
    ;;
  cap)
    timeout -s TERM $(($(left) / 2 + 40)) python3 -m fitgpt capacity --system fitgpt-int8 \
      --max-trials 2 --time-limit 240 --out $LOGS/cap.jsonl
    timeout -s TERM $(($(left) - 100)) python3 -m fitgpt capacity --max-trials 2 \
      --time-limit 240 --out $LOGS/cap.jsonl
    # the GPU tests of compact state (session 8 saw them stop after the first of ten)
    timeout -s TERM $(($(left) - 5)) python3 -m pytest -x -v --durations=0 \
      tests/test_compact.py -k gpu > "$OUT/gpu_tests.txt" 2>&1
    echo "gpu tests: exit $?"; tail -25 "$OUT/gpu_tests.txt"
    ;;
  disk)
    rm -rf /tmp/fitgpt-nvme && mkdir -p /tmp/fitgpt-nvme  # a killed run's state takes room
    timeout -s TERM $(($(left) - 5)) python3 -m fitgpt capacity --system fitgpt-int8 \
      --nvme-path /tmp/fitgpt-nvme --max-trials 1 --warmup 0 --steps 1 \
      --time-limit $(($(left) - 15)) --out $LOGS/disk.jsonl
    ;;
  rest)
    # the GPU tests of compact state, each stopped with every thread's stack after 45 s (session
    # 8 and the cap stage saw them stop after the first of ten)
    timeout -s TERM 150 python3 -m pytest -x -vv -p no:cacheprovider --timeout 45 \
      --timeout-method thread tests/test_compact.py -k gpu_split > "$OUT/gpu_tests.txt" 2>&1
    echo "gpu tests: exit $?"; grep -E "PASS|FAIL|Timeout|File .*fitgpt" "$OUT/gpu_tests.txt" | head -40
    # the host AdamW per format, native kernel (fp32 master + int8 moments now vectorized)
    python3 benchmarks/parts/host_adamw_formats.py --modes native --reps 3 --out "$OUT/host_adamw.json" \
      2>&1 | tail -12
    # the default formats' capacity again (the cap stage's first trial crashed in the plan's
    # summary line, since fixed)
    timeout -s TERM $(($(left) - 5)) python3 -m fitgpt capacity --max-trials 2 \
      --time-limit 240 --out $LOGS/rest.jsonl
    ;;
  *)
    echo "unknown stage $STAGE" >&2
    exit 2
    ;;
esac
cp $LOGS/$STAGE.jsonl "$OUT/" 2>/dev/null
tar czf "$OUT/$STAGE.logs.tgz" -C $LOGS . 2>/dev/null
python3 - "$OUT/$STAGE.jsonl" <<'EOF'
import json, sys

recs = [json.loads(line) for line in open(sys.argv[1]) if line.strip()]
for r in recs:
    ok = r["status"] == "ok"
    print(f"{r['system']:<22}{r['layers']:>4}{r['params'] / 1e9:>7.2f}B {r['status']:<9}"
          + (f"{r['step_s']:>7.2f} s {r.get('tflops', 0):>5.0f} TF GPU {r.get('gpu_peak_gib', 0):>5.1f}"
             f" RAM {r['host_rss_peak_gib']:>5.1f}" if ok else f" {r.get('reason', '')[:120]}")
          + f"  wall {r.get('wall_s', 0):.0f}s")
EOF
