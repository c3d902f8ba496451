"""Tensor parallelism (`--tensor-parallel T`), applied to a model of any family from outside the
model: docs/parallel.md."""

from fitgpt.parallel.layers import TensorParallelLM, parallelize
from fitgpt.parallel.shard import check_tensor_parallel

__all__ = ["TensorParallelLM", "check_tensor_parallel", "parallelize"]
