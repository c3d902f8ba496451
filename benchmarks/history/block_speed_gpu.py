"""Issue 19's "no offloaded size slower than before": is one transformer block's forward and
backward slower compiled than eager at the widths that offload, and does activation
checkpointing (which the offloaded plans use) change the answer?

For each preset, one Block in bf16 on the GPU, input [micro-batch, seq, hidden], four modes:
eager or compiled (engine/transforms/compile.py's function, as `fitgpt train --compile on` compiles
a block), each without and with activation checkpointing (torch.utils.checkpoint, non-reentrant,
as engine/transforms/activation.py wraps a block). Median of 10 timed forward + backward passes
after 3 warm-up passes; one process, so the rows share a GPU state.

    python3 benchmarks/history/block_speed_gpu.py --out $OUT [--presets 2.7b,6.7b,13b]
        [--micro-batch 8]
Prints a table and writes $OUT/block_speed.jsonl.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]  # the source tree (this file: benchmarks/history/)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--presets", default="2.7b,6.7b,13b")
    ap.add_argument("--micro-batch", type=int, default=8)
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    sys.path.insert(0, str(ROOT))
    import torch
    from torch.utils.checkpoint import checkpoint

    from fitgpt.engine.transforms.compile import _block_train
    from fitgpt.model.config import get_preset
    from fitgpt.model.gpt import Block

    dev = "cuda" if torch.cuda.is_available() else "cpu"
    compiled = torch.compile(_block_train)
    rows = []
    for name in args.presets.split(","):
        cfg = get_preset(name)
        block = Block(cfg).to(device=dev, dtype=torch.bfloat16)
        x = torch.randn(args.micro_batch, cfg.seq_len, cfg.n_embd, device=dev,
                        dtype=torch.bfloat16, requires_grad=True)  # fmt: skip
        dy = torch.randn_like(x)
        for mode in ("eager", "compiled"):
            fn = _block_train if mode == "eager" else compiled
            for ck in ("off", "full"):

                def step(fn=fn, ck=ck, block=block, x=x, dy=dy):
                    if ck == "full":
                        y = checkpoint(fn, block, x, None, use_reentrant=False)
                    else:
                        y = fn(block, x, None)
                    y.backward(dy)

                for _ in range(3):
                    step()
                times = []
                for _ in range(10):
                    torch.cuda.synchronize() if dev == "cuda" else None
                    t0 = time.perf_counter()
                    step()
                    torch.cuda.synchronize() if dev == "cuda" else None
                    times.append((time.perf_counter() - t0) * 1000)
                rec = {"preset": name, "hidden": cfg.n_embd, "mode": mode, "checkpointing": ck,
                       "ms": round(statistics.median(times), 3)}  # fmt: skip
                print(json.dumps(rec), flush=True)
                rows.append(rec)
        del block, x, dy
        if dev == "cuda":
            torch.cuda.empty_cache()
    with open(args.out / "block_speed.jsonl", "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)
    print(f"{'preset':<6} {'ckpt':<5} {'eager ms':>9} {'compiled':>9} {'ratio':>6}")
    for name in args.presets.split(","):
        for ck in ("off", "full"):
            e, c = (next(r["ms"] for r in rows if (r["preset"], r["mode"], r["checkpointing"])
                         == (name, m, ck)) for m in ("eager", "compiled"))  # fmt: skip
            print(f"{name:<6} {ck:<5} {e:9.2f} {c:9.2f} {c / e:6.3f}")


if __name__ == "__main__":
    main()
