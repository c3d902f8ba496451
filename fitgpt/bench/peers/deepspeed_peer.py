"""DeepSpeed 0.19.8 training fitgpt's model (any family): `deepspeed-z3-offload`,
`deepspeed-z3-nvme` and `deepspeed-z2-offload`.

Configured as DeepSpeed's own tutorials show for a model larger than one GPU:
- ZeRO-3 + offload (the ZeRO tutorial's "ZeRO-Infinity" CPU example): bf16 parameters
  partitioned and kept in pinned CPU memory (offload_param), fp32 master weights and Adam
  moments in pinned CPU memory (offload_optimizer), stepped by DeepSpeedCPUAdam; the model is
  constructed inside `deepspeed.zero.Init(remote_device="cpu", pin_memory=True)` so no process
  ever holds the whole model; the stage-3 knobs at the tutorial's values.
- ZeRO-Infinity (`deepspeed-z3-nvme`, the ZeRO-Infinity tutorial's NVMe example): the same
  ZeRO-3, with the parameters and the optimizer state swapped to files under --nvme-path
  through libaio (DeepSpeed's async_io op, compiled at first use), the model constructed inside
  `zero.Init(remote_device="nvme")`; swap buffers as large as the largest parameter.
- ZeRO-2 + optimizer offload (the ZeRO-Offload tutorial): bf16 parameters and gradients on the
  GPU, fp32 master weights, moments and the Adam step on the CPU; plain construction.
Both: the config's "AdamW" optimizer (DeepSpeed picks DeepSpeedCPUAdam in AdamW mode under
optimizer offload) with fitgpt's hyper-parameters and decay groups, gradient_clipping 1.0
(fitgpt's default), overlap_comm and contiguous_gradients, and DeepSpeed's own gradient
accumulation: engine.backward scales by 1/grad_accum and engine.step applies the optimizer only
at the accumulation boundary.

Activation checkpointing is fitgpt's `checkpoint_blocks` (torch's non-reentrant checkpoint),
applied before deepspeed.initialize. ZeRO-3 in 0.19.8 supports it for trainable parameters:
the recompute calls each submodule again, whose hooks re-gather its weights. The one known
failure (a recomputed weight seen with shape [0]) needs frozen parameters, and its fix
(deepspeedai/DeepSpeed#8148) is in 0.19.8. `deepspeed.checkpointing` is the Megatron-style API
for partitioning activations across model-parallel ranks, which a data-parallel run has none of.
The CPU test (DeepSpeed's CPU accelerator, 2 ranks) matches the DDP baseline's losses.

DeepSpeed is imported only here, inside build(); without it the trial is refused with the
install hint. Its log is set to warnings; CPUAdam's first-use compile (about 40 s, cached in
~/.cache/torch_extensions) writes to the trial's own output, which the sweep keeps in its log.
"""

from __future__ import annotations

import logging
import warnings

import torch

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
from fitgpt.errors import UserError
from fitgpt.model import DecoderLM, ModelConfig, build_model

INSTALL_HINT = (
    "deepspeed is not installed: pip install 'fitgpt[bench]' (DeepSpeed 0.19.8) to benchmark "
    "the DeepSpeed peers"
)


def import_deepspeed():
    try:
        import deepspeed
    except ImportError as e:
        raise UserError(INSTALL_HINT) from e
    deepspeed.utils.logger.setLevel(logging.WARNING)
    # torch deprecates the collective names DeepSpeed calls, once per call: keep the log readable
    warnings.filterwarnings("ignore", r"`torch\.distributed\.\w+` is deprecated", FutureWarning)
    return deepspeed


def ds_config(
    bench: BenchConfig, stage: int, bf16: bool, ocfg: OptimConfig, largest: int = 0
) -> dict:
    """The DeepSpeed config of one trial (DeepSpeed derives train_batch_size from these).
    `largest` > 0: ZeRO-Infinity, the parameters and the optimizer state on the disk at
    bench.nvme_path (stage 3 only), with swap buffers of `largest` elements, the largest
    parameter's size (DeepSpeed refuses smaller ones)."""
    pinned_cpu = {"device": "cpu", "pin_memory": True}
    tier = pinned_cpu
    if largest:
        tier = {"device": "nvme", "nvme_path": bench.nvme_path, "pin_memory": True}
    zero: dict = {
        "stage": stage,
        "offload_optimizer": dict(tier, **({"buffer_count": 4} if largest else {})),
        "overlap_comm": True,
        "contiguous_gradients": True,
    }
    if stage == 3:
        zero |= {
            "offload_param": dict(
                tier, **({"buffer_count": 5, "buffer_size": largest} if largest else {})
            ),
            # the ZeRO tutorial's CPU-offload example; all but the two bucket sizes (defaults
            # 5e7 and 5e8) are also the config's defaults
            "stage3_max_live_parameters": 1e9,
            "stage3_max_reuse_distance": 1e9,
            "stage3_prefetch_bucket_size": 1e7,
            "stage3_param_persistence_threshold": 1e5,
            "reduce_bucket_size": 1e7,
            "sub_group_size": 1e9,
        }
    aio = {}
    if largest:  # the ZeRO-Infinity tutorial's libaio settings
        aio = {"aio": {"block_size": 1 << 20, "queue_depth": 8, "thread_count": 1,
                       "single_submit": False, "overlap_events": True}}  # fmt: skip
    return aio | {
        "train_micro_batch_size_per_gpu": bench.micro_batch,
        "gradient_accumulation_steps": bench.grad_accum,
        "gradient_clipping": ocfg.grad_clip,
        "bf16": {"enabled": bf16},
        "optimizer": {
            "type": "AdamW",
            "params": {
                "lr": LR,
                "betas": [ocfg.beta1, ocfg.beta2],
                "eps": ocfg.eps,
                "weight_decay": ocfg.weight_decay,  # the no-decay group overrides it with 0
            },
        },
        "zero_optimization": zero,
        "steps_per_print": 1 << 30,  # no periodic progress lines: the sweep reports
        "wall_clock_breakdown": False,
    }


def parts(model: DecoderLM):
    """(prefix, module) for every block and every other top-level child: the units whose
    weights are gathered together to be initialised."""
    for name, child in model.named_children():
        if name == "blocks":
            yield from ((f"blocks.{i}", b) for i, b in enumerate(child))
        else:
            yield name, child


@torch.no_grad()
def build_zero3_model(
    deepspeed, cfg: ModelConfig, config: dict, seed: int, ctx, nvme: bool = False
) -> DecoderLM:
    """GPT constructed inside zero.Init: each module's weights are partitioned (and cast to
    bf16) into pinned CPU memory as soon as it is built; then fitgpt's initial values are
    written in one gathered block at a time."""
    with deepspeed.zero.Init(
        config_dict_or_path=config,
        remote_device="nvme" if nvme else "cpu",
        pin_memory=ctx.device.type == "cuda",  # pinning needs a GPU
    ):
        model = build_model(cfg)
    for prefix, module in parts(model):
        named = list(module.named_parameters(prefix=prefix))
        if not named:
            continue
        with deepspeed.zero.GatheredParameters([p for _, p in named], modifier_rank=0):
            for name, p in named:
                p.data.copy_(initial_value(model, name, p.ds_shape, seed, ctx.device))
    # the head's weight is read outside its own module's forward (GPT.head): registered with
    # the root, as the ZeRO-3 docs ask (0.19.8 would also catch it at first access)
    head = model.wte.weight if model.lm_head is None else model.lm_head.weight
    deepspeed.zero.register_external_parameter(model, head)
    return model


@torch.no_grad()
def build_plain_model(cfg: ModelConfig, dtype: torch.dtype, seed: int, ctx) -> DecoderLM:
    """GPT in the compute dtype on the GPU, where ZeRO-2 keeps the working weights."""
    with torch.device("meta"):
        model = build_model(cfg).to(dtype)
    model.to_empty(device=ctx.device)
    for name, p in model.named_parameters():
        p.copy_(initial_value(model, name, p.shape, seed, ctx.device))
    restore_buffers(model)
    return model


class DeepSpeedRunner:
    def __init__(self, ds_engine, ctx: DistContext) -> None:
        # not `.engine`: the harness reads that as a fitgpt Engine (memory report, plan)
        self.ds_engine, self.ctx = ds_engine, ctx

    def step(self, micro_batches: list[Batch]) -> float:
        engine = self.ds_engine
        n, gas = len(micro_batches), engine.gradient_accumulation_steps()
        if n != gas:
            raise RuntimeError(f"{n} micro-batches in a step; DeepSpeed was configured for {gas}")
        loss_sum = torch.zeros((), device=self.ctx.device)
        for batch in micro_batches:
            x, y = to_device(batch, self.ctx.device)
            loss = engine(x, y)
            engine.backward(loss)  # scales by 1/grad_accum
            engine.step()  # the CPU Adam step runs only at the accumulation boundary
            loss_sum += loss.detach().float()
        return mean_loss(loss_sum, n, self.ctx)


def largest_parameter(cfg: ModelConfig) -> int:
    """Elements of the model's largest parameter (built on the meta device: no memory)."""
    with torch.device("meta"):
        return max(p.numel() for p in build_model(cfg).parameters())


def build(
    stage: int, model_cfg: ModelConfig, bench: BenchConfig, ctx: DistContext, nvme: bool = False
):
    if nvme and not bench.nvme_path:
        raise UserError(
            "deepspeed-z3-nvme keeps parameters and optimizer state on the disk: give "
            "--nvme-path FOLDER on a local NVMe disk"
        )
    deepspeed = import_deepspeed()
    ctx = ensure_group(ctx)
    deepspeed.init_distributed()  # adopts the torch.distributed group that now exists
    share_cores()
    bf16 = PrecisionConfig("auto").resolved(ctx.device.type).precision == "bf16"
    ocfg = OptimConfig()
    config = ds_config(bench, stage, bf16, ocfg, largest_parameter(model_cfg) if nvme else 0)
    if stage == 3:
        model = build_zero3_model(deepspeed, model_cfg, config, bench.seed, ctx, nvme)
        ndims = {n: len(p.ds_shape) for n, p in model.named_parameters()}
    else:
        dtype = torch.bfloat16 if bf16 else torch.float32
        model = build_plain_model(model_cfg, dtype, bench.seed, ctx)
        ndims = {n: p.ndim for n, p in model.named_parameters()}
    if bench.checkpointing == "full":
        checkpoint_blocks(model)
    groups = adamw_groups(list(model.named_parameters()), ndims, ocfg)
    engine, *_ = deepspeed.initialize(model=model, model_parameters=groups, config=config)
    return DeepSpeedRunner(engine, ctx)


def zero3_offload(model_cfg: ModelConfig, bench: BenchConfig, ctx: DistContext):
    return build(3, model_cfg, bench, ctx)


def zero2_offload(model_cfg: ModelConfig, bench: BenchConfig, ctx: DistContext):
    return build(2, model_cfg, bench, ctx)


def zero3_nvme(model_cfg: ModelConfig, bench: BenchConfig, ctx: DistContext):
    return build(3, model_cfg, bench, ctx, nvme=True)
