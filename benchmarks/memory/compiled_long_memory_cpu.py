"""Peak host memory of one checkpointed block (and of head+loss) at long T: eager vs compiled.

Why: on an H100 a Llama-3.1-8B run at 247,808 tokens, planned "compiled, checkpointing cpu",
ran out of GPU memory in the forward, where eager runs at 131 k peaked well under the plan.
This measures, on the CPU with real torch.compile (Inductor, C++), what compiling a block adds
to a training step's peak at a long sequence, with the MLP whole and in pieces
(model/pieces.py), and the same for the head + loss (whole logits and by rows, model/loss.py).

Every variant runs in a fresh subprocess (no allocator or compile state shared). The block is
fitgpt's own: a 1-layer Llama built by build_model, compiled by engine/transforms/compile.py's
compile_regions (the function fitgpt compiles, _block_train / _head_loss) and then wrapped by
engine/transforms/activation.py's checkpoint_blocks (non-reentrant checkpoint around the compiled
forward), exactly the order the engines apply them. A warm-up step (forward + backward, which
compiles both graphs) runs first; then the resident-set high-water mark (VmHWM) is reset
(/proc/self/clear_refs "5") and the measured step's forward and backward peaks are read from it,
minus the resident set before the step. glibc is told to mmap every allocation over 64 KiB
(MALLOC_MMAP_THRESHOLD_) so a freed tensor leaves the resident set at once.

Reference rows: "nockpt" runs the block without the checkpoint; what it still holds after its
forward ("kept") is the block's whole saved-activation set, eager's or the compiled graph's
(the latter is what hypothesis A predicts the checkpointed compiled forward materialises at
once, before the checkpoint's saved-tensor hooks drop it).

Measured (2 CPU cores, torch 2.13 CPU, T = 32,768, H 256, N 4, K 2, D 64, F 1024, V 8192, bf16;
MiB, forward peak / backward peak, minus the resident set before the step):
  block, MLP whole    eager+ckpt 288 / 649   compiled+ckpt 321 / 465   (compiled saved set 321)
  block, MLP 8 pieces eager+ckpt 112 / 378   compiled+ckpt 149 / 210   (compiled saved set 113)
  head+loss by rows   forward peak, eager / compiled: 8 pieces 354 / 418, 32 pieces ~116 / 131,
                      64 pieces 132 / 496 (493 rerun), 128 pieces 116 / 548
                      (the whole [T, V] logits in bf16 are 512 MiB)
So a checkpointed compiled block's forward does hold its graph's whole saved set at once, but
that set is smaller than eager's and stays under the block's own backward peak; the compiled
loss by rows instead, past some tens of pieces, holds about every piece's logits at once (the
whole [T, V]): Llama-3.1-8B at 247,808 tokens runs 237 pieces, 63.6 GB of bf16 logits.

Run (2 CPU cores, ~24 GB RAM suffice; about 5-10 minutes, mostly compiling):
    PYTHONPATH=. .venv/bin/python benchmarks/memory/compiled_long_memory_cpu.py
    options: --T 32768 --n-embd 256 --ffn 1024 --heads 4 --kv 2 --vocab 8192 --pieces 8
             --dtype float32|bfloat16  --only block|head  --json out.json
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import subprocess
import sys
import time

MiB = 2**20


def _status(key: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    raise KeyError(key)


def _reset_hwm() -> None:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def child(a) -> dict:
    import torch

    torch.set_num_threads(2)
    import fitgpt.model.loss as loss_mod
    import fitgpt.model.pieces as pieces_mod
    from fitgpt.engine.transforms.activation import checkpoint_blocks
    from fitgpt.engine.transforms.compile import compile_regions
    from fitgpt.model import ModelConfig, build_model

    cfg = ModelConfig(
        family="llama",
        position="rope",
        bias=False,
        tie_embeddings=False,
        n_layer=1,
        n_embd=a.n_embd,
        n_head=a.heads,
        n_kv_head=a.kv,
        ffn_hidden=a.ffn,
        seq_len=a.T,
        vocab_size=a.vocab,
    )
    T, H, F = a.T, cfg.n_embd, cfg.ffn_width
    # MLP: whole, or `pieces` pieces of T/pieces tokens (batch 1)
    pieces_mod.MLP_PIECE_ELEMS = 10**15 if a.mlp == "whole" else (T // a.pieces) * F
    # loss: whole logits, or by rows (PIECE_LOGITS: rows of T/pieces)
    loss_mod.PIECE_LOGITS = 10**15 if a.loss == "whole" else (T // a.pieces) * cfg.padded_vocab_size
    torch.manual_seed(0)
    model = build_model(cfg)
    model.reset_parameters(0)
    model.train()
    dtype = getattr(torch, a.dtype)
    model.to(dtype)  # the zero engine's working weights: bf16 on a GPU
    if a.mode == "compiled":
        compile_regions(model)
    if a.ckpt:
        checkpoint_blocks(model)
    block = model.blocks[0]
    aux = model.block_aux(T, 0, torch.device("cpu"))
    g = torch.Generator().manual_seed(1)
    targets = torch.randint(0, cfg.vocab_size, (1, T), generator=g)

    def fwd(x):
        if a.region == "block":
            return block(x, None, 0, aux)
        return model.head_loss(x, targets)

    def step(record: bool) -> dict:
        x = torch.randn(1, T, H, generator=torch.Generator().manual_seed(2))
        x = x.to(dtype).requires_grad_()
        gc.collect()
        base = _status("VmRSS")
        _reset_hwm()
        t0 = time.perf_counter()
        y = fwd(x)
        t1 = time.perf_counter()
        fwd_peak = _status("VmHWM") - base
        kept = _status("VmRSS") - base
        _reset_hwm()
        y.float().sum().backward() if y.dim() else y.backward()
        t2 = time.perf_counter()
        bwd_peak = _status("VmHWM") - base
        del y, x
        model.zero_grad(set_to_none=True)
        return dict(
            fwd_peak=fwd_peak, kept_after_fwd=kept, bwd_peak=bwd_peak, fwd_s=t1 - t0, bwd_s=t2 - t1
        )

    t0 = time.perf_counter()
    step(False)  # warm-up: compiles forward and backward
    warm_s = time.perf_counter() - t0
    r = step(True)
    r.update(warm_s=warm_s, T=T, H=H, F=F, V=cfg.padded_vocab_size)
    return r


VARIANTS = {
    "block": [
        ("eager", "whole", 0),
        ("eager", "whole", 1),
        ("compiled", "whole", 0),
        ("compiled", "whole", 1),
        ("eager", "pieces", 0),
        ("eager", "pieces", 1),
        ("compiled", "pieces", 0),
        ("compiled", "pieces", 1),
    ],
    "head": [
        ("eager", "whole", 0),
        ("compiled", "whole", 0),
        ("eager", "pieces", 0),
        ("compiled", "pieces", 0),
    ],
}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--T", type=int, default=32768)
    p.add_argument("--n-embd", type=int, default=256)
    p.add_argument("--ffn", type=int, default=1024)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--kv", type=int, default=2)
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--pieces", type=int, default=8)
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    p.add_argument("--only", choices=("block", "head"))
    p.add_argument("--json")
    p.add_argument("--variants", help="comma list of mode:split:ckpt, e.g. compiled:pieces:1")
    # child-only
    p.add_argument("--child", action="store_true")
    p.add_argument("--region", default="block")
    p.add_argument("--mode", default="eager")
    p.add_argument("--mlp", default="whole")
    p.add_argument("--loss", default="whole")
    p.add_argument("--ckpt", type=int, default=1)
    a = p.parse_args()
    if a.child:
        print("RESULT " + json.dumps(child(a)), flush=True)
        return
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536", "OMP_NUM_THREADS": "2"}
    common = [
        "--T",
        str(a.T),
        "--n-embd",
        str(a.n_embd),
        "--ffn",
        str(a.ffn),
        "--heads",
        str(a.heads),
        "--kv",
        str(a.kv),
        "--vocab",
        str(a.vocab),
        "--pieces",
        str(a.pieces),
        "--dtype",
        a.dtype,
    ]
    rows = []
    for region in ("block", "head"):
        if a.only and a.only != region:
            continue
        for mode, split, ckpt in VARIANTS[region]:
            if a.variants and f"{mode}:{split}:{ckpt}" not in a.variants.split(","):
                continue
            cmd = [
                sys.executable,
                __file__,
                "--child",
                "--region",
                region,
                "--mode",
                mode,
                "--ckpt",
                str(ckpt),
                *common,
                "--mlp" if region == "block" else "--loss",
                split,
            ]
            out = subprocess.run(cmd, env=env, capture_output=True, text=True)
            line = [s for s in out.stdout.splitlines() if s.startswith("RESULT ")]
            if out.returncode or not line:
                print(f"{region} {mode} {split} ckpt={ckpt}: FAILED\n{out.stderr[-3000:]}")
                continue
            r = json.loads(line[0][7:])
            r.update(region=region, mode=mode, split=split, ckpt=ckpt)
            rows.append(r)
            print(
                f"{region:5} {mode:8} {split:6} {'ckpt' if ckpt else 'nockpt':6} "
                f"fwd peak {r['fwd_peak'] / MiB:8.0f} MiB  kept {r['kept_after_fwd'] / MiB:7.0f}"
                f"  bwd peak {r['bwd_peak'] / MiB:8.0f} MiB  (fwd {r['fwd_s']:.1f} s, "
                f"bwd {r['bwd_s']:.1f} s, warm-up {r['warm_s']:.0f} s)",
                flush=True,
            )
    if rows:
        r0 = rows[0]
        T, H, F = r0["T"], r0["H"], r0["F"]
        w = 4 if a.dtype == "float32" else 2
        print(
            f"\nunits at T={T}, {a.dtype}: [T,H] {T * H * w / MiB:.0f} MiB, "
            f"[T,F] {T * F * w / MiB:.0f} MiB, [T,2F] {T * 2 * F * w / MiB:.0f} MiB, "
            f"[T,V] {T * r0['V'] * w / MiB:.0f} MiB; elements per token = bytes / {T * w}"
        )
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
