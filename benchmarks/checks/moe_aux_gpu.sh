#!/usr/bin/env bash
# The mixture's load-balancing term since it is added apart from the cross-entropy (engine/base.py
# step_share: each micro-batch's coef·aux at weight 1, the forward leaving it in
# MoeLlama.aux_term) on a GPU, where it runs inside compiled code: a 2-layer Qwen3-MoE shape
# (the qwen3-moe-30b-a3b preset cut to width 1024: its experts, router and coefficient), synthetic
# rows, micro-batch 2 x 2 accumulation, 8 steps, the same seed, each engine eager and compiled
# (--compile blocks: the regions; model: the whole forward as one graph, zero engine, one rank),
# and with --checkpointing full. Every run's losses (cross-entropy + coef·mean aux) and aux
# against the eager zero run's: compiled bf16 kernels round differently, so agreement is to
# ~1e-2, not bits; a run whose term went missing differs by coef·aux (~0.008 here) from step 1
# and its logged aux is unchanged, so the check is on the loss after step 1's.
# TORCH_LOGS=recompiles: each log says why a compiled region was compiled again, if it was.
# Usage (device): source benchmarks/device_env.sh; OUT=$OUT bash benchmarks/checks/moe_aux_gpu.sh
set -u
OUT=${OUT:-/tmp/moe_aux}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH=.${PYTHONPATH:+:$PYTHONPATH}
SHAPE=(--preset qwen3-moe-30b-a3b --layers 2 --hidden 1024 --heads 16 --kv-heads 4 --seq-len 1024
  --micro-batch 2 --grad-accum 2 --steps 8 --seed 3 --data synthetic --log-every 1 --eval-every 0
  --no-save --overwrite --plan off)
DEV=(); [ -z "$(command -v nvidia-smi)" ] && DEV=(--device cpu --steps 3 --seq-len 128)
for run in "zero off off" "zero blocks off" "zero model off" "ddp off off" "ddp blocks off" \
  "zero blocks full"; do
  read -r eng comp ck <<< "$run"
  name="${eng}_${comp}_${ck}"
  s=$(date +%s)
  TORCH_LOGS=recompiles python3 -m fitgpt train "${SHAPE[@]}" --engine "$eng" --compile "$comp" --checkpointing "$ck" \
    ${DEV[@]+"${DEV[@]}"} --out "/tmp/moe_aux_work/$name" > "$OUT/$name.log" 2>&1
  echo "$name: exit $? in $(($(date +%s) - s)) s"
  cp "/tmp/moe_aux_work/$name/metrics.jsonl" "$OUT/$name.metrics.jsonl" 2>/dev/null
  grep -E "rror|Traceback" "$OUT/$name.log" | head -3
done
python3 - "$OUT" <<'PY'
import json, pathlib, sys
out = pathlib.Path(sys.argv[1])
def rows(p):
    return [r for r in map(json.loads, p.read_text().splitlines()) if r.get("kind", "train") == "train" and "loss" in r]
ref = rows(out / "zero_off_off.metrics.jsonl")
lines = ["| run | loss step 1 | loss last | largest loss difference from zero/off/off | aux step 1 |", "|---|---|---|---|---|"]
worst = 0.0
for p in sorted(out.glob("*.metrics.jsonl")):
    r = rows(p)
    d = max(abs(a["loss"] - b["loss"]) for a, b in zip(r, ref)) if r else float("nan")
    worst = max(worst, d) if p.stem != "zero_off_off.metrics" else worst
    aux = next((v for k, v in r[0].items() if "aux" in k), "?") if r else "?"
    lines.append(f"| {p.stem.removesuffix('.metrics')} | {r[0]['loss']:.4f} | {r[-1]['loss']:.4f} | {d:.4f} | {aux} |")
lines.append(f"\nlargest difference {worst:.4f} (compiled bf16 rounding ~1e-2; a missing aux term would show as coef x aux)")
(out / "summary.md").write_text("\n".join(lines) + "\n")
print("\n".join(lines))
PY
