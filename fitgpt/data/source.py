"""The data interface the trainer sees: samples addressed by a global index.

A SampleSource maps any sample index j >= 0 to seq_len+1 tokens (inputs are the first seq_len,
targets the last seq_len). Sources handle epochs themselves (j past one epoch wraps into the
next, reshuffled), so a run can never run out of data mid-training.

The BatchLoader turns sources into micro-batches. Micro-batch k of data-parallel rank r holds
global samples k·b·W + r·b + [0, b): the union over ranks of micro-batch k is the same global
batch whatever the world size W, which is what makes W=2 training equal W=1 training on the
same global batch, and gradient accumulation 4×2 equal 1×8. Each rank reads only its rows.
Under context parallelism (`--context-parallel C`) the C ranks of a group read the same rows
(r is their data rank) and each keeps its slice of the tokens, [c·S/C, (c+1)·S/C) for its CP
index c; the segments stay whole rows (the attention mask and positions are the row's).
"""

from __future__ import annotations

from typing import NamedTuple, Protocol

import numpy as np
import torch
from torch import Tensor

from fitgpt.model.packing import segment_positions

__all__ = ["Batch", "BatchLoader", "SampleSource", "segment_positions", "splitmix64"]


class Batch(NamedTuple):
    """One micro-batch, as the loader hands it to the loop and the loop to the engine.

    segments is None for token streams (one document stream per row: nothing to keep apart, and
    the model runs exactly as without it); packed chat data (packed.py) carries its segment ids
    so the model keeps each sample's attention and positions to itself (model/packing.py). A
    plain (inputs, targets) pair is read as a Batch without segments (Batch(*pair))."""

    inputs: Tensor  # int64 [b, S] ([b, S/C] under context parallelism: this rank's slice)
    targets: Tensor  # int64 [b, S] (the same); -1: not trained on
    segments: Tensor | None = None  # int64 [b, S], the sample each token belongs to (whole)


class SampleSource(Protocol):
    seq_len: int
    vocab_size: int

    def get(self, idx: np.ndarray) -> np.ndarray:
        """Samples `idx` (int64 [n]) as int64 [n, seq_len + 1]."""
        ...


class BatchLoader:
    """Deterministic, resumable micro-batches of one rank; position counts micro-batches."""

    def __init__(
        self,
        source: SampleSource,
        micro_batch: int,
        rank: int = 0,
        world: int = 1,
        position: int = 0,
        cp_rank: int = 0,
        cp: int = 1,
    ) -> None:
        self.source, self.micro_batch, self.rank, self.world = source, micro_batch, rank, world
        self.position = position
        self.cp_rank, self.cp = cp_rank, cp  # which of C slices of every row's tokens

    def indices(self, k: int) -> np.ndarray:
        start = k * self.micro_batch * self.world + self.rank * self.micro_batch
        return np.arange(start, start + self.micro_batch, dtype=np.int64)

    def next(self) -> Batch:
        """The next micro-batch on the CPU: segments only where the source packs samples."""
        inputs, targets, segments = self.next_with_segments()
        if self.cp > 1:  # this rank's tokens (their targets counted here: engine/base.py)
            n = inputs.shape[1] // self.cp
            cut = slice(self.cp_rank * n, (self.cp_rank + 1) * n)
            inputs, targets = inputs[:, cut].contiguous(), targets[:, cut].contiguous()
        return Batch(inputs, targets, segments if self.packed else None)

    @property
    def packed(self) -> bool:
        return hasattr(self.source, "get_packed")

    def next_with_segments(self) -> tuple[Tensor, Tensor, Tensor]:
        """(inputs, targets, segments), int64 [b, S] each on the CPU.

        segments numbers the samples packed into each row (0, 1, ...: a new sample starts a new
        id), for attention that stays inside a sample (token t may see token u only where
        segments[t] == segments[u]). Packed chat data (packed.py) has several per row, and its
        targets are -1 on every token outside the assistant's replies and at each sample's
        first token; a stream source (text: documents joined, Megatron's default) is one
        segment per row, all zeros.
        """
        idx = self.indices(self.position)
        self.position += 1
        if self.packed:
            tokens, keep, segment = self.source.get_packed(idx)
            targets = tokens[:, 1:].copy()
            counted = (keep[:, 1:] != 0) & (segment[:, 1:] == segment[:, :-1])
            targets[~counted] = -1
            return (
                torch.from_numpy(np.ascontiguousarray(tokens[:, :-1])),
                torch.from_numpy(targets),
                torch.from_numpy(segment[:, :-1].astype(np.int64)),
            )
        tokens = torch.from_numpy(np.ascontiguousarray(self.source.get(idx)))
        segments = torch.zeros(tokens.shape[0], tokens.shape[1] - 1, dtype=torch.int64)
        return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous(), segments

    def state_dict(self) -> dict:
        return {"position": self.position, "micro_batch": self.micro_batch, "world": self.world}

    def load_state_dict(self, state: dict) -> None:
        """Continue where a loader stopped, also one of another micro-batch size or world size:
        the position is re-counted from the global samples consumed."""
        from fitgpt.errors import UserError

        samples = int(state["position"]) * state.get("micro_batch", self.micro_batch)
        samples *= state.get("world", self.world)
        per_step = self.micro_batch * self.world
        if samples % per_step:
            raise UserError(
                f"the run consumed {samples} samples, not a multiple of --micro-batch "
                f"{self.micro_batch} × {self.world} ranks; resume with a micro-batch and rank "
                "count whose product divides it"
            )
        self.position = samples // per_step


def splitmix64(x: np.ndarray) -> np.ndarray:
    """A stateless 64-bit hash: counter-based randomness, so sample j is O(1) to regenerate."""
    x = x.astype(np.uint64, copy=True)
    with np.errstate(over="ignore"):
        x += np.uint64(0x9E3779B97F4A7C15)
        x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return x ^ (x >> np.uint64(31))
