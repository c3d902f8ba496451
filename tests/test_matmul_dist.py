"""fitgpt matmul across real gloo processes (CPU): rows at world 2, SUMMA and rows at world 4,
against an exact product, plus a corrupted block that Freivalds' check must catch."""

from __future__ import annotations

import dataclasses
import subprocess
import sys

import numpy as np
import pytest
import torch
import torch.distributed as dist

from fitgpt.dist import DistContext
from fitgpt.matmul.blocks import split
from fitgpt.matmul.config import MatmulConfig
from fitgpt.matmul.operands import MATRIX_A, MATRIX_B, Generated, block, operands
from fitgpt.matmul.run import run_matmul
from fitgpt.matmul.verify import verify_blocks

pytestmark = pytest.mark.slow
CPU = torch.device("cpu")


def _ctx(rank: int, world: int) -> DistContext:
    return DistContext(rank, world, rank, CPU, dist.group.WORLD)


def _quiet(_msg: str) -> None:
    pass


def _check_file(path: str, n: int, tol: float) -> None:
    a = block(Generated(n, 0, MATRIX_A), (0, n), (0, n), torch.float64, CPU)
    b = block(Generated(n, 0, MATRIX_B), (0, n), (0, n), torch.float64, CPU)
    want = (a @ b).numpy()
    got = np.load(path)
    assert np.linalg.norm(got - want) / np.linalg.norm(want) < tol


def rows_world2(rank: int, world: int, out_dir: str) -> None:
    ctx, n = _ctx(rank, world), 37
    cfg = MatmulConfig(n=n, panel=5, ref_n=0, out=f"{out_dir}/c.npy")
    cache: dict = {}
    r = run_matmul(cfg, ctx, cache=cache, log=_quiet)
    assert r.passed, r.verify
    if rank == 0:
        _check_file(cfg.out, n, 1e-6)
    # Each rank receives the columns of B it does not own, once: 19 or 18 of 37.
    assert r.comm_bytes == 4 * n * 19 and r.comm_bytes_total == 4 * n * n
    assert r.held_bytes < r.seed_bytes
    # tf32 shares the fp32 operands: generated once.
    r2 = run_matmul(dataclasses.replace(cfg, dtype="tf32", out=None), ctx, cache=cache, log=_quiet)
    assert r2.passed and r2.setup_reused
    # One wrong entry in rank 1's block of C: every rank sees the check fail.
    (product,) = cache.values()
    if rank == 1:
        product.c[3, 7] += 1.0
    blocks = (product.a_blocks, product.b_blocks, product.c_blocks)
    v = verify_blocks(ctx, "fp32", 0, n, operands(cfg), *blocks, samples=8)
    assert not v.passed and v.freivalds > 1e-3, v


def grid_world4(rank: int, world: int, out_dir: str) -> None:
    ctx, n = _ctx(rank, world), 37  # 2×2 grid: blocks of 19 and 18
    cfg = MatmulConfig(n=n, layout="2d", panel=4, ref_n=0, out=f"{out_dir}/c2d.npy")
    r = run_matmul(cfg, ctx, log=_quiet)
    assert r.passed, r.verify
    if rank == 0:
        _check_file(cfg.out, n, 1e-6)
    # Rank (i, j) receives A[I_i, K] for K outside column block j and B[K, J_j] for K outside
    # row block i: m·(n - w) + (n - m)·w entries for an m×w block.
    sizes = [b - a for a, b in split(n, 2)]
    got = [4 * (m * (n - w) + (n - m) * w) for m in sizes for w in sizes]
    assert r.comm_bytes == max(got) and r.comm_bytes_total == sum(got)
    rb = run_matmul(MatmulConfig(n=101, dtype="bf16", panel=7, ref_n=0), ctx, log=_quiet)
    assert rb.passed, rb.verify
    r2 = run_matmul(MatmulConfig(n=10, layout="2d", dtype="bf16", ref_n=0), ctx, log=_quiet)
    assert r2.passed, r2.verify


def test_rows_layout_world2(gloo, tmp_path):
    gloo(2, rows_world2, str(tmp_path))


def test_summa_and_rows_world4(gloo, tmp_path):
    gloo(4, grid_world4, str(tmp_path))


def test_cli_launches_torchrun(tmp_path):
    """`--gpus 2` starts torchrun itself (gloo on a CPU machine) and passes the flags through."""
    out = tmp_path / "c.npy"
    cmd = [sys.executable, "-m", "fitgpt", "matmul", "--n", "45", "--gpus", "2", "--panel", "8",
           "--ref-n", "0", "--out", str(out), "--json", str(tmp_path / "r.json")]  # fmt: skip
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "PASS" in done.stdout and "2 × cpu" in done.stdout
    _check_file(str(out), 45, 1e-6)
