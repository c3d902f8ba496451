"""The GPU record of `fitgpt matmul` (issue 7): one suite per machine kind, one JSON line each.

    # nvidia-h200-x2: n=50000 fp32 and tf32 across 2 GPUs, rows layout (spawns torchrun itself)
    python benchmarks/parts/matmul_gpu.py --suite x2 --out benchmarks/results/matmul
    # nvidia-h100-x1: n=100000 fp32 and tf32 out of core on one GPU (40 GB per operand)
    python benchmarks/parts/matmul_gpu.py --suite oocore --out benchmarks/results/matmul

x2      A and B are generated once on the GPUs and shared by the fp32 and tf32 runs (3 timed
        products each), each against one GPU's torch.mm at n=16384 in the same dtype. The 2d
        layout is recorded as not applicable: 2 ranks form no square grid.
        Expected: ~20 s start-up (torchrun, CUDA, NCCL), fp32 ~2.5 s a product at ~50 TFLOP/s
        per GPU, tf32 ~0.4 s; about 1 minute in all. Device memory ~17 GB per GPU.
oocore  A and B (80 GB) in pinned host memory, generated on the GPU panel by panel; C is
        folded into the verifier tile by tile and never stored. Expected: 20-40 s to pin and
        fill 80 GB, fp32 ~40-50 s (2·10^15 FLOPs at ~50 TFLOP/s), tf32 ~8-10 s; about
        2-3 minutes. Needs ~82 GB of host memory and takes ~48 GB of the GPU.

Each experiment appends one JSON object to OUT/matmul_<suite>.jsonl (written to a temporary
name and renamed); a table of the suite comes last. Exit status 1 when a verification fails.
`--size N` shrinks a suite for a quick check (e.g. --size 8192); on a CPU machine it runs on gloo.
"""

from __future__ import annotations

import argparse
import datetime
import os
import socket
import subprocess
import sys
import time

# Run from a checkout without installing it: the repository root is importable.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

SUITES = {
    "x2": {"n": 50000, "world": 2, "dtypes": "fp32,tf32", "repeat": 3},
    "oocore": {"n": 100000, "world": 1, "dtypes": "fp32,tf32", "repeat": 1},
}
LAUNCH_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1"}


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--suite", choices=sorted(SUITES), required=True)
    p.add_argument("--out", required=True, metavar="DIR", help="folder of the .jsonl record")
    p.add_argument("--size", type=int, default=0, help="matrix size n; 0: the suite's own")
    p.add_argument("--dtypes", default="", help="comma-separated; default fp32,tf32")
    p.add_argument("--repeat", type=int, default=0, help="timed products each; 0: the suite's own")
    p.add_argument("--ref-n", type=int, default=-1, help="one-GPU reference size; -1: 16384")
    return p.parse_args()


def launch_torchrun(world: int) -> int:
    """Start this script again under torchrun with `world` processes; return its status."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           "--nproc-per-node", str(world), *sys.argv]  # fmt: skip
    env = {**os.environ, **LAUNCH_ENV}
    env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // world)))
    return subprocess.run(cmd, env=env).returncode


def provenance() -> dict:
    import torch

    try:
        commit = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            timeout=10,
            cwd=os.path.dirname(os.path.abspath(__file__)),
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        commit = ""
    cuda = torch.version.cuda if torch.cuda.is_available() else None
    return {
        "host": socket.gethostname(),
        "when": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "git": commit or None,
        "cuda": cuda,
    }


def row(rec: dict) -> str:
    if rec.get("skipped"):
        return f"{rec['experiment']:<22} skipped: {rec['skipped']}"
    gbs = lambda b: f"{(b or 0) / 1e9:6.1f}"  # noqa: E731
    moved = rec["h2d_bytes"] if rec["layout"] == "out-of-core" else rec["comm_bytes"]
    frac = f"{rec['frac_of_ref']:.2f}" if rec.get("frac_of_ref") else "  - "
    v = rec["verify"]
    return (
        f"{rec['experiment']:<22} {rec['n']:>6} {rec['world']:>2} {rec['time_s']:8.2f} "
        f"{rec['tflops']:8.1f} {frac:>5} {gbs(rec['held_bytes'])} {gbs(rec['peak_bytes'])} "
        f"{gbs(moved)} {v['freivalds']:.1e} {'PASS' if v['passed'] else 'FAIL'}"
    )


def main() -> int:
    args = parse()
    suite = SUITES[args.suite]
    if suite["world"] > 1 and "RANK" not in os.environ:
        return launch_torchrun(suite["world"])
    os.environ.update(LAUNCH_ENV)

    from fitgpt.dist import init_distributed, shutdown
    from fitgpt.matmul.config import MatmulConfig
    from fitgpt.matmul.report import append_jsonl, table
    from fitgpt.matmul.run import run_matmul

    t_start = time.perf_counter()
    ctx = init_distributed()
    n = args.size or suite["n"]
    dtypes = (args.dtypes or suite["dtypes"]).split(",")
    path = os.path.join(args.out, f"matmul_{args.suite}.jsonl")
    if ctx.is_main:
        os.makedirs(args.out, exist_ok=True)
    base = {"suite": args.suite, **provenance()} if ctx.is_main else {}
    records, cache = [], {}
    try:
        for dtype in dtypes:
            cfg = MatmulConfig(
                n=n,
                dtype=dtype,
                layout="rows",
                out_of_core=args.suite == "oocore",
                repeat=args.repeat or suite["repeat"],
                ref_n=args.ref_n,
            )
            result = run_matmul(cfg, ctx, cache=cache)
            if ctx.is_main:
                print(table(result), flush=True)
                name = f"{'out-of-core' if cfg.out_of_core else 'rows'} {dtype}"
                rec = {
                    **base,
                    "experiment": name,
                    "wall_s": time.perf_counter() - t_start,
                    **result.record(),
                }
                append_jsonl(path, rec)
                records.append(rec)
    finally:
        for held in cache.values():
            if hasattr(held, "close"):
                held.close()  # unpin the out-of-core host operands
        cache.clear()
        shutdown(ctx)
    if args.suite == "x2" and ctx.is_main:
        rec = {
            **base,
            "experiment": "2d (SUMMA)",
            "layout": "2d",
            "world": ctx.world,
            "skipped": f"{ctx.world} ranks form no square grid; SUMMA needs 1, 4, 9... GPUs",
        }
        append_jsonl(path, rec)
        records.append(rec)
    if ctx.is_main:
        print(
            f"\nmatmul suite {args.suite}: {time.perf_counter() - t_start:.0f} s, record in {path}"
        )
        print(
            f"{'experiment':<22} {'n':>6} {'P':>2} {'time s':>8} {'TFLOP/s':>8} {'×ref':>5} "
            f"{'held':>6} {'peak':>6} {'moved':>6} {'Freivalds':>7}   (held, peak, moved: GB per GPU)"
        )
        for rec in records:
            print(row(rec))
    failed = any(not r.get("skipped") and not r["verify"]["passed"] for r in records)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
