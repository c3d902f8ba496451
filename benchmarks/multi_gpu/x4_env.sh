# Sourced by the multi-GPU stage scripts (x4_sweep.sh, x4_capacity.sh) after they set STAGE, OUT
# and DEADLINE: the carried wheels and the machine's figures (device_env.sh), NCCL without NVLink
# multicast (the device's KINDS.md), `left` (seconds to DEADLINE), and host RAM used and
# available (GiB) every 5 s in $OUT/${STAGE}_ram.txt, so a rank the kernel kills (DeepSpeed at
# 20.56 B on 2026-11-26: signal 9, no Python error) can be told apart from other deaths.
source benchmarks/device_env.sh
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
nproc
T0=$(date +%s)
left() { echo $((DEADLINE - ($(date +%s) - T0))); }
while sleep 5; do echo "$(($(date +%s) - T0)) $(free -g | awk '/Mem/ {print $3, $7}')"; done \
  > "$OUT/${STAGE}_ram.txt" 2>/dev/null &
RAMLOG=$!
trap 'kill $RAMLOG 2>/dev/null' EXIT
