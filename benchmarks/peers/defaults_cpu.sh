#!/usr/bin/env bash
# Old against new training defaults on CPU (issue 38's CPU half; results/defaults_cpu_2026-11-26,
# made when this script sat there as run.sh). Usage, from the repository root:
#   python3 benchmarks/run.py defaults/cpu-A --out DIR    (or: OUT=DIR bash benchmarks/peers/defaults_cpu.sh A|B|C)
# A: 4 layers x 1024, 60 steps; B: 2 layers x 4096 (the 6.7b preset's width), 8 steps of a
# 50-step warm-up, old init against init by width; C: the same shape, every new default.
# "old" reproduces the defaults before this change with flags: --warmup 50 and GPT-2's
# --init-std 0.02 (the peak rate by width is unchanged).
# --plan off --engine ddp: the engine does not change the losses, and the runs skip the planner.
set -u
OUT=${OUT:-/tmp/defaults_cpu}
FITGPT=${FITGPT:-.venv/bin/fitgpt}
COMMON=(--plan off --engine ddp --device cpu --data stdlib --cpu-threads 1 --eval-every 0 --no-save --log-every 1 --overwrite)
case "${1:-A}" in
A)
  SHAPE=(--layers 4 --hidden 1024 --heads 8 --seq-len 128 --micro-batch 4 --steps 60)
  $FITGPT train "${SHAPE[@]}" "${COMMON[@]}" --out /tmp/defaults_runs/A_old --warmup 50 --init-std 0.02 > "$OUT/A_old.log" 2>&1
  $FITGPT train "${SHAPE[@]}" "${COMMON[@]}" --out /tmp/defaults_runs/A_new > "$OUT/A_new.log" 2>&1
  ;;
B)
  # the shape and flags of results/lr_width_cpu_2026-11-24 (its by-width.log is the old init's 8 steps;
  # B_old re-runs its first 2 steps to show that the same weights and batches come back)
  SHAPE=(--layers 2 --hidden 4096 --heads 32 --seq-len 128 --micro-batch 2 --grad-accum 1)
  $FITGPT train "${SHAPE[@]}" "${COMMON[@]}" --steps 2 --warmup 50 --init-std 0.02 --out /tmp/defaults_runs/B_old > "$OUT/B_old.log" 2>&1
  $FITGPT train "${SHAPE[@]}" "${COMMON[@]}" --steps 8 --warmup 50 --out /tmp/defaults_runs/B_new > "$OUT/B_new.log" 2>&1
  ;;
C)
  # every default the new way on the same shape (an 8-step run: Adam's 40-step warm-up floor).
  # C_whole_run.log is a first draft of the rule, run the same way, that warmed a run shorter than
  # 40 steps up over its own length (8 steps here): its step-1 rate, 1.5e-5, doubled the loss.
  SHAPE=(--layers 2 --hidden 4096 --heads 32 --seq-len 128 --micro-batch 2 --grad-accum 1)
  $FITGPT train "${SHAPE[@]}" "${COMMON[@]}" --steps 8 --out /tmp/defaults_runs/C_new > "$OUT/C_new.log" 2>&1
  ;;
esac
