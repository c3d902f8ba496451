"""Tensor parallelism (`--tensor-parallel T`), applied to fitgpt's GPT from outside the model:
docs/parallel.md."""

from fitgpt.parallel.layers import TensorParallelGPT, parallelize
from fitgpt.parallel.shard import check_tensor_parallel

__all__ = ["TensorParallelGPT", "check_tensor_parallel", "parallelize"]
