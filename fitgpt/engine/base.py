"""What the training loop may ask of an engine, and nothing more.

The loop hands an engine micro-batches and a learning rate and gets back one StepStats; it never
touches parameters, gradients or optimizer state. Engines differ in where that state lives
(replicated, sharded across ranks, tiered over GPU/CPU/NVMe), not in this interface.

The step's loss is the mean over every counted target (not -1) of the step, over its
micro-batches and data-parallel ranks, and its gradients are that loss's: micro-batch i's mean
loss is weighted by c_i·n·W / C (c_i its counted targets, n micro-batches, W ranks, C the
step's count), so the engines' usual scale/(n·W) and their sum over ranks give Σ c_i·loss_i / C
(loss_weights). Chat data (-1 on every non-assistant token) needs it: a micro-batch of few
answer tokens would otherwise weigh as much as a full one, and one of none would give NaN. A
mixture's load-balancing term is no mean over targets: each micro-batch's weighs the same
(step_share).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from fitgpt.data.source import Batch  # (inputs, targets, segments | None): data's type
from fitgpt.engine.layout import ChunkSpec
from fitgpt.engine.state_io import WeightSource
from fitgpt.model import DecoderLM, ModelConfig

if TYPE_CHECKING:
    from fitgpt.engine.transforms.compile import CompiledRegions

# An engine reads every micro-batch as Batch(*b): a plain (inputs, targets) pair is a Batch
# without segments.


def loss_weights(
    micro_batches: list[Batch], device: torch.device, reduce: Callable[[Tensor], None], world: int
) -> tuple[Tensor, Tensor]:
    """(weights [n] fp32, the step's counted targets over ranks, int64 scalar) on `device`
    (module docstring). The counts are taken where the targets are (the CPU: no device work),
    and `reduce` sums the total over the data-parallel ranks in place: one 8-byte all-reduce
    per step, queued on the device, no host sync. Always, not only for data with -1 targets:
    it costs that much, and ranks never have to agree on whether to run it. Data with every
    target counted gets c_i·n·W = C exactly, weights exactly 1.0 (integers, divided in
    float64): the loss and gradients bit for bit as before. C = 0 gives weights 0 (the engine
    then skips the update: StepStats.counted)."""
    counts = torch.stack([(Batch(*b).targets != -1).sum() for b in micro_batches])
    counts = batch_to(counts, device)
    total = counts.sum()
    reduce(total)
    n = len(micro_batches)
    weights = (counts * (n * world)).double() / total.clamp(min=1).double()
    return weights.float(), total


def weighted(loss: Tensor, weight: Tensor) -> Tensor:
    """loss·weight, 0 (value and gradient) where the weight is 0: a micro-batch with no counted
    target, whose mean loss is NaN (0/0), adds nothing instead of NaN."""
    return torch.where(weight > 0, loss, torch.zeros_like(loss)) * weight


def step_share(model, loss_of: Callable[[], Tensor], weight: Tensor) -> Tensor:
    """Micro-batch i's share of the step's loss, fp32: `loss_of()` (the model's forward on it,
    its mean loss over its counted targets) weighted by `weight` (loss_weights), plus the term of
    a mixture of experts that is no such mean at weight 1 (MoeLlama.take_aux_term: coef·aux,
    the load-balancing loss over every token of the forward, whatever its targets). The engines
    scale each share by 1/(n·W) and sum them over the micro-batches and ranks, so the step's
    aux is the mean of each micro-batch's own on each rank: a micro-batch without a counted
    target (chat data without an assistant token) still balances its router, and the
    coefficient weighs the same at any --grad-accum, data-parallel width and answer length.
    Weighted by the counted targets instead (the model's sum weighted whole, as before), it
    vanished there and grew with a micro-batch's share of the answers. A step with no counted
    target on any rank is still skipped whole (StepStats.counted), its aux with it. The one
    place the engines (ddp.py, chunked/engine.py) compose a micro-batch's loss."""
    take = getattr(model, "take_aux_term", None)
    if take is None:  # a dense model: its loss is the token mean alone
        return weighted(loss_of().float(), weight)
    model.aux_apart = True  # the forward leaves coef·aux apart, for take_aux_term
    try:
        loss = weighted(loss_of().float(), weight)
    finally:
        model.aux_apart = False
    term = take()
    return loss if term is None else loss + term


def token_mean(
    loss_of: Callable[[Batch], Tensor],
    batches: list[Batch],
    device: torch.device,
    reduce: Callable[[Tensor], None],
) -> float:
    """Evaluation's loss: Σ c_i·loss_i / Σ c_i over `batches` and the ranks (`reduce` sums a
    device tensor over them in place), loss_of(batch) a batch's mean loss. One host sync."""
    sums = torch.zeros(2, dtype=torch.float64, device=device)
    for b in batches:
        b = Batch(*b)
        count = batch_to((b.targets != -1).sum(), device)
        loss = loss_of(b).double()
        sums += torch.stack([torch.where(count > 0, loss, 0.0) * count, count.double()])
    reduce(sums)
    return (sums[0] / sums[1]).item()  # host sync; NaN when nothing is counted


def batch_to(t: Tensor, device: torch.device) -> Tensor:
    """A batch tensor on the compute device: CPU batches go through pinned memory, without a host
    sync; one already there (a caller that moved it first) is taken as it is."""
    if device.type == "cuda" and t.device.type == "cpu":
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)


@dataclass
class StepStats:
    # mean loss over the step's counted targets, all micro-batches and ranks (a mixture's:
    # plus coef times the mean of the micro-batches' aux, step_share)
    loss: float
    grad_norm: float  # global norm before clipping (inf/nan when fp16 overflowed)
    loss_scale: float  # 1.0 unless fp16
    skipped: bool  # fp16 overflow: the update was not applied
    # targets the loss counted, over ranks (read with the loss as fp32: exact to 2^24 per
    # step); 0: no update (nothing to learn); -1: not reported
    counted: int = -1


class FrozenWeights(ABC):
    """The weights of a run that do not train (an adapter run's base, fitgpt/adapters): loaded
    from the run's --init-from source at its start and on every resume, never saved (its
    checkpoints name the source instead). `layout`: the whole model's chunks, as the source's
    checkpoint or Hugging Face folder holds them."""

    layout: list[ChunkSpec]

    @abstractmethod
    def load_state(self, folder: Path | WeightSource, extra: dict, optimizer: bool = False) -> None:
        """The weights of `folder` (a checkpoint folder, weights only, or a WeightSource)."""


class Engine(ABC):
    model_cfg: ModelConfig
    layout: list[ChunkSpec]  # the chunks of what trains (and what save_state writes)
    device: torch.device
    compiled: CompiledRegions | None = None  # --compile on: the model's compiled regions
    # an adapter run's frozen base (load it through this); None where the whole model trains
    frozen: FrozenWeights | None = None

    @abstractmethod
    def train_step(self, micro_batches: list[Batch], lr: float) -> StepStats:
        """Forward and backward over every micro-batch, then one optimizer update."""

    @abstractmethod
    def eval_loss(self, batches: list[Batch]) -> float:
        """Mean loss over the counted targets of `batches` and of every rank's (no gradients);
        NaN if none is counted."""

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
        (engine/transforms/compile.py); None when nothing is compiled."""
        return None if self.compiled is None else self.compiled.report()

    def close(self) -> None:
        """Stop background threads and remove scratch files (the nvme tier's); idempotent. Also
        done at interpreter exit, but not after os._exit or a kill."""
        return None  # engines without threads or files have nothing to release
