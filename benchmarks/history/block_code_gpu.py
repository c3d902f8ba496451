"""Issue 19: what Inductor makes of one compiled transformer block on the GPU, forward and
backward, at a preset's shapes (default the 2.7b preset at micro-batch 8): the generated code,
and a list of the kernels the compiled graphs call outside Triton (cuBLAS, cuDNN, ATen ops such
as the `aten::sum` calls the 2.7b profile shows inside the compiled backward).

The block is compiled the way `fitgpt train --compile on` compiles it (engine/transforms/compile.py:
the class's forward through one function taking the block as an argument), in bf16.

    python3 benchmarks/history/block_code_gpu.py --out $OUT [--preset 2.7b] [--micro-batch 8]
Writes $OUT/block_code.txt (Inductor's output code for the forward and backward graphs) and
prints every line that calls a kernel outside Triton, with the source nodes it computes.
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]  # the source tree (this file: benchmarks/history/)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--preset", default="2.7b")
    ap.add_argument("--micro-batch", type=int, default=8)
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    sys.path.insert(0, str(ROOT))
    import torch

    from fitgpt.engine.transforms.compile import _block_train
    from fitgpt.model.config import get_preset
    from fitgpt.model.gpt import Block

    code = args.out / "block_code.txt"
    handler = logging.FileHandler(code, mode="w")
    torch._logging.set_logs(output_code=True)
    logging.getLogger("torch._inductor").addHandler(handler)

    cfg = get_preset(args.preset)
    block = Block(cfg).to(device="cuda", dtype=torch.bfloat16)
    x = torch.randn(args.micro_batch, cfg.seq_len, cfg.n_embd, device="cuda",
                    dtype=torch.bfloat16, requires_grad=True)  # fmt: skip
    fn = torch.compile(_block_train)
    fn(block, x, None).float().square().mean().backward()
    torch.cuda.synchronize()
    handler.flush()
    lines = code.read_text().splitlines()
    print(f"{code}: {len(lines)} lines")
    for i, line in enumerate(lines):
        if "extern_kernels." in line or "torch.ops.aten." in line or "aten." in line.split("#")[0]:
            src = next(
                (lines[j] for j in range(i - 1, max(0, i - 4), -1) if "Source Nodes" in lines[j]),
                "",
            )
            print(src.split("Source Nodes:")[-1].strip()[:160])
            print("   ", line.strip()[:200])


if __name__ == "__main__":
    main()
