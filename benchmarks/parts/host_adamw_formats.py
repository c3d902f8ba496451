"""The host optimizer's per-chunk update in each storage format, timed on one large chunk.

What the host optimizer's worker thread does for one offloaded chunk (engine/chunked/offload.py), on
real tensors of one 8 B-model block (hidden 4096: 201.4 M elements; --elems to change):
  fp32 state:    the bf16 gradient upcast and scaled into an fp32 buffer, torch's fused AdamW
                 (torch.optim.AdamW(fused=True)) over the fp32 master and moments, the master
                 cast back into the bf16 staging buffer;
  compact state: CompactState.step (engine/formats/compact.py): the same, piece by piece through the
                 worker's fp32 scratch, with the master split (bf16 weight + int16 remainder)
                 and/or the moments in bf16 or block-wise int8.
Each format runs --warmup untimed and --reps timed updates; the table gives the median seconds
per chunk, elements per second, the state's bytes per element, and the projected host AdamW
seconds per step for --model-elems offloaded elements. Threads: torch's intra-op pool, as the
training process sets it (fitgpt/dist/env.py: the cores shared out between local ranks).

    python3 benchmarks/parts/host_adamw_formats.py --out results.json      # on the GPU machine's host
    python3 benchmarks/parts/host_adamw_formats.py --elems 4000000 --reps 2  # a quick look anywhere
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch

from fitgpt.engine.formats.compact import (
    NATIVE_MASTERS,
    CompactState,
    Scratch,
    piece_elems,
    upcast_scaled,
)

FORMATS = [  # (master, moments)
    ("fp32", "fp32"),
    ("split", "fp32"),
    ("fp32", "bf16"),
    ("split", "bf16"),
    ("fp32", "int8"),
    ("split", "int8"),
]
BETAS, EPS, LR, WD = (0.9, 0.95), 1e-8, 3e-4, 0.1


def fp32_update(n: int, reps: int, warmup: int) -> tuple[list[float], float]:
    """torch's fused AdamW on fp32 state, as the worker's fp32 path runs it."""
    master = torch.randn(n) * 0.02
    m, v = torch.zeros(n), torch.zeros(n)
    g32 = torch.empty(n)
    buf = (torch.randn(n) * 1e-3).to(torch.bfloat16)
    opt = torch.optim.AdamW([master], lr=LR, betas=BETAS, eps=EPS, weight_decay=WD, fused=True)
    opt.state[master] = {"step": torch.zeros(()), "exp_avg": m, "exp_avg_sq": v}
    times = []
    for i in range(warmup + reps):
        t0 = time.perf_counter()
        upcast_scaled(buf, 0.5, g32)
        master.grad = g32
        opt.step()
        master.grad = None
        buf.copy_(master)
        if i >= warmup:
            times.append(time.perf_counter() - t0)
    return times, 12.0


def compact_update(n: int, master: str, moments: str, reps: int, warmup: int):
    st = CompactState(n, master, moments, torch.device("cpu"), [(0, n, WD)], BETAS, EPS)
    scratch = Scratch(min(n, piece_elems(torch.device("cpu"))), torch.device("cpu"))
    st.warm_up(scratch)  # the compiled codec, compiled now (untimed), as the engine does
    weights = torch.empty(n, dtype=torch.bfloat16)
    st.load(torch.randn(n) * 0.02, None, None, weights, scratch)
    grad = (torch.randn(n) * 1e-3).to(torch.bfloat16)
    times = []
    for i in range(warmup + reps):
        t0 = time.perf_counter()
        st.step(weights, grad, 0.5, LR, scratch)
        if i >= warmup:
            times.append(time.perf_counter() - t0)
    nbytes = (st.master_nbytes() + st.moments_nbytes()) / n
    return times, nbytes


def variants(pieces: str, modes: list[str]):
    """fp32 once; each compact format eagerly and compiled (engine/formats/codec.py) at each piece,
    and through the native kernel (engine/formats/hostkernel.py: whole chunk, no pieces) where it
    serves (compact.NATIVE_MASTERS)."""
    yield ("fp32", "fp32"), "eager", int(pieces.split(",")[0])
    for fmt in FORMATS[1:]:
        for piece in (int(p) for p in pieces.split(",")):
            for mode in modes:
                if mode != "native":
                    yield fmt, mode, piece
        if "native" in modes and fmt[0] in NATIVE_MASTERS.get(fmt[1], ()):
            yield fmt, "native", 0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--elems", type=int, default=201_379_840, help="elements of the chunk")
    ap.add_argument("--model-elems", type=float, default=7.86e9, help="offloaded elements/step")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: leave as set)")
    ap.add_argument("--pieces", default="1048576", help="host piece sizes to try (comma list)")
    ap.add_argument("--modes", default="eager,compiled,native", help="host kernels to try")
    ap.add_argument("--out", default="")
    a = ap.parse_args()
    if a.threads:
        torch.set_num_threads(a.threads)
    rows = []
    print(f"chunk {a.elems / 1e6:.1f} M elements, {torch.get_num_threads()} threads, "
          f"{os.cpu_count()} cores, torch {torch.__version__}")  # fmt: skip
    for (master, moments), mode, piece in variants(a.pieces, a.modes.split(",")):
        os.environ["FITGPT_HOST_KERNELS"] = mode
        os.environ["FITGPT_HOST_PIECE"] = str(piece or 1 << 22)
        if (master, moments) == ("fp32", "fp32"):
            times, per = fp32_update(a.elems, a.reps, a.warmup)
        else:
            times, per = compact_update(a.elems, master, moments, a.reps, a.warmup)
        s = statistics.median(times)
        row = {
            "master": master,
            "moments": moments,
            "codec": mode if (master, moments) != ("fp32", "fp32") else "-",
            "piece": piece,
            "s_per_chunk": round(s, 4),
            "gelem_per_s": round(a.elems / s / 1e9, 3),
            "state_bytes_per_elem": round(per, 3),
            "projected_s_per_step": round(a.model_elems / (a.elems / s), 2),
            "times": [round(t, 4) for t in times],
        }
        rows.append(row)
        print(f"{master:>6} {moments:>5} {row['codec']:>8} {piece:>9}  {s:7.3f} s/chunk  {row['gelem_per_s']:6.2f} G/s  "
              f"{per:5.2f} B/elem  {row['projected_s_per_step']:6.2f} s/step", flush=True)  # fmt: skip
    base = rows[0]["s_per_chunk"]
    for r in rows:
        r["vs_fp32"] = round(r["s_per_chunk"] / base, 3)
    if a.out:
        meta = {"elems": a.elems, "threads": torch.get_num_threads(), "torch": torch.__version__}
        with open(a.out, "w") as f:
            json.dump({"meta": meta, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
