"""Distributed and out-of-core matrix multiply: the smallest honest case of "does not fit".

    config.py       MatmulConfig and the dtype rules (fp32, tf32, bf16)
    blocks.py       near-equal index ranges; Block, a piece of a matrix on one rank
    operands.py     A and B from a seed (pure function of the indices) or from .npy files
    rows.py         A by rows, B broadcast in column panels (any number of ranks)
    summa.py        SUMMA on a q×q process grid
    out_of_core.py  one device, A and B in pinned host memory, C tile by tile
    verify.py       Freivalds' check and sampled exact entries, in float64, block by block
    reference.py    one device's GEMM rate, the yardstick
    memory.py       how much may be allocated; pinned host buffers
    npyout.py       C written to .npy by every rank
    run.py          one run top to bottom: run_matmul(cfg, ctx) -> MatmulResult
    report.py       the table and the JSON record

docs/matmul.md explains the algorithms, the memory they save and the tolerances.
"""

from fitgpt.matmul.config import MatmulConfig
from fitgpt.matmul.run import MatmulResult, run_matmul

__all__ = ["MatmulConfig", "MatmulResult", "run_matmul"]
