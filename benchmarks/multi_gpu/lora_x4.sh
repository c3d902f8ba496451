#!/usr/bin/env bash
# LoRA on a frozen base placed by the planner, on a 4-GPU kind (nvidia-h200-x4: 4x H200, ~470 GB
# usable host RAM, 235 GB disk), issue 51. One stage a call (each within ~540 s):
#   smoke      the frozen base's GPU paths at the Llama-3.1-8B shape (random base from its preset,
#              LoRA r=16 all-linear, 3 steps of 4,096 synthetic tokens), three runs at once, one
#              per GPU set: NF4 on an 80 GB share of GPU 0 (--gpu-mem), bf16 with 16 of its 32
#              blocks streamed from pinned host RAM on GPU 1 (qlora_smoke_gpu.sh's two checks),
#              and int8 sharded over GPUs 2-3 with its last 8 blocks streamed (l405's own path,
#              small). ~100 s.
#   l405       the Llama-3.1-405B shape from its preset (126 blocks of width 16384, 405.85 B),
#              LoRA r=16 all-linear, `fitgpt train --gpus 4`, 5 steps of micro-batch 1 x 4,096
#              tokens a rank, the base built at random straight into its tiers and placed by the
#              planner. FMT (default int8) is the base's format: at bf16 it is 811 GB and does
#              not fit GPUs + host RAM (the planner refuses it without a disk); int8 fits them,
#              sharded over the 4 ranks. Plan on the CPU (`fitgpt plan ... --gpu-mem 139GiB
#              --cpu-mem 470GB`, printed first here): int8, 96 of 126 blocks on the GPUs, 30
#              streamed from host RAM, each block cut over 4 ranks; 135.7 GiB a GPU, 93.9 GiB
#              host for the 4 ranks. Step estimate from it and the planner's H200 rates: 6
#              matmul passes (forward, recompute, input gradient; no weight gradient) x 403.75 G
#              multiplying parameters x 4,096 tokens at 695 TFLOP/s ~ 14.3 s, attention ~1 s,
#              dequantising each block 3 times ~0.9 s; the gathers (~2.3 s at 265 GB/s) and the
#              host stream (~0.9 s at 55 GB/s) overlap: ~17-19 s a step, ~900 tokens/s for the
#              4 GPUs. The random base: every rank draws each block in fp32 on its GPU (3.2 G
#              values, ~12.8 GB, one block at a time) and keeps its quarter in int8: seconds of
#              GPU time; the process start, NCCL and pinning 22 GiB a rank dominate (~40-60 s).
#              So ~150 s to the last step, then the adapters' checkpoint (623 M values and
#              their moments, ~7.5 GB) and `fitgpt export --format peft` (~2.5 GB).
#   l405-bf16  the same with FMT=bf16 and a disk tier (--nvme-path under /tmp): the planner puts
#              52 blocks on the GPUs, 74 in host RAM (432 of 438 GiB: tight) of which 5 on the
#              disk (30 GB). The disk (~2 GB/s, shared by the ranks) makes each step ~30 s longer:
#              STEPS defaults to 3 there.
# Recorded in OUT: the plan with its byte breakdown (the box's stated figures, then the figures
# detected on it), each log line with the seconds since the command, GPU memory used per GPU and
# disk used every 2 s (STAGE_gpu_disk.txt) and host RAM every 5 s (x4_env.sh: STAGE_ram.txt), their
# peaks, the metrics, tokens/s of the steps after the first, the exported adapter's files.
# Usage (device): OUT=$OUT bash benchmarks/multi_gpu/lora_x4.sh [smoke|l405|l405-bf16]
#   env: FMT, MB, SEQ, STEPS (the 405B run), DEADLINE (seconds for the call, default 540),
#   EXTRA (more train flags). .whl must carry bitsandbytes (int8/NF4 quantise with it).
#   The plan fills 135.7 of 136.2 usable GiB a GPU: if a rank runs out of memory, EXTRA="--base-host-blocks
#   40" streams 10 more blocks (~0.3 s more of PCIe a step, overlapped); a step too long: SEQ=2048.
# CPU rehearsal (this script's commands at --layers 2, width 64, 4 gloo ranks, the placement
#   forced since the CPU streams nothing unless asked): TINY=1 bash benchmarks/multi_gpu/lora_x4.sh l405
set -u
STAGE=${1:-l405}
OUT=${OUT:-/tmp/lora_x4}
DEADLINE=${DEADLINE:-540}
W=${WORK:-/tmp/lora_x4_work}
mkdir -p "$OUT" "$W"
case $STAGE in smoke | l405 | l405-bf16) ;; *)
  echo "lora_x4.sh: no stage $STAGE; use smoke, l405 or l405-bf16" >&2; exit 2 ;; esac
source benchmarks/multi_gpu/x4_env.sh
python3 -c "import bitsandbytes as b; print('bitsandbytes', b.__version__)" 2>&1 | tail -1
TINY=${TINY:-}
if [ -z "$TINY" ]; then  # GPU memory (MiB, one column a GPU) and disk used (GB), every 2 s
  while sleep 2; do
    echo "$(($(date +%s) - T0)) $(nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits \
      | paste -sd' ') $(df -BG --output=used /tmp | tail -1 | tr -dc 0-9)"
  done > "$OUT/${STAGE}_gpu_disk.txt" 2>/dev/null &
  GPULOG=$!
  trap 'kill $RAMLOG $GPULOG 2>/dev/null' EXIT
fi
# the shape at CPU rehearsal size: the preset's family and flags, 2 blocks of width 64
SMALL=()
[ -n "$TINY" ] && SMALL=(--layers 2 --hidden 64 --heads 8 --ffn-hidden 128 --vocab-size 256)

stamp() {  # each line of a command's output with the seconds since the command began
  local s
  s=$(date +%s)
  while IFS= read -r l; do echo "$(($(date +%s) - s))s $l"; done
}

peaks() {  # GPU (GiB, per GPU), disk and host RAM peaks of this stage
  [ -s "$OUT/${STAGE}_gpu_disk.txt" ] && awk '{for (i = 2; i < NF; i++) if ($i > g[i]) g[i] = $i
      if ($NF > d) d = $NF; if (!b) b = $NF}
    END {s = "GPU used peak GiB:"; for (i = 2; i in g; i++) s = s sprintf(" %.1f", g[i] / 1024)
      print s "; disk used peak " d " GB (" d - b " GB above the start)"}' "$OUT/${STAGE}_gpu_disk.txt"
  sort -k2 -n "$OUT/${STAGE}_ram.txt" | tail -1 | awk '{print "host RAM used peak " $2 " GiB at " $1 " s"}'
}

tokens_per_s() {  # the mean tokens/s of the steps after the first (its start-up excluded)
  python3 - "$1" <<'EOF'
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if '"train"' in l]
rows = [r for r in rows if r.get("kind") == "train"]
rest = rows[1:] or rows
if rest:
    tps = sum(r["tokens_per_s"] for r in rest) / len(rest)
    ms = sum(r["ms_per_step"] for r in rest) / len(rest)
    print(f"steps {rows[0]['step']}-{rows[-1]['step']}: {tps:,.0f} tokens/s, {ms / 1e3:.2f} s a step "
          f"(mean of steps {rest[0]['step']}-{rest[-1]['step']}); losses "
          + " ".join(f"{r['loss']:.4f}" for r in rows))
EOF
}

if [ "$STAGE" = smoke ]; then
  COMMON=(--preset llama3.1-8b "${SMALL[@]}" --lora-rank 16 --data synthetic --micro-batch 1
    --seq-len "${SEQ:-4096}" --steps 3 --log-every 1 --eval-every 0 --lr 1e-4 --no-save --overwrite)
  [ -n "$TINY" ] && COMMON+=(--seq-len 64)
  RUNS=()  # the runs' process ids: a bare `wait` would wait for the RAM and GPU loggers too
  run() {  # name, GPUs, flags...: one run in the background, its log stamped
    local name=$1 gpus=$2
    shift 2
    (CUDA_VISIBLE_DEVICES=$gpus timeout $(($(left) - 10)) python3 -m fitgpt train "${COMMON[@]}" \
      "$@" --out "$W/$name" 2>&1 | stamp > "$OUT/smoke_$name.log"
      echo "== $name (GPUs $gpus): exit ${PIPESTATUS[0]}" >> "$OUT/smoke_$name.log") &
    RUNS+=($!)
  }
  if [ -n "$TINY" ]; then  # the CPU has no GPU sets: the three one after another
    run nf4 "" --base-format nf4 --gpu-mem 80GB; wait $!
    run bf16_host16 "" --base-format bf16 --base-host-blocks 1; wait $!
    run int8_x2 "" --gpus 2 --base-format int8 --base-sharded --base-host-blocks 1 \
      --checkpointing full; wait $!
  else
    run nf4 0 --base-format nf4 --gpu-mem 80GB
    run bf16_host16 1 --base-format bf16 --base-host-blocks 16
    run int8_x2 2,3 --gpus 2 --base-format int8 --base-sharded --base-host-blocks 8 \
      --checkpointing full
    wait "${RUNS[@]}"
  fi
  for name in nf4 bf16_host16 int8_x2; do
    grep -E "LoRA:|placement|step |rror|refus|== " "$OUT/smoke_$name.log" | cut -c1-260
  done
  peaks
  exit 0
fi

# the 405B shape
FMT=${FMT:-int8}
[ "$STAGE" = l405-bf16 ] && FMT=bf16
SHAPE=(--preset llama3.1-405b --lora-rank 16 --base-format "$FMT" --checkpointing full
  --micro-batch "${MB:-1}" --seq-len "${SEQ:-4096}")
PLAN_DISK=() TRAIN_DISK=()
if [ "$STAGE" = l405-bf16 ]; then
  mkdir -p "$W/nvme"
  PLAN_DISK=(--nvme "$W/nvme") TRAIN_DISK=(--nvme-path "$W/nvme")
fi
echo "== the plan for the box as stated (what the CPU verified): 4 x 139 GiB, 470 GB host" \
  | tee "$OUT/${STAGE}_plan.txt"
python3 -m fitgpt plan "${SHAPE[@]}" --gpus 4 --gpu-mem 139GiB --cpu-mem 470GB --device cuda \
  ${PLAN_DISK[@]+"${PLAN_DISK[@]}"} --breakdown 2>&1 | tee -a "$OUT/${STAGE}_plan.txt"
if [ -z "$TINY" ]; then
  echo "== the plan for the box as detected" | tee -a "$OUT/${STAGE}_plan.txt"
  python3 -m fitgpt plan "${SHAPE[@]}" --gpus 4 ${PLAN_DISK[@]+"${PLAN_DISK[@]}"} --breakdown \
    2>&1 | tee -a "$OUT/${STAGE}_plan.txt"
fi
CMD=(python3 -m fitgpt train "${SHAPE[@]}" --gpus 4 --data synthetic
  --steps "${STEPS:-$([ "$STAGE" = l405-bf16 ] && echo 3 || echo 5)}" --log-every 1
  --eval-every 0 --lr 1e-4 --overwrite --out "$W/run" ${TRAIN_DISK[@]+"${TRAIN_DISK[@]}"})
if [ -n "$TINY" ]; then  # the CPU streams and shards only when asked; its own length
  CMD+=("${SMALL[@]}" --seq-len 64 --base-host-blocks 1 --base-sharded)
  [ "$STAGE" = l405-bf16 ] && CMD+=(--base-disk-blocks 1)
fi
read -r -a extra <<< "${EXTRA:-}"
CMD+=(${extra[@]+"${extra[@]}"})
echo "== ${CMD[*]}" | tee "$OUT/${STAGE}_train.log"
# the export and its check keep ~45 s of the call
timeout $(($(left) - 45)) "${CMD[@]}" 2>&1 | stamp >> "$OUT/${STAGE}_train.log"
echo "== train exit ${PIPESTATUS[0]} at $(($(date +%s) - T0)) s" | tee -a "$OUT/${STAGE}_train.log"
grep -E "LoRA:|placement|^[0-9]+s model|step |saved|rror|refus|Killed" "$OUT/${STAGE}_train.log" \
  | cut -c1-300 | head -30
cp "$W/run/metrics.jsonl" "$OUT/${STAGE}_metrics.jsonl" 2>/dev/null &&
  tokens_per_s "$OUT/${STAGE}_metrics.jsonl" | tee "$OUT/${STAGE}_summary.txt"
peaks | tee -a "$OUT/${STAGE}_summary.txt"
du -sh "$W/run" 2>/dev/null
if ls -d "$W"/run/step_* > /dev/null 2>&1; then
  s=$(date +%s)
  timeout $(($(left) - 5)) python3 -m fitgpt export --ckpt "$W/run" --format peft \
    --out "$W/adapter" 2>&1 | tail -2
  echo "export: exit ${PIPESTATUS[0]} in $(($(date +%s) - s)) s" | tee -a "$OUT/${STAGE}_summary.txt"
  ls -l "$W/adapter" | tee -a "$OUT/${STAGE}_summary.txt"
  python3 - "$W/adapter" <<'EOF' | tee -a "$OUT/${STAGE}_summary.txt"
import json, sys
from safetensors import safe_open
cfg = json.load(open(f"{sys.argv[1]}/adapter_config.json"))
with safe_open(f"{sys.argv[1]}/adapter_model.safetensors", "pt") as f:
    keys = list(f.keys())
    n = sum(f.get_slice(k).get_shape()[0] * f.get_slice(k).get_shape()[1] for k in keys)
print(f"adapter: r {cfg['r']}, {len(keys)} tensors, {n:,} values; first {keys[0]}")
EOF
fi
