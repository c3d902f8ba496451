#!/usr/bin/env bash
# Issue 35's GPU check: the tree after the refactor against the tree before it, on one GPU, in
# one call: GPT-2 1.5 B (all on the GPU, the plan given) and an 8.07 B model whose optimizer
# state of 24 of 38 blocks is offloaded to host RAM (hidden 4096, untied head, the tiers sweep's
# shape), each trained by `fitgpt train` on the same real text (the Python standard library's
# source through `fitgpt data preprocess`, GPT-2 BPE), same seed and batches. Losses must agree
# bit for bit; step times within noise.
# Usage (device): source benchmarks/device_env.sh; BEFORE=.base OUT=$OUT bash benchmarks/checks/refactor_gpu.sh
#   (TREES="before2 after2" ONLY=1p5b: the control runs, see below)
#   BEFORE: a copy of the old tree (`git archive <commit> | tar -x -C .base`, carried).
# Writes OUT/{before,after}_{1p5b,8b}.log and .metrics.jsonl, and OUT/summary.md.
set -u
OUT=${OUT:-/tmp/refactor_gpu}
BEFORE=${BEFORE:?a copy of the old tree}
D=/tmp/refactor_data
mkdir -p "$OUT" "$D"
export PYTHONUNBUFFERED=1 PYTHONPATH=.${PYTHONPATH:+:$PYTHONPATH}  # device_env.sh's wheels after
python3 benchmarks/stdlib_jsonl.py "$D/pystd.jsonl"
python3 -m fitgpt data preprocess --input "$D/pystd.jsonl" --json-key text \
  --output-prefix "$D/pystd" --workers 8 --append-eod > "$OUT/preprocess.log" 2>&1 \
  || { tail -3 "$OUT/preprocess.log"; exit 1; }
COMMON=(--data "$D/pystd_text_document" --no-save --eval-every 0 --log-every 1 --seed 7
  --lr 1e-4 --min-lr 1e-5 --warmup 10 --plan off --engine zero --zero-stage 0
  --checkpointing full)
run() {  # tree (before|after), name, limit, flags
  local tree=$1 name=$2 limit=$3; shift 3
  local src=. && [[ $tree == before* ]] && src=$BEFORE
  echo "== $tree $name: fitgpt train ${COMMON[*]} $*" | tee "$OUT/${tree}_$name.log"
  (cd "$src" && timeout "$limit" python3 -m fitgpt \
    train "${COMMON[@]}" --out "/tmp/refactor_runs/${tree}_$name" --overwrite "$@") \
    >> "$OUT/${tree}_$name.log" 2>&1
  echo "== exit $?" | tee -a "$OUT/${tree}_$name.log"
  cp "/tmp/refactor_runs/${tree}_$name/metrics.jsonl" "$OUT/${tree}_$name.metrics.jsonl" 2>/dev/null
}
# TREES: the runs, each tree's name starting "before" (the old tree) or not (this one); a second
# run of a tree (before2, after2) is the control: how far two runs of one tree differ. ONLY: one
# model (1p5b or 8b).
for tree in ${TREES:-before after}; do
  [ "${ONLY:-1p5b}" = 1p5b ] &&
    run "$tree" 1p5b 150 --preset gpt2-1.5b --micro-batch 8 --grad-accum 4 --steps 20
  [ "${ONLY:-8b}" = 8b ] && run "$tree" 8b 200 --layers 38 --hidden 4096 --heads 32 --no-tie-embeddings --micro-batch 8 \
    --grad-accum 4 --steps 6 --offload-optimizer cpu --offload-blocks 24
done
python3 - "$OUT" <<'PY'
import json, statistics, sys
from pathlib import Path
out = Path(sys.argv[1])
rows = ["| model | tree | steps | losses equal to before | median s/step (steps 3+) | first loss | last loss |",
        "|---|---|---|---|---|---|---|"]
for name in ("1p5b", "8b"):
    recs = {}
    trees = sorted({f.name.split("_")[0] for f in out.glob(f"*_{name}.metrics.jsonl")})
    for tree in trees:
        f = out / f"{tree}_{name}.metrics.jsonl"
        tr = [json.loads(x) for x in f.read_text().splitlines()] if f.is_file() else []
        recs[tree] = [r for r in tr if r.get("kind") == "train"]
    for tree in trees:
        tr = recs[tree]
        if not tr:
            rows.append(f"| {name} | {tree} | 0 | | | | |")
            continue
        same = [r["loss"] for r in tr] == [r["loss"] for r in recs.get("before", [])]
        ms = statistics.median(r["ms_per_step"] for r in tr[2:]) / 1000 if len(tr) > 2 else float("nan")
        rows.append(f"| {name} | {tree} | {tr[-1]['step']} | {same} | {ms:.3f} | "
                    f"{tr[0]['loss']:.4f} | {tr[-1]['loss']:.4f} |")
(out / "summary.md").write_text("\n".join(rows) + "\n")
print("\n".join(rows))
PY
