"""fitgpt matmul on one CPU process: generation, the layouts at world 1, out-of-core tiling,
verification and the one-line refusals. The gloo multi-process tests are in test_matmul_dist.py."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from fitgpt.cli import main
from fitgpt.dist import DistContext
from fitgpt.errors import UserError
from fitgpt.matmul import memory
from fitgpt.matmul.blocks import panels, split
from fitgpt.matmul.config import MatmulConfig
from fitgpt.matmul.operands import (
    MATRIX_A,
    MATRIX_B,
    Generated,
    NpyFile,
    block,
    check_vector,
    open_source,
    operands,
)
from fitgpt.matmul.out_of_core import choose_tiles
from fitgpt.matmul.rows import RowsPlan, RowsProduct
from fitgpt.matmul.run import run_matmul
from fitgpt.matmul.summa import SummaPlan, grid_side
from fitgpt.matmul.verify import verify_blocks

CPU = torch.device("cpu")
ONE = DistContext(0, 1, 0, CPU)


def quiet(_msg: str) -> None:
    pass


def exact_product(n: int, seed: int = 0) -> np.ndarray:
    a = block(Generated(n, seed, MATRIX_A), (0, n), (0, n), torch.float64, CPU)
    b = block(Generated(n, seed, MATRIX_B), (0, n), (0, n), torch.float64, CPU)
    return (a @ b).numpy()


def one_line_error(fn, *args, match: str, **kwargs) -> str:
    with pytest.raises(UserError, match=match) as e:
        fn(*args, **kwargs)
    assert "\n" not in str(e.value)
    return str(e.value)


def test_split_and_panels_cover_uneven_sizes():
    assert split(37, 2) == [(0, 19), (19, 37)]
    assert [b - a for a, b in split(10, 4)] == [3, 3, 2, 2]
    assert split(1, 2) == [(0, 1), (1, 1)]
    assert panels(19, 37, 5) == [(19, 24), (24, 29), (29, 33), (33, 37)]  # balanced, no sliver
    assert panels(5, 5, 3) == []


def test_generation_is_layout_independent_and_exact():
    g = Generated(64, seed=3, matrix=MATRIX_A)
    full = block(g, (0, 64), (0, 64), torch.float64, CPU)
    # Any block, at any coordinates and in any storage dtype, holds the same entries.
    assert torch.equal(block(g, (13, 50), (7, 61), torch.float32, CPU).double(), full[13:50, 7:61])
    assert torch.equal(block(g, (63, 64), (0, 64), torch.float64, CPU), full[63:64])
    assert torch.equal(block(g, (0, 64), (5, 6), torch.float64, CPU), full[:, 5:6])
    bf = block(g, (0, 64), (0, 64), torch.bfloat16, CPU)
    assert torch.equal(bf, full.to(torch.bfloat16))
    assert full.min() >= -1 and full.max() < 1 and abs(float(full.mean())) < 0.05
    assert torch.equal(full * 2**23, torch.round(full * 2**23))  # k·2^-23: exact in fp32
    # A different matrix id, or seed, gives a different matrix; a larger n the same corner.
    assert not torch.equal(
        block(Generated(64, 3, MATRIX_B), (0, 8), (0, 8), torch.float64, CPU), full[:8, :8]
    )
    assert not torch.equal(
        block(Generated(64, 4, MATRIX_A), (0, 8), (0, 8), torch.float64, CPU), full[:8, :8]
    )
    assert torch.equal(
        block(Generated(999, 3, MATRIX_A), (0, 64), (0, 64), torch.float64, CPU), full
    )
    x = check_vector(3, 1000, CPU)
    assert x.abs().min() >= 0.5 and x.abs().max() < 1 and 0.4 < float((x > 0).double().mean()) < 0.6


def test_npy_operands_and_their_errors(tmp_path):
    a = np.arange(36, dtype=np.float32).reshape(6, 6)
    np.save(tmp_path / "a.npy", a)
    src = open_source(str(tmp_path / "a.npy"), "--a", 6, 0, MATRIX_A)
    assert isinstance(src, NpyFile)
    assert np.array_equal(block(src, (1, 4), (2, 6), torch.float32, CPU).numpy(), a[1:4, 2:6])
    one_line_error(
        open_source, str(tmp_path / "a.npy"), "--a", 7, 0, MATRIX_A, match="does not match --n 7"
    )
    np.save(tmp_path / "r.npy", np.zeros((3, 4), dtype=np.float32))
    one_line_error(open_source, str(tmp_path / "r.npy"), "--b", 3, 0, MATRIX_B, match="not square")
    np.save(tmp_path / "i.npy", np.zeros((3, 3), dtype=np.int32))
    one_line_error(
        open_source, str(tmp_path / "i.npy"), "--b", 3, 0, MATRIX_B, match="not floating"
    )


def test_config_refuses_bad_input_in_one_line(tmp_path):
    one_line_error(MatmulConfig, n=0, match="--n 0")
    one_line_error(MatmulConfig, n=-5, match="positive")
    one_line_error(MatmulConfig, dtype="fp16", match="--dtype 'fp16'")
    one_line_error(MatmulConfig, layout="3d", match="--layout")
    one_line_error(MatmulConfig, out=str(tmp_path / "c.bin"), match=r"\*\.npy")
    one_line_error(MatmulConfig, a_path=str(tmp_path / "missing.npy"), match="no such file")
    one_line_error(MatmulConfig, repeat=0, match="--repeat")
    one_line_error(grid_side, 2, match="2 ranks do not form a square grid; use --layout rows")
    one_line_error(lambda: SummaPlan(37, 8, 0, 4, 5).steps, match="run 4 or 9 ranks")
    assert grid_side(1) == 1 and grid_side(9) == 3


@pytest.mark.parametrize(
    "layout,dtype", [("rows", "fp32"), ("2d", "fp32"), ("rows", "bf16"), ("2d", "tf32")]
)
def test_in_core_layouts_at_world_one(tmp_path, layout, dtype):
    cfg = MatmulConfig(
        n=37, layout=layout, dtype=dtype, panel=5, ref_n=0, out=str(tmp_path / "c.npy")
    )
    r = run_matmul(cfg, ONE, log=quiet)
    assert r.passed, r.verify
    tol = 1e-5 if dtype != "bf16" else 3e-2
    want = exact_product(37)
    got = np.load(tmp_path / "c.npy")
    assert np.linalg.norm(got - want) / np.linalg.norm(want) < tol
    assert r.comm_bytes == 0 and r.held_bytes > 0


def test_out_of_core_streams_several_tiles(tmp_path, monkeypatch):
    # Host chunks of 1000 bytes: every panel copy spans several of them.
    monkeypatch.setattr(memory, "HOST_CHUNK_BYTES", 1000)
    cfg = MatmulConfig(
        n=101, out_of_core=True, tile_rows=16, tile_cols=24, ref_n=0, out=str(tmp_path / "c.npy")
    )
    r = run_matmul(cfg, ONE, log=quiet)
    assert r.passed, r.verify
    assert r.shape.startswith("7×5 tiles")
    got, want = np.load(tmp_path / "c.npy"), exact_product(101)
    assert np.abs(got - want).max() < 1e-4
    # A crosses once; B once per row of tiles, less the two panels that are still in the two
    # B buffers when the serpentine turns (cols 60..101 after even rows, 0..41 after odd).
    saved_cols = 3 * (101 - 61) + 3 * (21 + 20)
    assert r.h2d_bytes == 101 * 101 * 4 + (7 * 101 - saved_cols) * 101 * 4
    assert r.d2h_bytes == 101 * 101 * 4
    assert not (tmp_path / "c.npy.tmp").exists()


def test_out_of_core_bf16_from_npy_files(tmp_path):
    rng = np.random.default_rng(0)
    a, b = rng.standard_normal((2, 45, 45)).astype(np.float32)
    np.save(tmp_path / "a.npy", a)
    np.save(tmp_path / "b.npy", b)
    cfg = MatmulConfig(
        n=45, dtype="bf16", out_of_core=True, tile_rows=10, tile_cols=20, ref_n=0,
        a_path=str(tmp_path / "a.npy"), b_path=str(tmp_path / "b.npy"), out=str(tmp_path / "c.npy"),
    )  # fmt: skip
    r = run_matmul(cfg, ONE, log=quiet)
    assert r.passed, r.verify
    want = a.astype(np.float64) @ b.astype(np.float64)
    assert np.linalg.norm(np.load(tmp_path / "c.npy") - want) / np.linalg.norm(want) < 3e-2


def test_memory_refusals_name_the_shortfall():
    big = MatmulConfig(n=5000, out_of_core=True, host_mem=0.05, tile_rows=64, tile_cols=64)
    msg = one_line_error(run_matmul, big, ONE, log=quiet, match="need 0.20 GB of host memory")
    assert "0.05 GB is available" in msg
    tiny_dev = MatmulConfig(n=5000, out_of_core=True, device_mem=0.001)
    one_line_error(run_matmul, tiny_dev, ONE, log=quiet, match="of device memory")
    in_core = MatmulConfig(n=5000, device_mem=0.01, ref_n=0)
    msg = one_line_error(run_matmul, in_core, ONE, log=quiet, match="needs 0.30 GB per device")
    assert "n <= 912 fits" in msg and "--out-of-core" in msg
    two = DistContext(0, 2, 0, CPU)
    one_line_error(
        run_matmul, MatmulConfig(n=8, out_of_core=True), two, log=quiet, match="one device"
    )


def test_tile_choice_fills_the_budget():
    n, s = 100_000, 4
    plan = choose_tiles(n, s, 60 * 10**9, 0, 0, "cuda")
    assert plan.device_bytes <= 60 * 10**9 and plan.host_bytes == 80 * 10**9
    assert plan.tn == 7693 and len(plan.cols) == 13  # 8192 wide at most, balanced
    assert len(plan.rows) == 2  # two row panels of 50000: B crosses the bus twice
    assert len(choose_tiles(n, s, 30 * 10**9, 0, 0, "cuda").rows) == 4
    one_line_error(choose_tiles, n, s, 10**8, 0, 8192, "cuda", match="need .* of device memory")


def test_freivalds_catches_a_corrupted_entry():
    cfg = MatmulConfig(n=41, panel=6)
    plan = RowsPlan(41, 1, 0, 4, 6)
    product = RowsProduct(ONE, plan, *operands(cfg), torch.float32)
    product.multiply()
    args = (ONE, "fp32", 0, 41, operands(cfg))
    blocks = (product.a_blocks, product.b_blocks, product.c_blocks)
    assert verify_blocks(*args, *blocks, samples=16).passed
    product.c[17, 29] += 1.0
    v = verify_blocks(*args, *blocks, samples=16)
    assert not v.passed and v.freivalds > 1e-3


def test_cli_writes_json_reads_npy_and_infers_n(tmp_path, capsys):
    rng = np.random.default_rng(1)
    a, b = rng.uniform(-1, 1, (2, 30, 30)).astype(np.float32)
    np.save(tmp_path / "a.npy", a)
    np.save(tmp_path / "b.npy", b)
    argv = ["matmul", "--a", str(tmp_path / "a.npy"), "--b", str(tmp_path / "b.npy"),
            "--layout", "2d", "--ref-n", "64", "--out", str(tmp_path / "c.npy"),
            "--json", str(tmp_path / "r.json")]  # fmt: skip
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 0
    out = capsys.readouterr().out
    assert "PASS" in out and "rate (2n³ / time)" in out
    rec = json.loads((tmp_path / "r.json").read_text())
    assert rec["n"] == 30 and rec["verify"]["passed"] and rec["ref_tflops"] > 0
    assert np.allclose(np.load(tmp_path / "c.npy"), a.astype(np.float64) @ b, atol=1e-5)
    with pytest.raises(SystemExit) as e:
        main(["matmul", "--n", "8", "--gpus", "2", "--out-of-core"])
    assert e.value.code == 2
    assert "--out-of-core runs on one GPU" in capsys.readouterr().err


def test_forwarded_flags_survive_torchrun_parsing():
    from fitgpt.cli import build_parser
    from fitgpt.cli.matmul import forwarded_flags

    args = build_parser().parse_args(
        [
            "matmul",
            "--n",
            "64",
            "--gpus",
            "2",
            "--no-out-of-core",
            "--dtype",
            "bf16",
            "--json",
            "r.json",
        ]
    )
    flags = forwarded_flags(args)
    assert flags == [
        "--matrix-size",
        "64",
        "--dtype",
        "bf16",
        "--no-out-of-core",
        "--json",
        "r.json",
    ]
    again = build_parser().parse_args(["matmul", *flags])
    assert again.n == 64 and again.dtype == "bf16" and again.out_of_core is False
