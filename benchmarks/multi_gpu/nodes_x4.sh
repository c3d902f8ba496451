#!/usr/bin/env bash
# Issue 52 (multi-node), its GPU bar, on one 4-GPU box: two "machines" of 2 GPUs each, as two
# `fitgpt train --nnodes 2 --node-rank R --gpus 2 --master-addr 127.0.0.1` processes, machine 0
# on GPUs 0,1 and machine 1 on GPUs 2,3, with NCCL kept off NVLink and shared memory between
# them (NCCL_P2P_DISABLE=1 NCCL_SHM_DISABLE=1: their traffic goes through the network stack, as
# between machines; inside a machine too, which the step times say). A 20 B model (the 20b
# preset: 44 layers of 6144) on random tokens, the same batch in both stages (8 sequences × 4
# accumulation steps × 1024 tokens per GPU, bf16), ZeRO-3 pinned, the rest the planner's:
#   flat  --shard-within world: the ZeRO-3 state sharded over all 4 ranks
#   node  --shard-within node (HSDP): sharded within each machine, replicated across the two
# Each machine is told half the box's available RAM (--cpu-mem): both run on one host, and each
# would otherwise plan for all of it. Every step's line (step time, tokens/s) is logged beside
# the plan's line (its predicted GiB per rank and s/step), in $OUT/STAGE_node0.txt; a refusal
# by the planner (HSDP holds a whole replica per machine) is the stage's result.
# NOT RUN YET: written without a device; its first run checks it.
# Usage (device, nvidia-h200-x4): OUT=... bash benchmarks/multi_gpu/nodes_x4.sh [flat|node]...
set -u
OUT=${OUT:-/tmp/nodes_x4}
DEADLINE=${DEADLINE:-570}
STEPS=${STEPS:-4}
mkdir -p "$OUT"
STAGE=nodes
source benchmarks/multi_gpu/x4_env.sh
export NCCL_P2P_DISABLE=1 NCCL_SHM_DISABLE=1
AVAIL_GB=$(awk '/MemAvailable/ {print int($2 / 1e6)}' /proc/meminfo)
PORT=${PORT:-29511}
RUN=(--preset 20b --data synthetic --seq-len 1024 --micro-batch 8 --grad-accum 4
     --precision bf16 --engine zero --zero-stage 3 --steps "$STEPS" --log-every 1
     --eval-every 0 --no-save --cpu-mem "$((AVAIL_GB / 2))GB" --dist-timeout 300)
for stage in ${@:-flat node}; do
  case $stage in
    flat) within=world ;;
    node) within=node ;;
    *) echo "unknown stage $stage (flat or node)" >&2; exit 2 ;;
  esac
  budget=$(($(left) / 2 - 10))
  [ "$budget" -gt 60 ] || { echo "$stage: no time left" >&2; break; }
  for r in 0 1; do
    CUDA_VISIBLE_DEVICES=$((2 * r)),$((2 * r + 1)) timeout "$budget" python3 -m fitgpt train \
      --nnodes 2 --node-rank $r --gpus 2 --master-addr 127.0.0.1 --master-port $PORT \
      --shard-within $within "${RUN[@]}" --out "$OUT/run_${stage}_$r" \
      > "$OUT/${stage}_node$r.txt" 2>&1 &
  done
  wait
  PORT=$((PORT + 1))
  echo "== $stage (--shard-within $within)"
  grep -E "^plan:|^step |error" "$OUT/${stage}_node0.txt" | cut -c1-220
  tail -3 "$OUT/${stage}_node1.txt"
done
