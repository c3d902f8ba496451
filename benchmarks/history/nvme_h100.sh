#!/usr/bin/env bash
# Issue 6 (tiered memory), first GPU look at the nvme tier on nvidia-h100-x1: fitgpt (the planner's choice, with
# the disk offered as a third tier under /tmp/fitgpt-nvme) at 68 layers of hidden 4096 = 14.11 B
# parameters, the ANCHORS protocol, 1 warm-up + 2 timed steps. The planner keeps what fits in host
# RAM there and spills the state of the last blocks to files; the trial records the plan, the
# step breakdown (incl. the disk's bytes and waits), GPU peak and host RSS against the prediction.
# Usage (device): OUT=... bash benchmarks/history/nvme_h100.sh
set -u
OUT=${OUT:-/tmp/nvme}
mkdir -p "$OUT" /tmp/fitgpt-nvme
export PYTHONPATH=. PYTHONUNBUFFERED=1
free -g | head -2
df -h /tmp | tail -1
python3 -m fitgpt plan --layers 68 --hidden 4096 --heads 32 --seq-len 1024 --vocab-size 50257 \
  --no-tie-embeddings --nvme /tmp/fitgpt-nvme 2>&1 | head -6
python3 -m fitgpt bench sweep --systems fitgpt --sizes 68 --warmup 1 --steps 2 --time-limit 520 \
  --nvme-path /tmp/fitgpt-nvme --out "$OUT/nvme_14b.jsonl"
ls -la /tmp/fitgpt-nvme
python3 - "$OUT/nvme_14b.jsonl" <<'PY'
import json, sys

for line in open(sys.argv[1]):
    r = json.loads(line)
    keys = ("status", "reason", "params", "step_s", "tflops", "gpu_peak_gib", "predicted_gpu_peak_gib",
            "host_rss_peak_gib", "predicted_host_gib", "engine", "breakdown_s", "losses", "init_s")
    print(json.dumps({k: r.get(k) for k in keys}, indent=1))
PY
