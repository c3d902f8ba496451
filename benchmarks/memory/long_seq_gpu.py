"""Long sequences on one GPU: Llama 3.1 8B's shape at 32 k, 64 k and 128 k tokens a sequence.

For each length, micro-batch 1, bf16 weights and activations, activation checkpointing `full`
or `cpu` (engine/transforms/activation.py) or `off`, with the MLP in pieces (model/pieces.py, the
default past MLP_PIECE_ELEMS) and whole (the threshold raised): one forward+backward of one block,
and of the whole model (32 blocks, the loss over 128,256 tokens in pieces of rows) where it
fits. Per case the peak GPU memory above the weights and gradients, the time per block
(median of --iters after a warm-up) and what the model's family prices for the MLP piece
(Family.mlp_piece_elems). An out-of-memory case prints "oom": true and the run goes on.
Also Mistral's sliding window (--window W): the FlexAttention path (Packing.window, what a CUDA
run takes) against the SDPA mask path at 8 k tokens, outputs and gradients, then flex timed at
each length (the mask alone would be T² bytes). One JSON line per case; exit 1 if a comparison
fails.

    PYTHONPATH=. python3 benchmarks/memory/long_seq_gpu.py                          # full, 1 block + all
    PYTHONPATH=. python3 benchmarks/memory/long_seq_gpu.py --checkpointing cpu
    PYTHONPATH=. python3 benchmarks/memory/long_seq_gpu.py --seqs 131072 --scope block --window 4096
    PYTHONPATH=. python3 benchmarks/memory/long_seq_gpu.py --device cpu --tiny      # a smoke run here

Expected (priced, not measured yet): whole, one block's MLP holds ~6·T·F·2 bytes in its
backward (21 GiB at 128 k); in pieces ~3 GiB, for one more MLP forward per block.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch
from torch import nn

import fitgpt.model.pieces as pieces
from fitgpt.engine.transforms.activation import checkpoint_blocks
from fitgpt.model import PRESETS, ModelConfig, build_model
from fitgpt.model.families import family_of
from fitgpt.model.families.llama.model import rope_tables

GiB = 2**30


def sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def measure(fn, dev: torch.device, iters: int) -> tuple[float, int]:
    """(median seconds of fn(), peak bytes above what was allocated before), one warm-up."""
    times = []
    base = torch.cuda.memory_allocated(dev) if dev.type == "cuda" else 0
    for i in range(iters + 1):
        if dev.type == "cuda":
            torch.cuda.reset_peak_memory_stats(dev)
        sync(dev)
        t0 = time.perf_counter()
        fn()
        sync(dev)
        if i:
            times.append(time.perf_counter() - t0)
    peak = torch.cuda.max_memory_allocated(dev) - base if dev.type == "cuda" else 0
    return statistics.median(times), peak


class Stack(nn.Module):
    """One block as a model with `blocks`, so checkpoint_blocks wraps it as the engines do."""

    def __init__(self, block: nn.Module) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([block])


def built(cfg: ModelConfig, dev) -> nn.Module:
    """The network made on `dev` in bf16 directly (8 B parameters: no fp32 copy on the host)."""
    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device(dev):
            return build_model(cfg)
    finally:
        torch.set_default_dtype(old)


def block_case(cfg: ModelConfig, dev, ckpt: str, iters: int) -> dict:
    block = built(cfg.replace(n_layer=1), dev).blocks[0]
    if ckpt != "off":
        checkpoint_blocks(Stack(block), to_host=ckpt == "cpu")
    T = cfg.seq_len
    rope = rope_tables(cfg, T, 0, dev)
    x = torch.randn(1, T, cfg.n_embd, device=dev, dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn_like(x)

    def step():
        block(x, None, 0, rope).backward(dy)
        x.grad = None
        for p in block.parameters():
            p.grad = None

    s, peak = measure(step, dev, iters)
    return {"block_s": s, "peak_gib": peak / GiB}


def model_case(cfg: ModelConfig, dev, ckpt: str, iters: int) -> dict:
    model = built(cfg, dev)
    if ckpt != "off":
        checkpoint_blocks(model, to_host=ckpt == "cpu")
    g = torch.Generator().manual_seed(0)
    idx = torch.randint(0, cfg.vocab_size, (1, cfg.seq_len + 1), generator=g).to(dev)

    def step():
        model(idx[:, :-1], idx[:, 1:]).backward()  # the gradients stay: weights-sized, counted

    step()  # the gradients exist from here on: the peak below is above weights + gradients
    s, peak = measure(step, dev, iters)
    return {"step_s": s, "block_s": s / cfg.n_layer, "peak_gib": peak / GiB}


def window_cases(cfg: ModelConfig, dev, seqs: list[int], iters: int, window: int) -> bool:
    """Mistral's window: flex (Packing.window) against the attention's mask path at 8 k tokens,
    then flex timed at each length. True if the comparison holds."""
    from fitgpt.model.packing import Packing

    mcfg = cfg.replace(family="mistral", sliding_window=window, n_layer=1, seq_len=max(seqs))
    attn = built(mcfg.replace(n_layer=1), dev).blocks[0].attn
    ok = True
    for T in [8192, *seqs]:
        x = torch.randn(1, T, cfg.n_embd, device=dev, dtype=torch.bfloat16, requires_grad=True)
        packing = Packing.window(T, mcfg, dev, 0.0, True)
        rope = rope_tables(mcfg, T, 0, dev, packing.positions_BT)
        aux = (rope, packing)

        def flex(x=x, aux=aux):
            attn(x, None, 0, aux).float().square().mean().backward()

        if T == 8192:  # the mask path's T² bytes are 64 MiB here
            y = attn(x, None, 0, aux)
            (gf,) = torch.autograd.grad(y.float().square().mean(), x)
            y2 = attn(x, None, 0, rope_tables(mcfg, T, 0, dev))
            (gm,) = torch.autograd.grad(y2.float().square().mean(), x)
            err = ((y - y2).float().abs().max().item(), (gf - gm).float().abs().max().item())
            good = err[0] < 2e-2 and err[1] < 2e-2 * gm.float().abs().max().item() + 1e-6
            ok &= good
            print(json.dumps({"case": "window_vs_mask", "T": T, "window": window,
                              "max_err_out": err[0], "max_err_grad": err[1], "ok": good}))  # fmt: skip
            continue
        try:
            s, peak = measure(flex, dev, iters)
            row = {"block_attn_s": s, "peak_gib": peak / GiB}
        except torch.cuda.OutOfMemoryError:
            row = {"oom": True}
        print(json.dumps({"case": "window_flex", "T": T, "window": window, **row}))
    return ok


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seqs", default="32768,65536,131072")
    ap.add_argument("--checkpointing", choices=("full", "cpu", "off"), default="full")
    ap.add_argument("--scope", choices=("block", "model", "both"), default="both")
    ap.add_argument("--pieces", choices=("on", "off", "both"), default="both")
    ap.add_argument("--iters", type=int, default=3)
    ap.add_argument("--window", type=int, default=0, help="Mistral's window: check flex too")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--tiny", action="store_true", help="a 2-layer 64-wide model (smoke run)")
    args = ap.parse_args()
    dev = torch.device(args.device)
    seqs = [int(s) for s in args.seqs.split(",")]
    base = PRESETS["llama3.1-8b"]
    if args.tiny:
        base = base.replace(n_layer=2, n_embd=64, n_head=4, n_kv_head=2, ffn_hidden=256)
        base = base.replace(vocab_size=1000)
        seqs = [min(s, 4096) for s in seqs]
    default_elems = pieces.MLP_PIECE_ELEMS
    for T in seqs:
        cfg = base.replace(seq_len=T, max_positions=max(T, base.max_positions or 0))
        fam = family_of(cfg)
        for mode in ("on", "off") if args.pieces == "both" else (args.pieces,):
            pieces.MLP_PIECE_ELEMS = default_elems if mode == "on" else 10**18
            if args.tiny and mode == "on":
                pieces.MLP_PIECE_ELEMS = 512 * cfg.ffn_width  # pieces of 512 tokens
            priced = fam.mlp_piece_elems(cfg, 1, T) * 2 / GiB
            for scope in ("block", "model") if args.scope == "both" else (args.scope,):
                row = {"case": scope, "T": T, "checkpointing": args.checkpointing,
                       "mlp_pieces": mode, "priced_piece_gib": priced,
                       "device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu"}  # fmt: skip
                try:
                    run = block_case if scope == "block" else model_case
                    row |= run(cfg, dev, args.checkpointing, args.iters)
                except torch.cuda.OutOfMemoryError:
                    row["oom"] = True
                if dev.type == "cuda":
                    torch.cuda.empty_cache()
                print(json.dumps(row), flush=True)
    pieces.MLP_PIECE_ELEMS = default_elems
    ok = True
    if args.window >= 8192:
        print(f"--window {args.window}: the comparison runs at 8,192 tokens; give less")
        return 1
    if args.window and dev.type == "cuda":  # FlexAttention's backward runs on CUDA only
        ok = window_cases(base, dev, seqs, args.iters, args.window)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
