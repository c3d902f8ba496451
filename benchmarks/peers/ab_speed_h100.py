"""Issue 19: which change moves a compiled step at GPT-2 124 M and the 2.7b preset, measured
before any of them is built into fitgpt (one device call, every variant in its own process).

Each variant is `fitgpt train` with one change applied from outside, in this script only:
  base        the planner's engine, --compile on (regional: one graph per block, the head)
  ro          the regions compiled with mode="reduce-overhead" (CUDA graphs per region)
  whole       the whole model's forward as one compiled graph (as nanoGPT compiles it)
  whole_ro    that graph with mode="reduce-overhead"
  flash, cudnn, efficient
              scaled_dot_product_attention restricted to that backend
  cdt         Inductor's coordinate-descent tuning of its pointwise and reduction kernels
  res32       the residual stream in fp32 (the embeddings' sum and every block's additions;
              the norms and matrix products still read bf16), as autocast over fp32 weights
              keeps it in nanoGPT
  (fusedopt    AdamW as one compiled pass: measured here (results/ab_speed2_h100_2026-11-24),
              then built into the engine as a compiled run's update, engine/chunked/update.py)
  nopass      the engine's device update through torch's fused AdamW kernel as before the
              one pass was built in (engine/chunked/update.py one_pass off), to measure what it
              moved
  (accfuse    each block linear's weight gradient accumulated by its GEMM: measured here,
              then built into the engine, engine/transforms/wgrad.py)
  noacc       that turned off (autograd's fresh gradient and AccumulateGrad's add, as before)
  pdl         Inductor's programmatic dependent launch (a kernel's prologue overlaps the
              previous kernel's tail on Hopper)
  persist     Inductor's row reductions (the LayerNorms forward and backward) as persistent
              kernels up to 4096 wide (its default stops at 1024, so h=2560 loops over each
              row twice: 23 ms of LayerNorm forward in the 2.7b step, ~2x its traffic)
  multikernel Inductor's multi_kernel: both kinds of reduction kernel generated, the faster
              picked by timing them at the first call (set by the engine when it builds its
              regions, it failed to compile 3 runs of 5: not built in)
  pad96, pad128
              causal attention with the head dim (80 at 2.7b) zero-padded to 96 or 128 around
              scaled_dot_product_attention (the scale kept 1/sqrt(80)): the padded columns add
              0 to q·k and give 0 outputs, so the result is the same; cuDNN's kernels run
              head dims of 64 and 128 faster per FLOP (its 2.7b attention ran at ~230 TFLOP/s)
  ckpt        --checkpointing full (the compiled path under activation checkpointing)
  (atenln     every LayerNorm as an op the compiler cannot see into, run by ATen's CUDA
              kernels (Inductor's at h=2560 loop over each row: 54 ms of the 2.7b step):
              measured here, results/ab_speed3_h100_2026-11-24/1_floor, then built into the
              engine, engine/transforms/norm.py; its code here went with it)
  noln        that turned off (Inductor's LayerNorms at every width, as before)
  sumdb       the block linears' bias gradients as ATen's sum over rows and an add, as before
              the engine took them as one matrix-vector product (engine/transforms/wgrad.py
              _bias_grad)
  lt          torch's cuBLASLt preferred for every matrix product (preferred_blas_library)
  eagerblk    the blocks eager, the head (final LayerNorm, logits, loss) still compiled
  a+b         variants applied together
Plus a microbenchmark of each attention backend, forward + backward, at both models' shapes,
with q, k, v strided views of one qkv tensor as the model makes them.

    python3 benchmarks/peers/ab_speed_h100.py --out $OUT [--variants base,ro,...] [--sizes 124m,2.7b]
Prints a table (median ms per step after the first steps) and writes $OUT/ab_speed.jsonl.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SIZES = {  # preset, micro-batch, steps, steps skipped for the median
    "124m": ("gpt2-125m", 12, 40, 10),
    "2.7b": ("2.7b", 8, 12, 4),
    "1.5b": ("gpt2-1.5b", 8, 12, 4),
    "tiny": ("tiny", 2, 6, 2),
}


def apply(variant: str, argv: list[str]) -> list[str]:
    """The change `variant` makes, applied to this process before fitgpt runs; returns argv."""
    for v in variant.split("+"):
        argv = apply_one(v, argv)
    return argv


def apply_one(variant: str, argv: list[str]) -> list[str]:
    import torch

    if variant in ("flash", "cudnn", "efficient"):
        from torch.nn.attention import SDPBackend, sdpa_kernel

        backend = {
            "flash": SDPBackend.FLASH_ATTENTION,
            "cudnn": SDPBackend.CUDNN_ATTENTION,
            "efficient": SDPBackend.EFFICIENT_ATTENTION,
        }[variant]
        sdpa_kernel([backend]).__enter__()  # global flags, for the whole process
    elif variant == "ro":
        orig = torch.compile

        def compile_ro(fn=None, **kw):
            kw.setdefault("mode", "reduce-overhead")
            return orig(fn, **kw) if fn is not None else orig(**kw)

        torch.compile = compile_ro
    elif variant == "cdt":
        import torch._inductor.config as ic

        ic.coordinate_descent_tuning = True
    elif variant == "res32":
        from fitgpt.model import gpt

        embed, head = gpt.GPT.embed, gpt.GPT.head

        def block_forward(self, x, cache=None, layer=0, alibi_NTT=None):
            dt = self.ln_1.weight.dtype  # the norms read the working dtype; the sums stay fp32
            x = x + self.attn(self.ln_1(x.to(dt)), cache, layer, alibi_NTT)
            return x + self.mlp(self.ln_2(x.to(dt)))

        gpt.GPT.embed = lambda self, idx, past=0: embed(self, idx, past).float()
        gpt.GPT.head = lambda self, x: head(self, x.to(self.ln_f.weight.dtype))
        gpt.Block.forward = block_forward
    elif variant == "nopass":
        from fitgpt.engine.chunked import update

        orig_init = update.TieredUpdate.__init__

        def init_nopass(self, *a, **kw):
            orig_init(self, *a, **{**kw, "one_pass": False})

        update.TieredUpdate.__init__ = init_nopass
    elif variant == "pdl":
        import torch._inductor.config as ic

        ic.triton.enable_pdl = True
    elif variant in ("pad96", "pad128"):
        import math

        import torch.nn.functional as F

        width, sdpa = int(variant[3:]), F.scaled_dot_product_attention

        def padded(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, **kw):
            D = q.shape[-1]
            if attn_mask is not None or width <= D or kw:
                return sdpa(q, k, v, attn_mask=attn_mask, dropout_p=dropout_p,
                            is_causal=is_causal, scale=scale, **kw)  # fmt: skip
            q, k, v = (F.pad(t, (0, width - D)) for t in (q, k, v))
            y = sdpa(q, k, v, dropout_p=dropout_p, is_causal=is_causal,
                     scale=scale if scale is not None else 1 / math.sqrt(D))  # fmt: skip
            return y[..., :D]

        F.scaled_dot_product_attention = padded
    elif variant == "ckpt":
        argv = [*argv, "--checkpointing", "full"]
    elif variant == "noln":
        import fitgpt.engine.transforms.compile as comp

        comp.aten_norms = lambda *a: False
    elif variant == "sumdb":
        import fitgpt.engine.transforms.wgrad as wgrad

        wgrad._bias_grad = lambda grad, dy2: grad.add_(dy2.sum(0))
    elif variant == "lt":
        torch.backends.cuda.preferred_blas_library("cublaslt")
    elif variant == "eagerblk":
        import fitgpt.engine.transforms.compile as comp

        orig_init = comp.CompiledRegions.__init__

        def init(self, model, warn, whole=False):
            orig_init(self, model, warn, whole)
            if not whole:
                self.blocks.compiled = self.blocks.eager

        comp.CompiledRegions.__init__ = init
    elif variant == "multikernel":
        import torch._inductor.config as ic

        ic.triton.multi_kernel = 1
    elif variant == "persist":
        from torch._inductor import choices
        from torch._inductor.virtualized import V

        base = choices.InductorChoices.should_use_persistent_reduction

        def persistent(features, cooperative_reduction):
            if (
                features.get_reduction_hint() == choices.ReductionHint.INNER
                and not cooperative_reduction
                and choices.config.triton.persistent_reductions
            ):
                return V.graph.sizevars.statically_known_leq(features.reduction_numel, 4096)
            return base(features, cooperative_reduction)

        # the class, not a handler: the backward compiles on autograd's thread
        choices.InductorChoices.should_use_persistent_reduction = staticmethod(persistent)
    elif variant == "noacc":
        import fitgpt.engine.chunked.engine as chunked
        from fitgpt.engine.transforms.wgrad import FusedWeightGrads

        chunked.fuse_weight_grads = lambda *a, **kw: FusedWeightGrads([])
    elif variant in ("whole", "whole_ro"):
        import fitgpt.engine.chunked.engine as chunked

        orig_connect = chunked.ChunkEngine._connect_parts

        def connect(self):
            orig_connect(self)
            mode = "reduce-overhead" if variant == "whole_ro" else None
            self.model.forward = torch.compile(self.model.forward, mode=mode)

        chunked.ChunkEngine._connect_parts = connect
        argv = [a if a != "on" else "off" for a in argv]  # no regions: the whole forward
    return argv


def attention_bench(out: Path) -> None:
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    rows = []
    for name, (B, N, T, D) in {"124m": (12, 12, 1024, 64), "2.7b": (8, 32, 1024, 80)}.items():
        for backend in ("default", "flash", "cudnn", "efficient", "pad96", "pad128"):
            qkv = torch.randn(B, T, 3 * N * D, device="cuda", dtype=torch.bfloat16)
            qkv.requires_grad_(True)

            pad = int(backend[3:]) - D if backend.startswith("pad") else 0

            def step(qkv=qkv, B=B, N=N, T=T, D=D, pad=pad):
                q, k, v = qkv.chunk(3, dim=2)
                q, k, v = (t.view(B, T, N, D).transpose(1, 2) for t in (q, k, v))
                if pad > 0:
                    q, k, v = (F.pad(t, (0, pad)) for t in (q, k, v))
                y = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=D**-0.5)
                y[..., :D].transpose(1, 2).reshape(B, T, N * D).sum().backward()

            ctx = (
                sdpa_kernel([getattr(SDPBackend, backend.upper() + "_ATTENTION")])
                if backend in ("flash", "cudnn", "efficient")
                else torch.enable_grad()
            )
            try:
                with ctx:
                    for _ in range(3):
                        step()
                    torch.cuda.synchronize()
                    t0 = time.perf_counter()
                    for _ in range(20):
                        step()
                    torch.cuda.synchronize()
                ms = (time.perf_counter() - t0) / 20 * 1000
            except RuntimeError as e:
                ms = None
                print(f"attention {name} {backend}: {str(e).splitlines()[0][:120]}")
            flops = 3.5 * 4 * B * N * T * T * D / 2  # causal forward + backward (2.5× forward)
            rec = {"kind": "attention", "size": name, "backend": backend, "ms": ms,
                   "tflops": flops / ms / 1e9 if ms else None}  # fmt: skip
            print(json.dumps(rec), flush=True)
            rows.append(rec)
    with open(out / "ab_speed.jsonl", "a") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")


def run_variant(size: str, variant: str, out: Path) -> dict:
    preset, mb, steps, skip = SIZES[size]
    run_dir = Path("/tmp/ab_speed") / f"{size}_{variant}"
    args = [
        "train", "--preset", preset, "--micro-batch", str(mb), "--grad-accum", "4",
        "--data", "uniform", "--steps", str(steps), "--log-every", "1", "--eval-every", "0",
        "--no-save", "--overwrite", "--compile", "on", "--out", str(run_dir),
    ]  # fmt: skip
    log = out / f"{size}_{variant}.log"
    t0 = time.time()
    with open(log, "w") as f:
        rc = subprocess.run(
            [sys.executable, __file__, "--child", variant, *args],
            stdout=f, stderr=subprocess.STDOUT, cwd=ROOT, timeout=300,
        ).returncode  # fmt: skip
    wall = time.time() - t0
    recs = []
    if (run_dir / "metrics.jsonl").is_file():
        recs = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in recs if r.get("kind") == "train" and r["step"] > skip]
    med = lambda k: statistics.median(r[k] for r in train) if train and k in train[0] else None  # noqa: E731
    rec = {"kind": "train", "size": size, "variant": variant, "rc": rc, "wall_s": round(wall, 1),
           "ms_per_step": med("ms_per_step"), "mfu": med("mfu"),
           "forward_backward_ms": 1000 * (med("forward_backward_s") or 0),
           "update_ms": 1000 * (med("update_s") or 0)}  # fmt: skip
    print(json.dumps(rec), flush=True)
    with open(out / "ab_speed.jsonl", "a") as f:
        f.write(json.dumps(rec) + "\n")
    return rec


def main() -> None:
    if len(sys.argv) > 2 and sys.argv[1] == "--child":
        sys.path.insert(0, str(ROOT))
        argv = apply(sys.argv[2], sys.argv[3:])
        from fitgpt.cli import main as fitgpt_main

        fitgpt_main(argv)
        return
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--sizes", default="124m,2.7b")
    ap.add_argument("--variants", default="base,ro,whole,flash,cudnn,cdt")
    ap.add_argument("--variants-2p7b", default="base,flash,cudnn,cdt")
    ap.add_argument("--no-attention", action="store_true")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    if not args.no_attention:
        attention_bench(args.out)
    rows = []
    for size in args.sizes.split(","):
        variants = args.variants_2p7b if size == "2.7b" else args.variants
        for v in variants.split(","):
            try:
                rows.append(run_variant(size, v, args.out))
            except subprocess.TimeoutExpired:
                print(f"{size} {v}: timed out")
    print(f"{'size':<6} {'variant':<10} {'ms/step':>8} {'mfu':>6} {'fwd+bwd':>8} {'wall s':>7}")
    for r in rows:
        ms = f"{r['ms_per_step']:8.1f}" if r["ms_per_step"] else "       -"
        mfu = f"{r['mfu']:6.3f}" if r["mfu"] else "     -"
        print(f"{r['size']:<6} {r['variant']:<10} {ms} {mfu} {r['forward_backward_ms']:8.1f} "
              f"{r['wall_s']:7.1f}")  # fmt: skip


if __name__ == "__main__":
    main()
