"""Tensor parallelism (`--tensor-parallel T`) and context parallelism (`--context-parallel C`),
applied to a model of any family from outside the model: docs/parallel.md."""

from fitgpt.parallel.context import context_parallel
from fitgpt.parallel.layers import TensorParallelLM, parallelize

__all__ = [
    "TensorParallelLM",
    "context_parallel",
    "parallelize",
]
