#!/usr/bin/env bash
# Issue 50 on one GPU (nvidia-h200 or nvidia-h100-x1), as a user would, in two calls:
#   STAGE=a  (or STAGES="tests grouped train", "train peer", ...: the parts below by name)
#            the GPU-side tests of the redrawn tree (issue 49) and the engines' GPU check; the
#            expert matmuls (moe_gpu.py grouped); then a Qwen3-30B-A3B-shaped model of LAYERS
#            layers trained by `fitgpt train --preset qwen3-moe-30b-a3b --layers LAYERS` with the
#            planner's plan on real text (the Python standard library's source through
#            `fitgpt data preprocess`, GPT-2 BPE), micro-batch 4 × 4 accumulation × 4,096 tokens
#   sink     gpt-oss's sink attention: FlexAttention's path against the SDPA reference (moe_gpu.py sink)
#   blockmem one sparse block's memory against the planner's terms (moe_gpu.py blockmem)
#   ossexp   gpt-oss-20b's experts, routed evenly and all to 4, biases trained and frozen
#   oss      gpt-oss-20b's shape from its preset, the planner's plan (host offload on one GPU)
#   oss80    the same planned for and capped at 80 GB of the GPU (--gpu-mem), the disk allowed
#   STAGE=b  the peer on the same shape, data and batch: transformers + DeepSpeed ZeRO-3 offload
#            (moe_gpu.py peer); GPU_MEM=80GB caps it and the train stage at an H100's memory
# Usage (device): source benchmarks/device_env.sh; STAGE=a OUT=$OUT bash benchmarks/peers/moe_gpu.sh
set -u
OUT=${OUT:-/tmp/moe_gpu}
LAYERS=${LAYERS:-8}
STEPS=${STEPS:-8}
D=/tmp/moe_data
mkdir -p "$OUT" "$D"
export PYTHONUNBUFFERED=1 PYTHONPATH=.${PYTHONPATH:+:$PYTHONPATH}
t() { date +%s; }
BATCH=(--micro-batch 4 --grad-accum 4 --seq-len 4096)
# GPU_MEM=80GB: the stages train and peer on an H100's share of the GPU (fitgpt plans for it and
# caps torch's allocator; the peer's allocator is capped the same), fitgpt told CPU_MEM of RAM
CAP=()
[ -n "${GPU_MEM:-}" ] && CAP=(--gpu-mem "$GPU_MEM" --cpu-mem "${CPU_MEM:-115GB}")
# one `fitgpt train` run: its log, metrics and the host's used memory every 3 s, as OUT/NAME.*
watched() {
  local L="$OUT/$1" run=$2 s P
  shift 2
  echo "== $*" | tee "$L.log"
  s=$(t)
  ( "$@" >> "$L.log" 2>&1; echo "== exit $?" >> "$L.log" ) &
  P=$!
  while kill -0 $P 2>/dev/null; do free -g | awk '/Mem/ {print $3}' >> "$L.host_used_gib.txt"; sleep 3; done
  echo "train: $(( $(t) - s )) s"
  grep -E "plan:|model |step .*tok/s|exit|rror" "$L.log" | head -14
  sort -n "$L.host_used_gib.txt" | tail -1 | sed 's/^/host used peak GiB: /'
  cp "$run/metrics.jsonl" "$L.metrics.jsonl" 2>/dev/null
}
python3 benchmarks/stdlib_jsonl.py "$D/pystd.jsonl"
s=$(t); python3 -m fitgpt data preprocess --input "$D/pystd.jsonl" --json-key text \
  --output-prefix "$D/pystd" --workers 12 --append-eod > "$OUT/preprocess.log" 2>&1 \
  || { tail -3 "$OUT/preprocess.log"; exit 1; }
echo "preprocess: $(( $(t) - s )) s"
STAGES=${STAGES:-}
[ -z "$STAGES" ] && { [ "${STAGE:-a}" = a ] && STAGES="tests grouped train" || STAGES="peer"; }
for part in $STAGES; do case $part in
tests)
  s=$(t); python3 -m pytest -o addopts="" -q -p no:cacheprovider tests/test_compact.py \
    tests/test_host_activations.py tests/test_speculate.py tests/test_moe.py 2>&1 | tail -3 \
    | tee "$OUT/gpu_tests.txt"; echo "gpu tests: $(( $(t) - s )) s"
  s=$(t); python3 benchmarks/checks/gpu_check.py "$OUT/gpu_check.json" 2>&1 | tail -2; echo "gpu check: $(( $(t) - s )) s" ;;
grouped)
  python3 benchmarks/peers/moe_gpu.py grouped "$OUT" 2>&1 | tail -2 ;;
sink)
  python3 benchmarks/peers/moe_gpu.py sink "$OUT" 2>&1 | tail -2 ;;
blockmem)
  python3 benchmarks/peers/moe_gpu.py blockmem "$OUT" 2>&1 | tail -2 ;;
ossexp)
  python3 benchmarks/peers/moe_gpu.py ossexp "$OUT" 2>&1 | tail -2 ;;
train)
  watched "train_l$LAYERS" /tmp/moe_run python3 -m fitgpt train --preset qwen3-moe-30b-a3b \
    --layers "$LAYERS" --data "$D/pystd_text_document" "${BATCH[@]}" --steps "$STEPS" --log-every 1 \
    --eval-every 0 --no-save --lr 1e-4 --warmup 2 --out /tmp/moe_run --overwrite "${CAP[@]}" ;;
oss)
  # gpt-oss-20b's whole shape (its 201,088-row vocabulary: the GPT-2 ids of the data lie below
  # it, --tokenizer none), built from the preset into the planner's tiers, the planner's plan
  # (OSS_ARGS: flags added, e.g. a placement the planner would not choose; OSS_NAME: the files')
  watched "${OSS_NAME:-train_oss20b}" /tmp/oss_run python3 -m fitgpt train --preset gpt-oss-20b \
    --data "$D/pystd_text_document" --tokenizer none --vocab-size 201088 "${BATCH[@]}" \
    --steps "${OSS_STEPS:-6}" --log-every 1 --eval-every 0 --no-save --lr 1e-4 --warmup 2 \
    --out /tmp/oss_run --overwrite ${OSS_ARGS:-} ;;
oss80)
  # the same on an 80 GB share of the GPU (`--gpu-mem 80GB`: the planner plans for an H100's
  # memory and torch's allocator is capped at it) with the host RAM of the H100 box;
  # --nvme-path takes an existing folder (a typo must not write optimizer files elsewhere)
  mkdir -p /tmp/oss80_nvme
  watched train_oss20b_80gb /tmp/oss80_run python3 -m fitgpt train --preset gpt-oss-20b \
    --data "$D/pystd_text_document" --tokenizer none --vocab-size 201088 "${BATCH[@]}" \
    --steps "${OSS_STEPS:-6}" --log-every 1 --eval-every 0 --no-save --lr 1e-4 --warmup 2 \
    --gpu-mem 80GB --cpu-mem "${CPU_MEM:-115GB}" --nvme-path /tmp/oss80_nvme \
    --out /tmp/oss80_run --overwrite ;;
peer)
  L="$OUT/peer_l$LAYERS"
  s=$(t); python3 benchmarks/peers/moe_gpu.py peer "$OUT" --data "$D/pystd_text_document" \
    --layers "$LAYERS" --steps "${PEER_STEPS:-4}" --micro-batch 4 --grad-accum 4 --seq-len 4096 \
    ${GPU_MEM:+--gpu-mem "$GPU_MEM"} > "$L.log" 2>&1; rc=$?; echo "peer: rc $rc $(( $(t) - s )) s"
  [ -f "$OUT/peer.json" ] && mv "$OUT/peer.json" "$L.json"
  grep -vE "^\s*$|Warning|warn|return func|losses.append|Consider using" "$L.log" | tail -8 ;;
esac; done
