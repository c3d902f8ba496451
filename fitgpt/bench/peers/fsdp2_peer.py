"""PyTorch FSDP2 with CPUOffloadPolicy training fitgpt's model (any family): the
`fsdp2-offload` system.

Configured as FSDP2's documentation (the `fully_shard` API reference) and torchtitan, its
reference trainer, recommend for a model larger than the GPU:
- the model is built on the meta device (no memory), activation checkpointing is applied, then
  `fully_shard` on every block and last on the root (bottom-up: one all-gather and one
  reduce-scatter per block; the root group holds embeddings, final norm and head);
- CPUOffloadPolicy(pin_memory=True): the sharded fp32 parameters, their gradients and AdamW's
  moments live in pinned CPU memory; each block's shard is copied to the GPU before its
  all-gather, and each gradient shard copied back after its reduce-scatter;
- MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32): bf16 compute, fp32 gradient
  reduction and fp32 master weights (fp32 compute on CPUs, as fitgpt's `auto` precision);
- `to_empty(device="cpu")` materialises the shards on the CPU (torchtitan's init device under CPU
  offload), and each shard is filled from fitgpt's initialisation of the full parameter;
- torch.optim.AdamW(fused=True) steps on the CPU shards.

Gradient accumulation keeps FSDP2's default (reduce-scatter after every micro-batch).
`set_requires_gradient_sync(False)` would skip that communication, but FSDP2 then keeps an
unsharded fp32 gradient of every parameter on the GPU until the last micro-batch
(FSDPParam.to_accumulated_grad_if_needed), which defeats offloading; torchtitan keeps sync on.

Gradient clipping (1.0, fitgpt's default) is done by hand: clip_grad_norm_ reduces the norm with
a collective on the gradients' device, and offloaded gradients are on the CPU while the process
group speaks NCCL. One host sync per step, as in every system.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.device_mesh import DeviceMesh

from fitgpt.bench.config import BenchConfig
from fitgpt.bench.peers import (
    LR,
    adamw_groups,
    ensure_group,
    initial_value,
    mean_loss,
    restore_buffers,
    share_cores,
    to_device,
)
from fitgpt.dist import DistContext
from fitgpt.engine.base import Batch
from fitgpt.engine.config import OptimConfig, PrecisionConfig
from fitgpt.engine.transforms.activation import checkpoint_blocks
from fitgpt.model import DecoderLM, ModelConfig, build_model

try:  # torch >= 2.6 exports FSDP2 here
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard
except ImportError:  # its home before that
    from torch.distributed._composable.fsdp import (  # type: ignore[no-redef]
        CPUOffloadPolicy,
        MixedPrecisionPolicy,
        fully_shard,
    )

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def shard_model(model: DecoderLM, mesh: DeviceMesh, param_dtype: torch.dtype, pin: bool) -> None:
    """fully_shard every block, then the root (bottom-up, as FSDP2 requires)."""
    kwargs = {
        "mesh": mesh,
        "mp_policy": MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32),
        "offload_policy": CPUOffloadPolicy(pin_memory=pin),
    }
    for block in model.blocks:
        fully_shard(block, **kwargs)
    fully_shard(model, **kwargs)


@torch.no_grad()
def init_shards(model: DecoderLM, seed: int, device: torch.device, ctx: DistContext) -> None:
    """Fill every local shard with its rows of fitgpt's initial value of the full parameter.

    FSDP2 shards dim 0 like torch.chunk (rank r holds chunk r, possibly short or empty), so the
    full value is made one parameter at a time on `device` and this rank's rows copied out.
    """
    for name, p in model.named_parameters():
        full = initial_value(model, name, p.shape, seed, device)
        chunks = full.chunk(ctx.world, dim=0)
        rows = chunks[ctx.rank] if ctx.rank < len(chunks) else full[:0]
        local = p.to_local()
        if local.shape != rows.shape:
            raise RuntimeError(f"{name}: local shard {tuple(local.shape)}, expected {rows.shape}")
        local.copy_(rows)
        del full  # free the full-size temporary before the next parameter
    restore_buffers(model)


class FSDP2Runner:
    def __init__(
        self, model: DecoderLM, opt: torch.optim.Optimizer, ocfg: OptimConfig, ctx
    ) -> None:
        self.model, self.opt, self.ocfg, self.ctx = model, opt, ocfg, ctx
        self.params = [p for p in model.parameters() if p.requires_grad]

    @torch.no_grad()
    def clip_grads(self) -> None:
        """Global-norm clipping over the gradient shards of every rank."""
        grads: list[Tensor] = [p.grad.to_local() for p in self.params if p.grad is not None]
        sq = torch.stack(torch._foreach_norm(grads, 2.0)).square().sum()
        sq = sq.to(self.ctx.device)
        if self.ctx.distributed:
            dist.all_reduce(sq, group=self.ctx.group)
        coef = torch.clamp(self.ocfg.grad_clip / (sq.sqrt() + 1e-6), max=1.0)
        torch._foreach_mul_(grads, coef.to(grads[0].device))  # host sync when offloaded

    def step(self, micro_batches: list[Batch]) -> float:
        n = len(micro_batches)
        loss_sum = torch.zeros((), device=self.ctx.device)
        for batch in micro_batches:
            x, y = to_device(batch, self.ctx.device)
            loss = self.model(x, y)  # fp32: the model's cross-entropy upcasts the logits
            (loss / n).backward()  # FSDP2 reduce-scatters and offloads every block's gradient
            loss_sum += loss.detach()
        if self.ocfg.grad_clip > 0:
            self.clip_grads()
        self.opt.step()  # fused AdamW on the CPU shards
        self.opt.zero_grad(set_to_none=True)  # free the CPU gradients until the next backward
        return mean_loss(loss_sum, n, self.ctx)


def build(model_cfg: ModelConfig, bench: BenchConfig, ctx: DistContext) -> FSDP2Runner:
    ctx = ensure_group(ctx)
    share_cores()
    cuda = ctx.device.type == "cuda"
    precision = PrecisionConfig("auto").resolved(ctx.device.type).precision
    with torch.device("meta"):
        model = build_model(model_cfg)
    ndims = {n: p.ndim for n, p in model.named_parameters()}
    if bench.checkpointing == "full":
        checkpoint_blocks(model)  # before sharding, so FSDP2's hooks stay outside the recompute
    mesh = DeviceMesh.from_group(ctx.group, ctx.device.type)
    # pinning needs a GPU; on CPUs (the tests) the policy still runs its offload code paths
    shard_model(model, mesh, DTYPES[precision], pin=cuda)
    model.to_empty(device="cpu")  # the shards' home under CPU offload
    init_shards(model, bench.seed, ctx.device, ctx)
    ocfg = OptimConfig()
    opt = torch.optim.AdamW(
        adamw_groups(list(model.named_parameters()), ndims, ocfg),
        lr=LR,
        betas=(ocfg.beta1, ocfg.beta2),
        eps=ocfg.eps,
        fused=True,
    )
    return FSDP2Runner(model, opt, ocfg, ctx)
