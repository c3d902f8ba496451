"""A run's configs: the training loop's own (schedule, batch, cadence of logs, evals and
checkpoints) and the RunConfig that gathers every component's config into one run."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Literal

from fitgpt.adapters import AdapterConfig
from fitgpt.adapters.targets import adapter_elements
from fitgpt.data.config import DataConfig
from fitgpt.engine.config import EngineConfig, OptimConfig, PrecisionConfig
from fitgpt.errors import UserError
from fitgpt.model import ModelConfig, family_of

# The default micro-batch, in sequences per GPU. A dense model's is 24 (the planner's and the
# benchmarks' figures were measured at it). A mixture of experts holds its tokens per
# micro-batch to GPT-2's 24 × 1,024 instead: its sparse layers' backward holds k rows per token
# (Family.mlp_backward_bytes) beside a saved set k-fold a dense MLP's, so 24 sequences of 4,096
# tokens made gpt-oss-120b's activations 45 GiB per H200 and its checkpointed block inputs 144
# GiB of pinned host RAM on 4 GPUs: no plan fit, where 6 sequences fit (docs/planner.md).
DENSE_MICRO_BATCH = 24
MOE_MICRO_TOKENS = 24 * 1024


def default_micro_batch(model: ModelConfig) -> int:
    """Sequences per micro-batch when --micro-batch is not given: DENSE_MICRO_BATCH, or for a
    mixture of experts MOE_MICRO_TOKENS tokens' worth of the model's sequences (at least 1)."""
    if not family_of(model).has_experts:
        return DENSE_MICRO_BATCH
    return max(1, MOE_MICRO_TOKENS // model.seq_len)


@dataclass(frozen=True)
class TrainConfig:
    steps: int = field(default=400, metadata={"help": "optimizer steps to train for"})
    # None: the default, decided with the model (default_micro_batch; RunConfig settles it)
    micro_batch: int | None = field(
        default=None,
        metadata={
            "help": "sequences per micro-batch per GPU (per process)",
            "default_text": f"{DENSE_MICRO_BATCH}; a mixture of experts: {MOE_MICRO_TOKENS:,} "
            "tokens' worth (6 at seq 4096)",
        },
    )
    grad_accum: int = field(default=1, metadata={"help": "micro-batches per optimizer step"})
    # None: the default, worked out where the run's figures are known (train/schedule.py
    # resolve_schedule, called by the Trainer: the warm-up needs the tokens per step, which
    # depend on the data-parallel world size).
    lr: float | None = field(
        default=None,
        metadata={
            "help": "peak learning rate",
            "default_text": "by the model's width, interpolated from GPT-3's rates: 6e-4 at 768, "
            "1.6e-4 at 2560, 9e-5 at 6144; tiny 2e-3; a tenth of that with --init-from; with "
            "--lora-rank QLoRA's 2e-4, 1e-4 from 20 B parameters",
        },
    )
    min_lr: float | None = field(
        default=None,
        metadata={
            "help": "learning rate at the end of the cosine",
            "default_text": "a tenth of --lr",
        },
    )
    warmup: int | None = field(
        default=None,
        metadata={
            "help": "linear warm-up steps",
            "default_text": "GPT-3's 375 M tokens, at most 5%% of the run, at least Adam's "
            "2/(1-beta2) steps (40) and enough for a deep, wide model's first step (185 at "
            "GPT-2 1.5B, 477 at the 20b preset); with --init-from or --lora-rank 3%% of the run",
        },
    )
    finetune: bool = field(
        default=False,
        metadata={
            "cli": False,  # set by --init-from: the schedule's defaults are fine-tuning's
            "help": "the run starts from pretrained weights",
        },
    )
    eval_every: int = field(default=200, metadata={"help": "evaluate every N steps (0 = never)"})
    eval_batches: int = field(
        default=8, metadata={"help": "validation micro-batches per evaluation"}
    )
    log_every: int = field(default=20, metadata={"help": "one log line every N steps"})
    save_every: int = field(
        default=0, metadata={"help": "checkpoint every N steps (0 = only at the end)"}
    )
    keep: int = field(default=3, metadata={"help": "checkpoints kept (older ones are deleted)"})
    save: bool = field(
        default=True, metadata={"help": "write checkpoints (--no-save for throughput runs)"}
    )
    save_optimizer: Literal["full", "none"] = field(
        default="full",
        metadata={
            "help": "full: checkpoints hold the weights and the Adam moments (12 bytes per "
            "parameter with the RNG and index files aside: resumes exactly); none: the fp32 "
            "weights only (4 bytes per parameter: for generate and export; a resume starts "
            "the optimizer state fresh)"
        },
    )
    node_local_checkpoints: bool = field(
        default=False,
        metadata={
            "help": "several machines without a shared disk: each machine writes its ranks' "
            "checkpoint files into its own --out (its own lock, its own run folder); a resume "
            "on another node count or world size needs the files gathered into one folder "
            "first (docs/checkpoints.md)"
        },
    )
    max_bad_steps: int = field(
        default=20,
        metadata={
            "help": "stop with an error after this many steps in a row whose loss is NaN/inf "
            "or whose update was skipped (0 = never)"
        },
    )
    seed: int = field(
        default=0, metadata={"help": "seed of initialisation, data order and dropout"}
    )
    out: str = field(
        default="runs/default", metadata={"help": "run folder: checkpoints, metrics.jsonl"}
    )
    device: str = field(
        default="auto", metadata={"help": "auto (GPU if there is one), cuda or cpu"}
    )
    cpu_threads: int = field(
        default=0,
        metadata={
            "help": "CPU threads per process for the host optimizer and CPU compute; 0: the "
            "cores this process may use shared out between the processes on this machine "
            "(torchrun alone would give each one thread)"
        },
    )
    profile: int = field(
        default=0,
        metadata={
            "help": "profile N optimizer steps (from the 4th) with torch.profiler: a Chrome "
            "trace and a table of the ops with the most time in the run folder's profile/ "
            "(0 = off)"
        },
    )
    dist_timeout: float = field(
        default=600.0,
        metadata={
            "help": "multi-GPU runs: seconds one process waits for the others in a "
            "communication before the job ends naming the process that died or hangs"
        },
    )

    def __post_init__(self) -> None:
        for name in ("steps", "micro_batch", "grad_accum", "log_every", "keep"):
            if name == "micro_batch" and self.micro_batch is None:
                continue  # the default: RunConfig decides it with the model
            if getattr(self, name) < 1:
                raise UserError(
                    f"--{name.replace('_', '-')} {getattr(self, name)} must be at least 1"
                )
        for name in (
            "eval_every",
            "eval_batches",
            "save_every",
            "max_bad_steps",
            "cpu_threads",
            "profile",
        ):
            if getattr(self, name) < 0:
                raise UserError(f"--{name.replace('_', '-')} must be >= 0")
        if self.save_optimizer not in ("full", "none"):
            raise UserError(f"--save-optimizer {self.save_optimizer!r}: use full or none")
        if self.dist_timeout <= 0:
            raise UserError(f"--dist-timeout {self.dist_timeout} must be > 0 seconds")
        if self.warmup is not None and self.warmup < 0:
            raise UserError("--warmup must be >= 0")
        lr_ok = self.lr is None or self.lr > 0
        if not (lr_ok and (self.min_lr is None or 0 <= self.min_lr <= (self.lr or math.inf))):
            raise UserError(f"--lr {self.lr} must be > 0 and --min-lr {self.min_lr} in [0, lr]")


@dataclass(frozen=True)
class RunConfig:
    """Everything a run is made of; saved in every checkpoint."""

    model: ModelConfig
    data: DataConfig
    train: TrainConfig
    engine: EngineConfig
    precision: PrecisionConfig
    optim: OptimConfig
    # LoRA on a frozen base (fitgpt/adapters); off by default, and in checkpoints made before it
    adapter: AdapterConfig = field(default_factory=AdapterConfig)

    def __post_init__(self) -> None:
        if self.train.micro_batch is None:  # not given: decided here, where the model is known
            train = dataclasses.replace(self.train, micro_batch=default_micro_batch(self.model))
            object.__setattr__(self, "train", train)

    def flops_per_token(self) -> float:
        """The model FLOPs per token this run trains (the step log's TFLOP/s and MFU, the
        compile decision's run length): the family's count of the whole model trained, or of
        LoRA adapters on it frozen (model/family.py Family.flops_per_token)."""
        a = self.adapter
        return self.model.flops_per_token(adapter_elements(self.model, a) if a.active else None)

    def to_dict(self) -> dict:
        return {f.name: dataclasses.asdict(getattr(self, f.name)) for f in dataclasses.fields(self)}

    @classmethod
    def from_dict(cls, d: dict) -> RunConfig:
        """The RunConfig `to_dict` made, every field there (a checkpoint's config, perhaps of
        an older fitgpt, is read by train/resume.py)."""
        return cls(
            model=ModelConfig.from_dict(d["model"]),
            data=DataConfig(**d["data"]),
            train=TrainConfig(**d["train"]),
            engine=EngineConfig(**d["engine"]),
            precision=PrecisionConfig(**d["precision"]),
            optim=OptimConfig(**d["optim"]),
            adapter=AdapterConfig(**d.get("adapter", {})),
        )


# a RunConfig's parts by name, each with its config class (a checkpoint's meta.json, a command
# line's flags and a resume's checks go part by part)
PARTS = {
    "model": ModelConfig,
    "data": DataConfig,
    "train": TrainConfig,
    "engine": EngineConfig,
    "precision": PrecisionConfig,
    "optim": OptimConfig,
    "adapter": AdapterConfig,
}
