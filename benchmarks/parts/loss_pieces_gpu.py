"""The loss over a large vocabulary on a GPU: the plain full-logits loss against the pieces loss
(fitgpt/model/loss.py), eager and compiled; one JSON line per case: forward+backward ms (median
of --iters after a warm-up) and peak allocated GiB above the inputs, beside what the planner
prices (plan/memory.py: piece_bytes, or the plain path's 2w + 8 bytes per logit).

    PYTHONPATH=. python3 benchmarks/parts/loss_pieces_gpu.py                       # Llama 3 8B's head
    PYTHONPATH=. python3 benchmarks/parts/loss_pieces_gpu.py --vocab 50304 --hidden 1600  # GPT-2 XL's
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch
import torch.nn.functional as F

from fitgpt.model.loss import loss_pieces, piece_bytes, pieces_cross_entropy


def plain(x, w, t):
    return F.cross_entropy((x @ w.t()).float(), t, ignore_index=-1)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--tokens", type=int, default=8192)
    p.add_argument("--vocab", type=int, default=128256)
    p.add_argument("--hidden", type=int, default=4096)
    p.add_argument("--iters", type=int, default=10)
    a = p.parse_args()
    N, V, H = a.tokens, (a.vocab + 127) // 128 * 128, a.hidden
    rows = loss_pieces(N, V) or N
    g = torch.Generator("cuda").manual_seed(0)
    x = torch.randn(N, H, device="cuda", dtype=torch.bfloat16, generator=g).requires_grad_()
    w = (0.02 * torch.randn(V, H, device="cuda", generator=g)).bfloat16().requires_grad_()
    t = torch.randint(0, a.vocab, (N,), device="cuda", generator=g)
    pieces = lambda x, w, t: pieces_cross_entropy(x, w, t, rows, a.vocab)  # noqa: E731
    priced = {"plain": N * V * 12, "pieces": piece_bytes(N, V, H, 2)}
    for name, fn in (("plain", plain), ("pieces", pieces)):
        for compiled in (False, True):
            f = torch.compile(fn) if compiled else fn
            times, peak = [], 0
            for i in range(a.iters + 2):  # two warm-ups (compile, the lazy backward)
                x.grad = w.grad = None
                torch.cuda.synchronize()
                base = torch.cuda.memory_allocated()
                torch.cuda.reset_peak_memory_stats()
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(True)
                start.record()
                f(x, w, t).backward()
                end.record()
                torch.cuda.synchronize()
                if i >= 2:
                    times.append(start.elapsed_time(end))
                    peak = max(peak, torch.cuda.max_memory_allocated() - base)
            line = {"case": name, "compiled": compiled, "tokens": N, "vocab": V, "hidden": H}
            line |= {"rows": rows if name == "pieces" else N, "ms": statistics.median(times)}
            line |= {"peak_gib": peak / 2**30, "priced_gib": priced[name] / 2**30}
            line["device"] = torch.cuda.get_device_name()
            print(json.dumps(line), flush=True)


if __name__ == "__main__":
    main()
