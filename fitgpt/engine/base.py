"""What the training loop may ask of an engine, and nothing more.

The loop hands an engine micro-batches and a learning rate and gets back one StepStats; it never
touches parameters, gradients or optimizer state. Engines differ in where that state lives
(replicated, sharded across ranks, tiered over GPU/CPU/NVMe), not in this interface.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from fitgpt.engine.layout import ChunkSpec
from fitgpt.engine.state_io import WeightSource
from fitgpt.model import DecoderLM, ModelConfig

if TYPE_CHECKING:
    from fitgpt.engine.compile import CompiledRegions

Batch = tuple[Tensor, Tensor]  # (inputs, targets), int64 [b, S] on the CPU


def batch_to(t: Tensor, device: torch.device) -> Tensor:
    """A batch tensor on the compute device: CPU batches go through pinned memory, without a host
    sync; one already there (a caller that moved it first) is taken as it is."""
    if device.type == "cuda" and t.device.type == "cpu":
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)


@dataclass
class StepStats:
    loss: float  # mean training loss of the step's micro-batches, over all ranks
    grad_norm: float  # global norm before clipping (inf/nan when fp16 overflowed)
    loss_scale: float  # 1.0 unless fp16
    skipped: bool  # fp16 overflow: the update was not applied


class Engine(ABC):
    model_cfg: ModelConfig
    layout: list[ChunkSpec]
    device: torch.device
    compiled: CompiledRegions | None = None  # --compile on: the model's compiled regions

    @abstractmethod
    def train_step(self, micro_batches: list[Batch], lr: float) -> StepStats:
        """Forward and backward over every micro-batch, then one optimizer update."""

    @abstractmethod
    def eval_loss(self, batch: Batch) -> float:
        """Mean loss of one batch (no gradients), averaged over ranks."""

    @abstractmethod
    def save_state(self, folder: Path, optimizer: bool = True) -> None:
        """Write this rank's share of weights and (unless optimizer=False) optimizer state into
        `folder` (state_io)."""

    @abstractmethod
    def load_state(self, folder: Path | WeightSource, extra: dict, optimizer: bool = True) -> None:
        """Load weights and optimizer state saved by any engine at any world size; with
        optimizer=False only the weights, the optimizer and loss scaler starting fresh. A
        WeightSource (a Hugging Face model read in place) is loaded as a weights-only folder."""

    @abstractmethod
    def extra_state(self) -> dict:
        """Small JSON-able state (optimizer step count, loss scaler) for the checkpoint's meta."""

    @abstractmethod
    def memory_report(self) -> dict[str, dict[str, int]]:
        """Bytes held by this rank: {device: {kind: bytes}}, kinds as in fitgpt/plan/memory.py."""

    @abstractmethod
    def inference_model(self) -> DecoderLM:
        """A plain model with the current weights on this rank's device, for sampling."""

    def describe(self) -> dict:
        """What this engine is and where its state lives, for logs and benchmark records:
        {"engine": name, "placement": one line, "bytes": {tier: bytes held now}, "streams":
        the work that runs beside the compute stream}."""
        held = {tier: sum(kinds.values()) for tier, kinds in self.memory_report().items()}
        return {"engine": type(self).__name__, "placement": "", "bytes": held, "streams": []}

    def breakdown(self) -> dict[str, float]:
        """Seconds per phase of the last step and run counters; engines without phases: {}."""
        return {}

    def compile_report(self) -> dict | None:
        """--compile on: regions, graph breaks, recompiles and compile seconds so far
        (engine/compile.py); None when nothing is compiled."""
        return None if self.compiled is None else self.compiled.report()

    def close(self) -> None:
        """Stop background threads and remove scratch files (the nvme tier's); idempotent. Also
        done at interpreter exit, but not after os._exit or a kill."""
        return None  # engines without threads or files have nothing to release
