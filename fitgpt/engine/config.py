"""The engine's configs: precision, optimizer, and where state lives.

Only the engine reads these; the training loop passes them through untouched.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Literal

from fitgpt.errors import UserError

Precision = Literal["auto", "bf16", "fp16", "fp32"]
Tier = Literal["none", "cpu", "nvme"]


@dataclass(frozen=True)
class PrecisionConfig:
    precision: Precision = field(
        default="auto",
        metadata={
            "help": "compute precision; master weights are always fp32. auto: bf16 on GPUs, "
            "fp32 on CPUs (CPU bf16 matmuls are ~20x slower without AMX)"
        },
    )
    initial_scale: float = field(default=2.0**16, metadata={"help": "fp16: initial loss scale"})
    growth_interval: int = field(
        default=1000, metadata={"help": "fp16: overflow-free steps before the scale doubles"}
    )
    hysteresis: int = field(
        default=2, metadata={"help": "fp16: overflows tolerated before the scale halves"}
    )
    min_scale: float = field(default=1.0, metadata={"help": "fp16: the scale never drops below"})

    def __post_init__(self) -> None:
        if self.precision not in ("auto", "bf16", "fp16", "fp32"):
            raise UserError(f"--precision {self.precision!r}: use auto, bf16, fp16 or fp32")
        if self.growth_interval < 1 or self.hysteresis < 1:
            raise UserError("--growth-interval and --hysteresis must be at least 1")
        # the loss is multiplied by the scale and the gradients divided by it: 0 divides by zero,
        # a negative scale flips every update, inf/nan poison the first step
        for name in ("initial_scale", "min_scale"):
            v = getattr(self, name)
            if not math.isfinite(v) or v <= 0:
                flag = f"--{name.replace('_', '-')}"
                raise UserError(f"{flag} {v:g} must be a positive number, e.g. 65536 (2^16)")
        if self.min_scale > self.initial_scale:
            raise UserError(
                f"--min-scale {self.min_scale:g} is above --initial-scale {self.initial_scale:g}: "
                "the scale would start below its floor; lower --min-scale"
            )

    def resolved(self, device_type: str) -> PrecisionConfig:
        """This config with `auto` replaced by the precision for `device_type`."""
        if self.precision != "auto":
            return self
        return dataclasses.replace(self, precision="bf16" if device_type == "cuda" else "fp32")


@dataclass(frozen=True)
class OptimConfig:
    """AdamW with decoupled weight decay (none on biases and norms) and global-norm clipping."""

    beta1: float = field(default=0.9, metadata={"help": "AdamW beta1"})
    beta2: float = field(default=0.95, metadata={"help": "AdamW beta2"})
    eps: float = field(default=1e-8, metadata={"help": "AdamW epsilon"})
    weight_decay: float = field(
        default=0.1, metadata={"help": "decoupled weight decay (2-D weights only)"}
    )
    grad_clip: float = field(
        default=1.0, metadata={"help": "clip the global gradient norm to this; 0 = off"}
    )

    def __post_init__(self) -> None:
        if not (0 <= self.beta1 < 1 and 0 <= self.beta2 < 1):
            raise UserError(f"betas ({self.beta1}, {self.beta2}) must lie in [0, 1)")
        if self.eps <= 0 or self.weight_decay < 0 or self.grad_clip < 0:
            raise UserError("--eps must be > 0; --weight-decay and --grad-clip must be >= 0")


@dataclass(frozen=True)
class EngineConfig:
    """Which engine holds the state, and where each piece of it lives."""

    engine: Literal["ddp", "zero"] = field(
        default="zero",
        metadata={
            "help": "ddp: plain PyTorch (DistributedDataParallel: every GPU holds all the "
            "state); zero: fitgpt's engine, which can split the state across GPUs "
            "(--zero-stage) and keep part of it in host RAM or on disk (--offload-*)",
            "planned": True,
        },
    )
    zero_stage: int = field(
        default=0,
        metadata={
            "help": "with --engine zero, what each of N GPUs keeps only 1/N of: 0 nothing "
            "(each holds everything), 1 the optimizer state, 2 also the gradients, 3 also the "
            "weights",
            "planned": True,
        },
    )
    checkpointing: Literal["off", "full", "cpu"] = field(
        default="off",
        metadata={
            "help": "activation checkpointing: full keeps only each transformer block's input "
            "and recomputes the rest in the backward pass (much less memory, ~1/3 more "
            "compute); cpu does the same with those inputs in host RAM",
            "planned": True,
        },
    )
    keep_activations: int = field(
        default=0,
        metadata={
            "help": "with --checkpointing full: the last K transformer blocks keep their whole "
            "activations and are not recomputed (faster, more memory: each kept block holds "
            "its whole saved set instead of its input); under --plan auto (and for adapter runs "
            "under --plan off too) the planner keeps the most that fit, 0 otherwise",
            "planned": True,
        },
    )
    offload_optimizer: Tier = field(
        default="none",
        metadata={
            "help": "where the fp32 master weights and Adam moments of the offloaded blocks "
            "live: none (GPU), cpu (host RAM; their optimizer step runs on the CPU), nvme "
            "(files in --nvme-path)",
            "planned": True,
        },
    )
    offload_params: Tier = field(
        default="none",
        metadata={
            "help": "where the working (bf16) weights of the offloaded blocks live: cpu keeps "
            "them in host RAM and copies each block to the GPU just before it runs (needs "
            "--offload-optimizer cpu or nvme)",
            "planned": True,
        },
    )
    offload_blocks: int | None = field(
        default=None,
        metadata={
            "help": "with --offload-optimizer: how many transformer blocks are offloaded, the "
            "last ones first (the rest stay on the GPU); default: all of them. "
            "--offload-fraction F says it as a share of the blocks",
            "planned": True,
        },
    )
    offload_experts: bool = field(
        default=False,
        metadata={
            "help": "mixtures of experts: of the offloaded blocks, offload only the experts' "
            "state (their own chunks) and keep each block's attention and router on the GPU "
            "(docs/memory.md)",
            "planned": True,
        },
    )
    nvme_blocks: int | None = field(
        default=None,
        metadata={
            "help": "with --offload-optimizer nvme: how many of the offloaded blocks keep their "
            "optimizer state in files (the last ones); the rest stay in host RAM; default: all. "
            "--nvme-fraction F says it as a share of the offloaded blocks",
            "planned": True,
        },
    )
    nvme_path: str = field(
        default="",
        metadata={
            "help": "folder on a fast disk for the disk tier's files (--offload-optimizer "
            "nvme); with --plan auto, giving it lets the planner use the disk"
        },
    )
    cpu_mem: int = field(
        default=0,
        metadata={
            "cli": False,  # `fitgpt train --cpu-mem 240GB`, its own flag, parsed to bytes
            "help": "host RAM (bytes) the machine gives the run, as the user stated it: the "
            "planner fits plans to it and the engine checks its host state against it before "
            "allocating; 0: what the kernel reports available, less a reserve",
        },
    )
    gpu_mem: int = field(
        default=0,
        metadata={
            "cli": False,  # `fitgpt train --gpu-mem 80GB`, its own flag, parsed to bytes
            "help": "bytes of each GPU the run may fill, as the user stated it: the planner "
            "fits plans to it and the engine caps torch's allocator at it (a shared GPU, or a "
            "smaller card's plan on a larger one); 0: the whole GPU",
        },
    )
    inter_node_gbps: float = field(
        default=0.0,
        metadata={
            "cli": False,  # `fitgpt train --inter-node-gbps 400`, with the node flags
            "help": "the link between nodes as the user stated it, Gb/s per GPU: the planner "
            "prices collectives that leave a node at it (plan/links.py); 0: as `fitgpt probe` "
            "measured it on this machine, else the assumed 400",
        },
    )
    master: Literal["auto", "fp32", "split"] = field(
        default="auto",
        metadata={
            "help": "storage of the fp32 master weights: split keeps each as the bf16 working "
            "weight plus a 16-bit remainder (2 bytes per parameter instead of 4, the same "
            "values; bf16 compute only); auto: fp32 unless the plan needs the room",
            "planned": True,
        },
    )
    moments: Literal["auto", "fp32", "bf16", "int8"] = field(
        default="auto",
        metadata={
            "help": "storage of the Adam moments of the offloaded blocks (host RAM and disk): "
            "bf16 (4 bytes per parameter fewer) or int8 block-wise (6 fewer); auto: fp32 "
            "unless the plan needs the room. See docs/offload.md for their effect on the loss",
            "planned": True,
        },
    )
    device_moments: Literal["auto", "fp32", "bf16", "int8"] = field(
        default="auto",
        metadata={
            "help": "the same for the blocks whose optimizer state stays on the GPU",
            "planned": True,
        },
    )

    speculative_update: bool = field(
        default=True,
        metadata={
            "help": "start the offloaded blocks' host updates during the backward, as soon as "
            "each block's gradient is reduced, guessing that the step is neither clipped nor "
            "skipped; a wrong guess is undone and redone exactly once the norm is known "
            "(docs/offload.md)"
        },
    )
    tensor_parallel: int = field(
        default=1,
        metadata={
            "help": "split every transformer layer's weights (attention heads, MLP width) and "
            "the vocabulary over groups of T consecutive GPUs, Megatron-style; the remaining "
            "world/T ranks are data-parallel (ZeRO, offload as usual). T must divide the GPU "
            "count, the head count, 4·hidden and the padded vocabulary; auto (stored as 0): "
            "the planner picks T (docs/parallel.md)",
            "parse": lambda v: 0 if v == "auto" else int(v),
        },
    )
    sequence_parallel: bool = field(
        default=False,
        metadata={
            "help": "with --tensor-parallel: split the activations between the layers "
            "(LayerNorms, dropout, residual) along the sequence too, so each GPU keeps 1/T of "
            "all of a layer's activations (Megatron's sequence parallelism; the same bytes "
            "communicated). The sequence length must divide by T"
        },
    )
    context_parallel: int = field(
        default=1,
        metadata={
            "help": "split every sequence into C contiguous slices over groups of C "
            "consecutive GPUs (context parallelism, DeepSpeed-Ulysses all-to-all: attention "
            "runs over the whole sequence for 1/C of the heads), for sequences whose "
            "activations one GPU cannot hold; the C ranks are data-parallel for the weights "
            "(ZeRO, offload as usual), and the job reads world/C different rows. C must divide "
            "the GPU count, the query and key/value heads and --seq-len; with "
            "--tensor-parallel T, C·T divides the GPUs and the heads (docs/parallel.md)"
        },
    )
    expert_parallel: int = field(
        default=1,
        metadata={
            "help": "mixtures of experts: spread every sparse layer's experts over groups of P "
            "consecutive GPUs, each holding E/P of them; tokens travel to their experts' GPU "
            "and back by all-to-all. The dense parts stay data-parallel over every GPU (ZeRO, "
            "offload as usual); the experts are reduced over the world/P GPUs that hold the "
            "same ones. P must divide the GPU count and the expert count; auto (stored as 0): "
            "the planner picks P (docs/engine.md)",
            "parse": lambda v: 0 if v == "auto" else int(v),
        },
    )
    shard_within: Literal["world", "node"] = field(
        default="world",
        metadata={
            "help": "with --engine zero on several machines: world shards the ZeRO state over "
            "every GPU of the job; node shards it over the GPUs of each machine and keeps one "
            "replica per machine (hierarchical sharding, HSDP: gradients reduce-scattered "
            "inside the machine, then all-reduced across machines, so the slow link between "
            "machines carries 1/G of them; G times the state per GPU). docs/training.md",
        },
    )
    compile: Literal["auto", "on", "off", "blocks", "model"] = field(
        default="auto",
        metadata={
            "help": "torch.compile the training forward: blocks (each transformer block's "
            "forward and the head + loss; the engine's hooks stay eager) or model (the whole "
            "forward as one graph, run as CUDA graphs: one GPU holding a model up to hidden "
            "1024 whole). Faster steps after a one-off compile at the first step. on: the "
            "planner picks the scope; auto: as on for GPU runs long enough to pay the compile "
            "back, off otherwise and on CPUs (docs/engine.md says the rule)"
        },
    )

    def __post_init__(self) -> None:
        if self.compile not in ("auto", "on", "off", "blocks", "model"):
            raise UserError(f"--compile {self.compile!r}: use auto, on, off, blocks or model")
        if self.engine not in ("ddp", "zero"):
            raise UserError(f"--engine {self.engine!r}: use ddp or zero")
        tp = self.tensor_parallel
        if not isinstance(tp, int) or isinstance(tp, bool) or tp < 0:
            raise UserError(f"--tensor-parallel {tp!r}: use a whole number >= 1, or auto")
        if self.sequence_parallel and tp == 1:
            raise UserError("--sequence-parallel splits within a TP group: add --tensor-parallel T")
        cp = self.context_parallel
        if not isinstance(cp, int) or isinstance(cp, bool) or cp < 1:
            raise UserError(f"--context-parallel {cp!r}: use a whole number >= 1")
        ep = self.expert_parallel
        if not isinstance(ep, int) or isinstance(ep, bool) or ep < 0:
            raise UserError(f"--expert-parallel {ep!r}: use a whole number >= 1, or auto")
        if self.shard_within not in ("world", "node"):
            raise UserError(f"--shard-within {self.shard_within!r}: use world or node")
        if self.shard_within == "node" and (self.engine != "zero" or tp != 1 or cp != 1 or ep != 1):
            raise UserError(
                "--shard-within node shards fitgpt's engine inside each machine, without "
                "tensor, context or expert parallelism: use --engine zero and --tensor-parallel, "
                "--context-parallel and --expert-parallel 1 with it, or --shard-within world"
            )
        k = self.keep_activations
        if not isinstance(k, int) or isinstance(k, bool) or k < 0:
            raise UserError(f"--keep-activations {k!r}: use a whole number >= 0")
        if k and self.checkpointing != "full":
            raise UserError(
                f"--keep-activations {k} spares blocks from --checkpointing full's recompute, and "
                f"--checkpointing is {self.checkpointing}: add --checkpointing full, or drop "
                "--keep-activations"
            )
        if self.zero_stage not in (0, 1, 2, 3):
            raise UserError(f"--zero-stage {self.zero_stage}: use 0, 1, 2 or 3")
        if self.engine == "ddp" and (self.zero_stage or self.offloads):
            raise UserError(
                "--engine ddp shards and offloads nothing; use --engine zero for "
                "--zero-stage/--offload-*"
            )
        for name in ("offload_blocks", "nvme_blocks"):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < 0):
                raise UserError(f"--{name.replace('_', '-')} {v!r} must be a whole number >= 0")
        if self.offload_params == "nvme":
            raise UserError(
                "--offload-params nvme: weights stream from host RAM only; use --offload-params "
                "cpu (the disk tier holds optimizer state: --offload-optimizer nvme)"
            )
        if self.offload_params != "none" and self.offload_optimizer == "none":
            raise UserError(
                "--offload-params cpu streams the weights of the offloaded blocks: add "
                "--offload-optimizer cpu (or nvme)"
            )
        if self.offload_experts and self.offload_optimizer == "none":
            raise UserError(
                "--offload-experts offloads the offloaded blocks' experts alone: add "
                "--offload-optimizer cpu (or nvme)"
            )
        compact = self.master == "split" or {self.moments, self.device_moments} - {"auto", "fp32"}
        if self.engine == "ddp" and compact:
            raise UserError(
                "--engine ddp keeps torch's fp32 optimizer state; use --engine zero for "
                "--master split and compact --moments/--device-moments"
            )
        if "nvme" in (self.offload_optimizer, self.offload_params) and not self.nvme_path:
            raise UserError("an nvme tier needs --nvme-path DIR on a disk with room for it")

    @property
    def offloads(self) -> bool:
        return self.offload_optimizer != "none" or self.offload_params != "none"
