#!/usr/bin/env bash
# Issue 52 (several machines), its GPU bar, on one 4-GPU box (nvidia-h200-x4) carved into two
# 2-GPU "machines": machine 0 on GPUs 0,1 and machine 1 on GPUs 2,3, each started as a user
# starts a machine of a job (`fitgpt probe|train --nnodes 2 --node-rank R --gpus 2 --master-addr
# 127.0.0.1 --master-port P`). NCCL_HOSTID gives each machine its own host identity, so NCCL
# treats them as two hosts: inside a machine the GPUs talk over NVLink, between the two they
# talk through NCCL's socket transport over the kernel's TCP stack (NCCL_NET=Socket on lo), as
# boxes without InfiniBand do; nothing crosses by NVLink or shared memory. Each machine also has
# its half of the cores (taskset) and of the RAM (--cpu-mem).
#   probe  `fitgpt probe` on both machines: NVLink inside one, and the link between them
#          (cached in $FITGPT_CACHE, where both trains read it as a user's would)
#   node   the planner's plan with --shard-within node (HSDP: ZeRO-3 inside each machine,
#          replicas across the two)
#   flat   the planner's plan with --shard-within world (ZeRO-3 over all 4 ranks)
# The same 20 B model (the 20b preset, 44 layers of 6144) on random tokens and the same batch
# in both (MB sequences x GA accumulation x 1,024 tokens per GPU, bf16), ZeRO-3 pinned, the rest
# the planner's. Each machine is told half the box's available RAM (--cpu-mem): both run on one
# host, and each would otherwise plan for all of it. Each stage's step lines (step time beside
# the plan's) are in $OUT/STAGE_node0.txt; summary.json has both plans and the measured steps.
# Usage (device, nvidia-h200-x4): OUT=$OUT bash benchmarks/multi_gpu/nodes_x4.sh [probe node flat]
# On a 2-GPU box, two 1-GPU machines: GPM=1 PRESET=6.7b OUT=$OUT bash benchmarks/multi_gpu/nodes_x4.sh
# CPU rehearsal: PRESET=tiny DEVICE=cpu MB=2 GA=2 bash benchmarks/multi_gpu/nodes_x4.sh
set -u
OUT=${OUT:-/tmp/nodes_x4}
DEADLINE=${DEADLINE:-560}
STEPS=${STEPS:-3}
PRESET=${PRESET:-20b}
MB=${MB:-8}
GA=${GA:-2}
DEVICE=${DEVICE:-cuda}
GPM=${GPM:-2}  # GPUs per machine: 1 carves a 2-GPU box (nvidia-h200-x2) the same way
mkdir -p "$OUT"
STAGE=nodes
if [ "$DEVICE" = cuda ]; then
  source benchmarks/multi_gpu/x4_env.sh
else
  export PYTHONPATH=.${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
  T0=$(date +%s); left() { echo $((DEADLINE - ($(date +%s) - T0))); }
fi
export NCCL_NET=Socket NCCL_SOCKET_IFNAME=lo NCCL_IB_DISABLE=1 FITGPT_CACHE=$OUT/cache
# each machine its half of the cores too: fitgpt sizes its threads by the cores it may use
HALF=$(($(nproc) / 2))
AVAIL_GB=$(awk '/MemAvailable/ {print int($2 / 1e6)}' /proc/meminfo)
PORT=${PORT:-29511}
RUN=(--preset "$PRESET" --data synthetic --seq-len 1024 --micro-batch "$MB" --grad-accum "$GA"
     --precision bf16 --engine zero --zero-stage 3 --steps "$STEPS" --log-every 1 --device "$DEVICE"
     --eval-every 0 --no-save --cpu-mem "$((AVAIL_GB / 2))GB" --dist-timeout 300)
# both machines of one command, each on its own GPUs and host identity; waits for both
machines() {
  local name=$1 budget=$2 r pids=()
  shift 2
  for r in 0 1; do
    CUDA_VISIBLE_DEVICES=$(seq -s, $((r * GPM)) $((r * GPM + GPM - 1))) \
      NCCL_HOSTID=fitgpt-machine-$r timeout "$budget" \
      taskset -c $((r * HALF))-$((r * HALF + HALF - 1)) python3 -m fitgpt "$1" --nnodes 2 \
      --node-rank $r --gpus "$GPM" --master-addr 127.0.0.1 \
      --master-port $PORT "${@:2}" > "$OUT/${name}_node$r.txt" 2>&1 &
    pids+=($!)
  done
  wait "${pids[@]}"  # these two only: x4_env.sh's RAM log runs in the background until exit
  PORT=$((PORT + 1))
}
for stage in ${@:-probe node flat}; do
  budget=$(($(left) - 10))
  [ "$budget" -gt 40 ] || { echo "$stage: no time left" >&2; break; }
  s=$(date +%s)
  case $stage in
    probe) machines probe 180 probe ;;
    node|flat)
      within=$([ "$stage" = node ] && echo node || echo world)
      machines "$stage" "$budget" train --shard-within "$within" "${RUN[@]}" \
        --out "$OUT/run_${stage}" --overwrite ;;
    *) echo "unknown stage $stage (probe, node or flat)" >&2; exit 2 ;;
  esac
  echo "== $stage: $(( $(date +%s) - s )) s"
  grep -E "^plan:|^step |between nodes|bus bandwidth|rror" "$OUT/${stage}_node0.txt" | cut -c1-400
  tail -2 "$OUT/${stage}_node1.txt"
done
python3 benchmarks/multi_gpu/nodes_summary.py "$OUT" | tee "$OUT/summary.txt"
