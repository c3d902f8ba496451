"""The benchmark peers: DeepSpeed and PyTorch FSDP2 training fitgpt's own model.

Each peer is configured the way its own documentation recommends for training a model larger than
the GPU with CPU offload (benchmarks/README.md cites the pages); fitgpt's protocol (AdamW, fp32
master weights, bf16 compute on GPUs, clipping at 1.0, activation checkpointing of every block)
is the same for all. Only fitgpt/bench/systems.py imports these modules, lazily, inside a trial:
DeepSpeed is an optional extra (`pip install 'fitgpt[bench]'`) and fitgpt never needs it.

What both peers share lives here: a process group when the trial has none, fitgpt's initial
weights, AdamW's parameter groups, and the loss a step reports.
"""

from __future__ import annotations

import dataclasses
import datetime
import os

import torch
import torch.distributed as dist
from torch import Tensor, nn

from fitgpt.dist import DistContext
from fitgpt.engine.base import Batch
from fitgpt.engine.config import OptimConfig
from fitgpt.model import DecoderLM
from fitgpt.model.families.gpt2.model import alibi_slopes

LR = 1e-4  # the constant learning rate every system in a sweep trains at (systems.trained)


def ensure_group(ctx: DistContext, timeout_s: float = 600.0) -> DistContext:
    """`ctx` with a process group: FSDP2 and DeepSpeed need one even for a single process.

    A one-GPU trial runs without torchrun, so fitgpt made no group. We make a one-process group
    (NCCL on GPUs, gloo on CPUs) over an in-memory store (no port to collide on), and set the
    variables a launcher would have set, because DeepSpeed reads LOCAL_RANK from the environment.
    """
    if ctx.group is not None:
        return ctx
    env = {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1"}
    env |= {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}  # read, never used: HashStore
    for k, v in env.items():
        os.environ.setdefault(k, v)
    if not dist.is_initialized():
        cuda = ctx.device.type == "cuda"
        dist.init_process_group(
            "nccl" if cuda else "gloo",
            store=dist.HashStore(),
            rank=0,
            world_size=1,
            timeout=datetime.timedelta(seconds=timeout_s),
            device_id=ctx.device if cuda else None,
        )
    return dataclasses.replace(ctx, group=dist.group.WORLD)


def share_cores() -> None:
    """Give each rank its share of the CPU cores for the CPU optimizer step.

    torchrun sets OMP_NUM_THREADS=1 when it starts several processes, which would leave a CPU
    Adam on one core; DeepSpeed's launcher instead gives each rank cores/ranks threads
    (`--bind_cores_to_rank`, the ZeRO-Offload tutorial's advice), and so do we.
    """
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    if local_world > 1 and torch.get_num_threads() == 1:
        threads = max(1, (os.cpu_count() or 1) // local_world)
        torch.set_num_threads(threads)
        # a JIT-built extension (DeepSpeedCPUAdam) may load its own OpenMP runtime, which reads
        # the variable when it loads
        os.environ["OMP_NUM_THREADS"] = str(threads)


def initial_value(model: DecoderLM, name: str, shape: torch.Size, seed: int, device) -> Tensor:
    """Parameter `name` as fitgpt initialises it (fp32, on `device`): every system starts from
    the same weights on a given device type, whatever it shards or casts them to afterwards."""
    t = torch.empty(shape, dtype=torch.float32, device=device)
    model.init_parameter_(name, t, seed)
    return t


@torch.no_grad()
def restore_buffers(model: DecoderLM) -> None:
    """Recompute the model's one buffer (ALiBi's slopes), which a meta-device build followed by
    to_empty leaves uninitialised; the bench's learned positions have none."""
    if model.cfg.position == "alibi":
        model.alibi_slopes_N.copy_(alibi_slopes(model.cfg.n_head))


def adamw_groups(named: list[tuple[str, nn.Parameter]], ndims: dict[str, int], ocfg: OptimConfig):
    """fitgpt's AdamW groups: weight decay on matrices only (not biases, norms); `ndims` gives
    each parameter's full rank (a ZeRO-3 partition is flat, an FSDP2 shard a DTensor)."""
    decay = [p for n, p in named if ndims[n] >= 2]
    no_decay = [p for n, p in named if ndims[n] < 2]
    return [
        {"params": decay, "weight_decay": ocfg.weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]


def to_device(batch: Batch, device: torch.device) -> tuple[Tensor, Tensor]:
    """(inputs, targets) on the device: the peers train token streams (a sweep's data has no
    packed segments to carry)."""
    pair = Batch(*batch)[:2]
    if device.type == "cuda":
        return tuple(t.pin_memory().to(device, non_blocking=True) for t in pair)  # type: ignore[return-value]
    return pair


def mean_loss(loss_sum: Tensor, n: int, ctx: DistContext) -> float:
    """Mean loss of the step's micro-batches over every rank; ends in a host sync."""
    loss = loss_sum.detach().float() / n
    if ctx.distributed:
        dist.all_reduce(loss, group=ctx.group)
        loss /= ctx.world
    value = loss.item()  # host sync
    if ctx.device.type == "cuda":
        torch.cuda.synchronize(ctx.device)  # the Runner contract: the device is idle on return
    return value
