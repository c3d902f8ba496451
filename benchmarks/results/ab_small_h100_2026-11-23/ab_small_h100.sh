#!/usr/bin/env bash
# Issue 16, a one-off A/B: GPT-2 124 M compiled (micro-batch 12 x 4), this tree against the same
# tree with benchmarks/ab_engine.patch reversed (the step's engine changes under test), on random
# tokens and on the preprocessed standard library; the loader's own time per micro-batch.
# Usage (device): OUT=... bash benchmarks/ab_small_h100.sh   (carry .whl: GPT-2's tokenizer)
set -u
OUT=${OUT:-/tmp/ab_small}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
rm -rf /tmp/base && cp -a . /tmp/base && (cd /tmp/base && patch -s -R -p1 < benchmarks/ab_engine.patch)
python3 -c "import sys; sys.path.insert(0, 'benchmarks'); from pathlib import Path; from user_path import make_data; make_data(Path('$OUT'))" > /dev/null 2>&1
DATA=$(python3 -c "import sys; sys.path.insert(0, 'benchmarks'); from user_path import DATA; print(DATA)")
ARGS="--preset gpt2-125m --micro-batch 12 --grad-accum 4 --steps 40 --log-every 1 --compile on
  --eval-every 0 --no-save --overwrite"
for tree in new base; do
  dir=$PWD; [ $tree = base ] && dir=/tmp/base
  for data in uniform "$DATA"; do
    tag=$tree-$(basename "$data")
    (cd $dir && PYTHONPATH=$dir:$PYTHONPATH timeout 100 python3 -m fitgpt train $ARGS --data "$data" --out /tmp/ab_$tag > "$OUT/$tag.log" 2>&1)
    python3 - "/tmp/ab_$tag/metrics.jsonl" "$tag" <<'PY'
import json, statistics, sys
rows = [json.loads(x) for x in open(sys.argv[1])]
rows = [r for r in rows if r.get("kind") == "train" and r["step"] > 10]
ms = [r["ms_per_step"] for r in rows]
ph = {k: statistics.median(r.get(k, 0) for r in rows) * 1000 for k in ("forward_backward_s", "update_s")}
print(f"{sys.argv[2]:<40} median {statistics.median(ms):6.1f} ms  min {min(ms):6.1f}  max {max(ms):6.1f}  fwd+bwd {ph['forward_backward_s']:6.1f}  update {ph['update_s']:5.1f}")
PY
  done
done
python3 - "$DATA" <<'PY'
import sys, time
sys.path.insert(0, ".")
from fitgpt.data.config import DataConfig, open_data
from fitgpt.data.source import BatchLoader
tr, _, _ = open_data(DataConfig(data=sys.argv[1], tokenizer="gpt2"), 1024, 50257, 0)
L = BatchLoader(tr, 12)
L.next(); t = time.perf_counter()
for _ in range(100):
    L.next()
print(f"loader: {(time.perf_counter() - t) * 10:.2f} ms per micro-batch of 12 x 1025 tokens")
PY
