"""Issue 19's 58% MFU at the 2.7b preset: how fast could its step be on this GPU? The step's
parts measured alone, back to back, with nothing else on the GPU:

  gemm       every matrix product of one step (32 blocks x 4 micro-batches of 8 x 1024 tokens,
             the tied head), as the engine calls them: F.linear's addmm forward, the input
             gradient's mm and the weight gradient's addmm_ into a bf16 buffer
             (engine/transforms/wgrad.py)
  gemm_lt    the same with torch's cuBLASLt preferred for every product
  attention  causal scaled_dot_product_attention forward + backward on q/k/v views of one
             [8, 1024, 3 x 2560] tensor (the model's layout; 32 heads of 80), 128 times
  copy       the device's memory bandwidth: a 2 GiB bf16 copy (bytes read + written / time)
  layernorm  one residual add + LayerNorm forward and backward at [8192, 2560] (both outputs
             and both gradients, as in a block): eager ATen, and compiled by Inductor

The floor adds to gemm and attention the traffic the rest of the step cannot avoid (listed in
REST_BYTES, at the measured copy bandwidth): the step time 58% MFU allows is set against it.

    python3 benchmarks/history/mfu_floor_gpu.py --out $OUT
Prints the table and writes $OUT/mfu_floor.json.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]  # the source tree (this file: benchmarks/history/)

B, T, H, L, MICRO, V = 8, 1024, 2560, 32, 4, 50304
M = B * T
HEADS, D = 32, 80
LINEARS = ((H, 3 * H), (H, H), (H, 4 * H), (4 * H, H))  # (in, out): qkv, proj, fc, fc2


def rest_bytes() -> dict:
    """Bytes per step no kernel schedule avoids, outside the products and attention (bf16
    activations, one pass each, with every possible fusion): per block and micro-batch, forward:
    the two residual adds fused with the LayerNorm after them (read 2, write 2: 4·M·H each) and
    GELU (read and write 4·M·H each); backward: GELU's (read the pre-activation and the output's
    gradient, write the input's: 12·M·H), the two LayerNorms' with their residual gradients
    (read dy, x and the residual gradient, write one: 4·M·H each), and q/k/v's three gradients
    gathered into one for the fused product (read and write 3·M·H: cuDNN returns three). The
    head's cross-entropy reads its [M, V] logits forward and backward and writes their gradient.
    The optimizer moves 28 bytes per parameter (engine/chunked/update.py's one pass)."""
    per_block = (4 + 4 + 8) + (12 + 4 + 4 + 6)  # in units of M·H bf16 elements
    blocks = per_block * M * H * 2 * L * MICRO
    head = 3 * M * V * 2 * MICRO
    params = 12 * H * H * L + 13 * H * L + (V + T) * H + 2 * H
    return {"blocks": blocks, "head": head, "optimizer": 28 * params, "params": params}


def gemm_rows(torch, F, timed) -> dict:
    dev, bf = torch.device("cuda"), torch.bfloat16
    ops = []
    for fin, fout in LINEARS:
        x = torch.randn(M, fin, device=dev, dtype=bf)
        w = torch.randn(fout, fin, device=dev, dtype=bf) * 0.02
        bias = torch.zeros(fout, device=dev, dtype=bf)
        dy = torch.randn(M, fout, device=dev, dtype=bf)
        ops.append((x, w, bias, dy, torch.zeros_like(w)))
    emb = torch.randn(V, H, device=dev, dtype=bf) * 0.02
    hx, hdy = torch.randn(M, H, device=dev, dtype=bf), torch.randn(M, V, device=dev, dtype=bf)
    gemb = torch.zeros_like(emb)

    def gemms():
        for _ in range(L * MICRO):
            for x, w, bias, dy, gw in ops:
                F.linear(x, w, bias)
                gw.addmm_(dy.t(), x)
                dy @ w
        for _ in range(MICRO):
            F.linear(hx, emb)
            gemb.add_(hdy.t() @ hx)  # the tied head's gradient: autograd's product, then its add
            hdy @ emb

    flops = 6 * M * sum(a * b for a, b in LINEARS) * L * MICRO + 6 * M * H * V * MICRO
    rows = {"gemm_ms": timed(gemms)}
    rows["gemm_tflops"] = flops / rows["gemm_ms"] / 1e9
    try:
        torch.backends.cuda.preferred_blas_library("cublaslt")
        rows["gemm_lt_ms"] = timed(gemms)
    finally:
        torch.backends.cuda.preferred_blas_library("default")
    return rows


def attention_ms(torch, F, timed) -> float:
    dev, bf = torch.device("cuda"), torch.bfloat16
    qkv = torch.randn(B, T, 3 * H, device=dev, dtype=bf, requires_grad=True)
    g = torch.randn(B, T, H, device=dev, dtype=bf)

    def attention():
        for _ in range(L * MICRO):
            q, k, v = (t.view(B, T, HEADS, D).transpose(1, 2) for t in qkv.split(H, dim=2))
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            y.transpose(1, 2).reshape(B, T, H).backward(g)

    return timed(attention)


def copy_tb_s(torch, timed) -> float:
    src = torch.empty(2**30, device="cuda", dtype=torch.bfloat16)
    dst = torch.empty_like(src)
    return 2 * src.numel() * 2 / timed(lambda: dst.copy_(src), reps=5) / 1e9


def layernorm_rows(torch, F, timed) -> dict:
    dev, bf = torch.device("cuda"), torch.bfloat16

    def add_ln(x, r, w, b):
        s = x + r
        return s, F.layer_norm(s, (H,), w, b)

    x = torch.randn(M, H, device=dev, dtype=bf, requires_grad=True)
    r = torch.randn(M, H, device=dev, dtype=bf, requires_grad=True)
    w = torch.ones(H, device=dev, dtype=bf, requires_grad=True)
    b = torch.zeros(H, device=dev, dtype=bf, requires_grad=True)
    ds, dy = torch.randn(M, H, device=dev, dtype=bf), torch.randn(M, H, device=dev, dtype=bf)
    rows = {}
    for name, fn in (("eager", add_ln), ("compiled", torch.compile(add_ln))):

        def ln_pass(fn=fn):
            for _ in range(20):
                s, y = fn(x, r, w, b)
                torch.autograd.backward([s, y], [ds, dy])

        rows[f"layernorm_{name}_ms"] = timed(ln_pass) / 20
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    sys.path.insert(0, str(ROOT))
    import torch
    import torch.nn.functional as F

    torch.manual_seed(0)

    def timed(fn, reps: int = 3) -> float:
        """Best of `reps` timings of fn() in ms (after one warm-up call)."""
        fn()
        best = float("inf")
        for _ in range(reps):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            torch.cuda.synchronize()
            best = min(best, a.elapsed_time(b))
        return best

    rows = {}
    rows.update(gemm_rows(torch, F, timed))
    rows["attention_ms"] = attention_ms(torch, F, timed)
    rows["copy_tb_s"] = copy_tb_s(torch, timed)
    rows.update(layernorm_rows(torch, F, timed))
    # the add + LayerNorm pair at its floor: forward 4·M·H, backward 4·M·H (read dy, ds, s; write
    # dx)
    rows["layernorm_floor_ms"] = 8 * M * H * 2 / (rows["copy_tb_s"] * 1e9)

    rest = rest_bytes()
    rows["rest_floor_ms"] = (rest["blocks"] + rest["head"] + rest["optimizer"]) / (
        rows["copy_tb_s"] * 1e9
    )
    model_flops = (6 * rest["params"] + 12 * L * H * T) * M * MICRO
    rows["floor_ms"] = rows["gemm_ms"] + rows["attention_ms"] + rows["rest_floor_ms"]
    rows["floor_mfu"] = model_flops / (rows["floor_ms"] / 1e3) / 989e12
    rows["ms_at_58pct"] = model_flops / (0.58 * 989e12) * 1e3
    rows["device"] = torch.cuda.get_device_name()
    rows["torch"] = torch.__version__
    for k, v in rows.items():
        print(f"{k:<22} {v:.2f}" if isinstance(v, float) else f"{k:<22} {v}")
    (args.out / "mfu_floor.json").write_text(json.dumps(rows, indent=1) + "\n")


if __name__ == "__main__":
    main()
