#!/usr/bin/env bash
# Issue 34 (20 · the seed's headline on a 4-GPU machine): fitgpt beside the peers on one 4-GPU
# box, through `fitgpt bench sweep --gpus N` as a user types it (random tokens, the protocol's
# batch: 8 sequences × 4 accumulation steps × 1024 tokens per GPU, untied head, bf16, full
# activation checkpointing for every system). Width 6144, 48 heads (the 20b preset's shape);
# 44 layers = 20.25 B. One stage per device call (nvidia-h200-x4 or nvidia-h100-x4; carry .whl
# for DeepSpeed):
#   peers  at 20.25 B on all 4 GPUs: fitgpt (the planner's plan), DeepSpeed ZeRO-3 with
#          parameters and optimizer offloaded to CPU, FSDP2 with CPUOffloadPolicy, and the DDP
#          baseline (refused before launch by the memory model where it cannot fit); then, as
#          the budget allows, 8 layers (3.7 B) for DDP and fitgpt; then `fitgpt probe` (this
#          box's rates, for the record: the sweep ran on the defaults)
#   scale  fitgpt at 20.25 B on 1, 2 and 4 GPUs of the same box (CUDA_VISIBLE_DEVICES), tokens/s
#          per GPU (GPUS="4" for a subset of the three)
# Each trial records the planner's step time term by term (predicted_terms_s) beside the
# measured one, and the engine's phase breakdown.
# Usage (device): OUT=... bash benchmarks/multi_gpu/x4_sweep.sh STAGE
set -u
STAGE=${1:?stage: peers or scale}
OUT=${OUT:-/tmp/x4_sweep}
DEADLINE=${DEADLINE:-570}
mkdir -p "$OUT"
source benchmarks/multi_gpu/x4_env.sh
SHAPE=(--hidden 6144 --heads 48 --warmup 1 --steps 2)
case $STAGE in
  peers)
    python3 -m fitgpt bench sweep --gpus 4 --systems fitgpt,deepspeed-z3-offload,fsdp2-offload,ddp \
      --sizes 44 "${SHAPE[@]}" --time-limit 280 --budget $(($(left) - 60)) --out "$OUT/peers.jsonl"
    python3 -m fitgpt bench sweep --gpus 4 --systems ddp,fitgpt --sizes 8 "${SHAPE[@]}" \
      --time-limit 120 --budget $(($(left) - 50)) --out "$OUT/peers.jsonl"
    timeout $(($(left) - 5)) python3 -m fitgpt probe --gpus 4 > "$OUT/probe.txt" 2>&1
    tail -12 "$OUT/probe.txt"
    ;;
  scale)
    for g in ${GPUS:-1 2 4}; do
      CUDA_VISIBLE_DEVICES=$(seq -s, 0 $((g - 1))) python3 -m fitgpt bench sweep --gpus $g \
        --systems fitgpt --sizes 44 "${SHAPE[@]}" --time-limit 170 --budget $(($(left) - 10)) \
        --out "$OUT/scale.jsonl"
    done
    ;;
  *)
    echo "unknown stage $STAGE" >&2
    exit 2
    ;;
esac
python3 -m fitgpt bench report "$OUT/$STAGE.jsonl" > /dev/null 2>&1
python3 - "$OUT/$STAGE.jsonl" <<'EOF'
import json, sys

recs = [json.loads(line) for line in open(sys.argv[1]) if line.strip()]
print(f"{'system':<22}{'G':>2}{'L':>4}{'params':>8}  {'status':<8}{'step s':>8}{'plan s':>8}"
      f"{'tok/s/GPU':>10}{'TFLOP/s':>8}{'GPU GiB':>8}{'RAM GiB':>8}  note")
for r in recs:
    ok = r["status"] == "ok"
    g = r.get("world", 1)
    note = r.get("placement", "") if ok else r.get("reason", "")
    print(f"{r['system']:<22}{g:>2}{r['layers']:>4}{r['params'] / 1e9:>7.2f}B  {r['status']:<8}"
          f"{r.get('step_s', float('nan')):>8.2f}{r.get('predicted_step_s', float('nan')):>8.2f}"
          f"{r.get('tokens_per_s', float('nan')) / g:>10.0f}{r.get('tflops', float('nan')):>8.1f}"
          f"{r.get('gpu_peak_gib', float('nan')):>8.1f}{r.get('host_rss_peak_gib', float('nan')):>8.1f}"
          f"  {str(note)[:150]}")
for r in recs:
    if r["status"] == "ok" and "predicted_terms_s" in r:
        t = {k: round(v, 2) for k, v in r["predicted_terms_s"].items()}
        b = {k: round(v, 2) for k, v in r.get("breakdown_s", {}).items()}
        print(f"\n{r['system']} G={r.get('world')} L={r['layers']}: plan {t}\n  measured {b}")
for r in recs:
    if r["status"] not in ("ok", "refused"):
        print(f"\n--- {r['system']} L={r['layers']}: {r['status']}")
        print((r.get("traceback") or r.get("log_tail") or "")[-1200:])
EOF
