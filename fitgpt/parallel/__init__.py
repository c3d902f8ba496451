"""Tensor parallelism (`--tensor-parallel T`) and context parallelism (`--context-parallel C`),
applied to a model of any family from outside the model: docs/parallel.md."""

from fitgpt.parallel.context import check_context_parallel, context_parallel
from fitgpt.parallel.layers import TensorParallelLM, parallelize
from fitgpt.parallel.shard import check_tensor_parallel

__all__ = [
    "TensorParallelLM",
    "check_context_parallel",
    "check_tensor_parallel",
    "context_parallel",
    "parallelize",
]
