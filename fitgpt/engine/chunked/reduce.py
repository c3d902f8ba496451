"""Gradient reduction: every chunk's gradient summed over the W data-parallel ranks, overlapped
with the rest of the backward.

A post-accumulate-grad hook on every parameter counts the chunk's finished gradients; when the
last one lands, the chunk's backward is complete for this micro-batch and its reduction is
launched asynchronously (on GPU: on NCCL's stream, which the compute stream waits for later, no
host sync). Per ZeRO stage, with n the chunk's parameters, N = n padded, s = N/W:
  stage 0  grad [N] accumulates every micro-batch in place (the params' .grad are views of it);
           at the last micro-batch it is all-reduced: 2·(W-1)/W·N elements sent per rank.
  stage 1  the same accumulation; at the last micro-batch it is reduce-scattered into
           grad_shard [s]: (W-1)/W·N elements sent.
  stage 2  no persistent full gradient: at every micro-batch autograd's per-parameter gradients
  and 3    are flattened into a transient [N], reduce-scattered into a transient [s], freed, and
           the [s] is added into the accumulator grad_shard when the collective completes.
The 1/W of the data-parallel mean is folded into the backward's loss scaling, so collectives sum.

At most MAX_INFLIGHT reductions are in flight: launching one more first completes the oldest.
This bounds the transient buffers of stages 2-3 at (MAX_INFLIGHT + 1) · (N + s) working-dtype
elements of the largest chunk (the memory model in plan/memory.py prices the same figure).

When a chunk's last reduction of the step completes, its reduced gradient is final: `on_final`
(the speculative update, engine/chunked/update.py) hears of it then, during the rest of the
backward.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from fitgpt.engine.chunked.chunk import Chunk
from fitgpt.engine.chunked.placement import MAX_INFLIGHT
from fitgpt.engine.comm import Peers

if TYPE_CHECKING:
    from fitgpt.engine.transforms.tp_state import TPGradNorm


# the `keep` of a pending cross-machine reduction (HSDP): it holds no transient
ACROSS: tuple = ("across machines",)


class GradReducer:
    def __init__(
        self,
        peers: Peers,
        dtype: torch.dtype,
        device: torch.device,
        replicas: Peers | None = None,
    ) -> None:
        """Each chunk says how its gradient is reduced (Chunk.shard_grads, shard_opt: its
        placement's ZeRO stage) and over which ranks (Chunk.peers: `peers`, the data-parallel
        group, or under expert parallelism the experts' replica group); `peers` sums the loss
        and the norm. `replicas` (HSDP, --shard-within node): `peers` are one machine's ranks,
        and a chunk's gradient reduced over them is then all-reduced over its replicas on the
        other machines (the same shard of every machine: 2·(M-1)/M·s elements over the link
        between machines, where a flat reduce-scatter over every rank sends (W-1)/W·N through
        it)."""
        self.peers, self.dtype, self.device, self.replicas = peers, dtype, device, replicas
        # (handle, label, on completion, tensors the collective reads or writes until then, the
        # chunk whose gradient is final once it completes, or None)
        self.pending: deque[tuple[object, str, Callable[[], None] | None, tuple, Chunk | None]]
        self.pending = deque()
        self.last_micro = True  # set by the step: stages 0-1 reduce at the last micro-batch only
        self.on_final: Callable[[Chunk], None] | None = None  # hears of each final gradient
        # tensor parallelism (engine/transforms/tp_state.py): the norm's squares weighted and summed
        # over the TP group, with each chunk's replicated ranges
        self.tp_norm: TPGradNorm | None = None
        self.tp_ranges: list[list[tuple[int, int]]] = []
        # sequence parallelism: the replicated gradients summed over the TP group first
        self.sp_sync: Callable[[Chunk], None] | None = None

    def register(self, chunks: list[Chunk]) -> list:
        """Hook every parameter of every chunk; returns the handles (removed at close)."""
        hooks = []
        for c in chunks:
            for p in c.params:
                hooks.append(p.register_post_accumulate_grad_hook(lambda _p, c=c: self._on_grad(c)))
        return hooks

    def _on_grad(self, c: Chunk) -> None:
        c.grads_seen += 1
        if c.grads_seen < len(c.params):
            return
        c.grads_seen = 0  # the chunk's backward is complete for this micro-batch
        if self.sp_sync is not None and (c.shard_grads or self.last_micro):
            self.sp_sync(c)  # blocking: a few elements per block, before the DP reduction
        c.free_weight()  # stage 3 and streamed chunks: the weights' memory is freed here
        if c.shard_grads:
            self._reduce_scatter_now(c)
        elif self.last_micro:
            if c.shard_opt:
                work = c.peers.reduce_scatter(c.grad_shard, c.grad)
                self._launch(work, f"reduce-scatter gradients of {c.spec.name}", final=c)
            else:
                work = c.peers.all_reduce(c.grad)
                self._launch(work, f"all-reduce gradients of {c.spec.name}", final=c)

    def _reduce_scatter_now(self, c: Chunk) -> None:
        """Stages 2-3: flatten this micro-batch's gradients, reduce-scatter them into a transient
        shard, and free the full gradients; the shard is added to the accumulator on completion."""
        full = torch.empty(c.N, dtype=self.dtype, device=self.device)
        torch.cat([p.grad.reshape(-1) for p in c.params], out=full[: c.n])
        full[c.n :].zero_()
        for p in c.params:
            p.grad = None  # autograd's per-parameter gradients are freed here
        part = torch.empty(c.s, dtype=self.dtype, device=self.device)
        work = c.peers.reduce_scatter(part, full)
        label = f"reduce-scatter gradients of {c.spec.name}"
        final = c if self.last_micro else None
        self._launch(work, label, lambda: c.grad_shard.add_(part), keep=(full, part), final=final)

    def _launch(
        self,
        work,
        label: str,
        finish: Callable[[], None] | None = None,
        keep: tuple = (),
        final: Chunk | None = None,
    ) -> None:
        self.pending.append((work, label, finish, keep, final))
        while len(self.pending) > MAX_INFLIGHT:
            self._finish_one()

    def _finish_one(self) -> None:
        work, label, finish, keep, final = self.pending.popleft()
        self.peers.wait(work, label)  # on GPU: the compute stream waits, no host sync
        if finish is not None:
            finish()  # the transients in _keep are freed when this entry is dropped
        if final is not None and self.replicas is not None and keep is not ACROSS:
            # HSDP: the machine's sum of the chunk's gradient, summed over the machines next
            # (in flight like the others; the chunk is final when it completes)
            work = self.replicas.all_reduce(final.opt_grad)
            label = f"all-reduce gradients of {final.spec.name} across machines"
            self.pending.append((work, label, None, ACROSS, final))
            return
        if final is not None and self.on_final is not None:
            self.on_final(final)

    def finish_all(self) -> None:
        """Complete every reduction still in flight (after the last backward)."""
        while self.pending:
            self._finish_one()

    def totals(self, loss_avg: Tensor, chunks: list[Chunk]) -> tuple[Tensor, Tensor]:
        """The step's loss averaged over ranks and the squared global gradient norm, as fp32
        device scalars (no host sync here). Stages 1-3: each rank holds a different shard of the
        reduced gradient, so the squares are summed over ranks too."""
        sq = torch.zeros((), device=self.device, dtype=torch.float32)
        # expert parallelism: the experts' chunks differ between ranks (each holds E/P of them,
        # on the W/P ranks of its replica group), so every chunk's square is summed over the
        # whole world, divided by the number of ranks holding the same elements
        mixed = any(c.peers is not self.peers for c in chunks)
        for c in chunks:
            if self.tp_norm is None:
                c_sq = torch.linalg.vector_norm(c.opt_grad, dtype=torch.float32).square()
            else:
                c_sq = self.tp_norm.local_sq(c.opt_grad, self.tp_ranges[c.spec.index], c.opt_lo)
            sq += c_sq / c.peers.world if mixed and not c.shard_opt else c_sq
        # the squares of every shard (HSDP: one machine's ranks hold them all)
        if self.peers.world > 1 and (mixed or any(c.shard_opt for c in chunks)):
            self.peers.wait(self.peers.all_reduce(sq), "all-reduce grad norm")
        self.mean(loss_avg)
        if self.tp_norm is not None:
            sq = self.tp_norm.total(sq)
        return loss_avg, sq

    def mean(self, t: Tensor) -> Tensor:
        """t averaged over every data-parallel rank, in place (HSDP: over the machine's, then
        over the replicas)."""
        world = 1
        for peers in (self.peers, self.replicas):
            if peers is not None and peers.world > 1:
                peers.wait(peers.all_reduce(t), "all-reduce loss")
                world *= peers.world
        if world > 1:
            t /= world
        return t

    @staticmethod
    def zero_grads(chunks: list[Chunk]) -> None:
        """Clear the accumulated gradients for the next step."""
        for c in chunks:
            if c.grad is not None:
                c.grad.zero_()
            elif c.grad_shard is not None:
                c.grad_shard.zero_()
