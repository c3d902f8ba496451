"""Packed samples' attention on a GPU (fitgpt/model/packing.py): the fast path (FlexAttention
with a document mask, what a CUDA run uses) against the reference (SDPA with the boolean
block-diagonal causal mask, what a CPU run uses): outputs and gradients compared, then
forward+backward timed, also beside plain causal attention over the whole row (no packing: the
cost every unpacked run pays). One JSON line per case; exit 1 if a comparison fails.

    PYTHONPATH=. python3 benchmarks/parts/packed_attention_gpu.py                 # seq 4096, Llama 8B heads
    PYTHONPATH=. python3 benchmarks/parts/packed_attention_gpu.py --window 1024   # Mistral's window too
    PYTHONPATH=. python3 benchmarks/parts/packed_attention_gpu.py --model         # + a tiny Llama's step

Cases: rows of samples of 50-2,000 tokens (as chat data packs them) and rows of one sample
(the mask is then plain causal). bf16; tolerances are bf16's (the two kernels sum in different
orders). --model also runs a 2-layer Llama's loss and gradients with segments on CUDA (flex) and
on the CPU (the mask path) with the same weights, and compares them.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
from functools import partial

import torch
import torch.nn.functional as F

from fitgpt.model.packing import Packing, block_mask, keep_mask, segment_positions


def segments(B: int, T: int, seed: int, one: bool) -> torch.Tensor:
    rng = random.Random(seed)
    seg = torch.zeros(B, T, dtype=torch.int64)
    if one:
        return seg.cuda()
    for b in range(B):
        pos, s = 0, 0
        while pos < T:
            n = min(rng.randint(50, 2000), T - pos)
            seg[b, pos : pos + n] = s
            pos, s = pos + n, s + 1
    return seg.cuda()


def timed(fn, iters: int) -> float:
    times = []
    for i in range(iters + 3):  # warm-ups: compile, the lazy backward
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        if i >= 3:
            times.append(start.elapsed_time(end))
    return statistics.median(times)


def fwd_bwd(attend, q, k, v, dy) -> None:
    qq, kk, vv = (t.clone().requires_grad_() for t in (q, k, v))
    attend(qq, kk, vv).backward(dy)


def compare(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).abs().max() / b.float().abs().max().clamp(min=1e-6)).item()


def timings(a, seg, fast: Packing, ref: Packing, qkvd) -> dict:
    """Forward+backward ms of flex, the mask and plain causal SDPA, and of making the block mask."""
    gqa = {"enable_gqa": True} if qkvd[1].shape[1] != qkvd[0].shape[1] else {}
    causal = partial(F.scaled_dot_product_attention, is_causal=True, **gqa)
    return {
        "ms_flex": timed(partial(fwd_bwd, partial(fast.attend, dropout=0.0), *qkvd), a.iters),
        "ms_mask": timed(partial(fwd_bwd, partial(ref.attend, dropout=0.0), *qkvd), a.iters),
        "ms_plain_causal": timed(partial(fwd_bwd, causal, *qkvd), a.iters),
        "block_mask_ms": timed(partial(block_mask, seg, a.window), a.iters),
    }


def attention_cases(a) -> bool:
    ok = True
    B, T, N, K, D = a.batch, a.seq, a.heads, a.kv_heads, a.head_dim
    g = torch.Generator("cuda").manual_seed(0)
    for one in (False, True):
        seg = segments(B, T, 1, one)
        q = torch.randn(B, N, T, D, device="cuda", dtype=torch.bfloat16, generator=g)
        k = torch.randn(B, K, T, D, device="cuda", dtype=torch.bfloat16, generator=g)
        v = torch.randn(B, K, T, D, device="cuda", dtype=torch.bfloat16, generator=g)
        dy = torch.randn(B, N, T, D, device="cuda", dtype=torch.bfloat16, generator=g)
        pos = segment_positions(seg)
        fast = Packing(seg, pos, flex=block_mask(seg, a.window))
        ref = Packing(seg, pos, mask=keep_mask(seg, a.window))
        assert fast.flex is not None and ref.mask is not None
        grads = {}
        for name, p in (("flex", fast), ("mask", ref)):
            qq, kk, vv = (t.clone().requires_grad_() for t in (q, k, v))
            y = p.attend(qq, kk, vv, 0.0)
            y.backward(dy)
            grads[name] = (y, qq.grad, kk.grad, vv.grad)
        errs = [compare(x, r) for x, r in zip(grads["flex"], grads["mask"])]
        ok &= max(errs) < a.tol
        line = {
            "case": "one sample per row" if one else "packed 50-2000",
            "samples": int(seg.max(dim=1).values.sum() + B),
            "B": B, "T": T, "N": N, "K": K, "D": D, "window": a.window,
            "max_rel_err_y_dq_dk_dv": errs, "ok": max(errs) < a.tol,
            **timings(a, seg, fast, ref, (q, k, v, dy)), "mask_bytes": B * T * T,
        }  # fmt: skip
        print(json.dumps(line), flush=True)
    return ok


def model_case(a) -> bool:
    """A 2-layer Llama's loss and gradients with segments, fp32: on CUDA (flex) against the same
    weights on the CPU (the mask path); seq at most 2048 to keep the CPU's part short."""
    import copy

    from fitgpt.model import ModelConfig, build_model

    T = min(a.seq, 2048)
    cfg = ModelConfig(n_layer=2, n_embd=256, n_head=8, n_kv_head=2, seq_len=T, family="llama",
                      vocab_size=4096, bias=False, position="rope", tie_embeddings=False,
                      ffn_hidden=512)  # fmt: skip
    torch.manual_seed(0)
    cpu = build_model(cfg)
    cpu.reset_parameters(seed=1)
    gpu = copy.deepcopy(cpu).cuda()
    seg = segments(2, T, 3, False).cpu()
    x, y = torch.randint(0, 4096, (2, T)), torch.randint(0, 4096, (2, T))
    out = {}
    for name, m, dev in (("flex", gpu, "cuda"), ("mask", cpu, "cpu")):
        loss = m(x.to(dev), y.to(dev), segments_BT=seg.to(dev))
        loss.backward()
        out[name] = (loss.item(), [p.grad.cpu() for p in m.parameters()])
    lerr = abs(out["flex"][0] - out["mask"][0])
    gerr = max(compare(g, r) for g, r in zip(out["flex"][1], out["mask"][1]))
    ok = lerr < 1e-3 and gerr < 1e-2  # TF32 matmuls may be on: not bit-equal
    print(json.dumps({"case": "llama 2 layers fp32, flex (cuda) vs mask (cpu)", "T": T,
                      "loss_abs_err": lerr, "grad_max_rel_err": gerr, "ok": ok}), flush=True)  # fmt: skip
    return ok


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--seq", type=int, default=4096)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--window", type=int, default=None)
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--tol", type=float, default=2e-2)
    p.add_argument("--model", action="store_true")
    a = p.parse_args()
    print(json.dumps({"torch": torch.__version__, "gpu": torch.cuda.get_device_name()}))
    ok = attention_cases(a)
    if a.model:
        ok &= model_case(a)
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
