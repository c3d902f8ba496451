#!/usr/bin/env bash
# Issue 5 smoke test of the benchmark peers on one GPU (nvidia-h100-x1), through the harness:
# DeepSpeed ZeRO-3 and ZeRO-2 with CPU offload, FSDP2 with CPUOffloadPolicy, the DDP baseline and
# fitgpt, each at 1 and 2 layers of hidden 1024 (about 0.12 B parameters), the ANCHORS batch
# (8 × 1024 tokens × 4 accumulation steps), 1 warm-up + 2 timed steps. A few minutes in all,
# including DeepSpeedCPUAdam's first-use compile (about 40 s, in the first DeepSpeed trial).
# A system that fails is recorded with its reason and the others still run.
# DeepSpeed comes from the wheels in .whl/ (bash ../shared/device/make-wheels.sh builds them;
# carry ".whl"); without them the DeepSpeed systems are recorded as refused.
# Usage (device): OUT=... bash benchmarks/peers/peers_smoke.sh
set -u
OUT=${OUT:-/tmp/peers_smoke}
mkdir -p "$OUT"
export PYTHONPATH=. PYTHONUNBUFFERED=1
if compgen -G ".whl/*.whl" > /dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PYTHONPATH
fi
python3 -c "import deepspeed; print('deepspeed', deepspeed.__version__)" 2>&1 | tail -1
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
python3 -m fitgpt bench sweep \
  --systems deepspeed-z3-offload,deepspeed-z2-offload,fsdp2-offload,ddp,fitgpt \
  --sizes 1,2 --hidden 1024 --heads 16 --steps 2 --warmup 1 --time-limit 240 \
  --out "$OUT/peers_smoke.jsonl"
python3 - "$OUT/peers_smoke.jsonl" <<'EOF'
import json, sys

recs = [json.loads(line) for line in open(sys.argv[1]) if line.strip()]
print(f"\n{'system':<22}{'L':>3}{'params':>8}  {'status':<9}{'step s':>8}{'TFLOP/s':>9}"
      f"{'GPU GiB':>9}{'RAM GiB':>9}  first/last loss")
for r in recs:
    ok = r["status"] == "ok"
    loss = f"{r['loss_first']:.4f}/{r['loss_last']:.4f}" if ok else r.get("reason", "")[:90]
    print(f"{r['system']:<22}{r['layers']:>3}{r['params'] / 1e9:>7.3f}B  {r['status']:<9}"
          f"{r.get('step_s', float('nan')):>8.2f}{r.get('tflops', float('nan')):>9.1f}"
          f"{r.get('gpu_peak_gib', float('nan')):>9.2f}{r.get('host_rss_peak_gib', float('nan')):>9.2f}"
          f"  {loss}")
for r in recs:  # what a failure left behind, for the record
    if r["status"] not in ("ok", "refused"):
        print(f"\n--- {r['system']} L={r['layers']}: {r['status']}")
        print((r.get("traceback") or r.get("log_tail") or "")[-1500:])
EOF
