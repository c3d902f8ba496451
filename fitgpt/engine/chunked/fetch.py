"""Weight fetch: a block's full weights brought in just before it runs, freed right after.

Two kinds of chunk keep their full weights `weight` [N] only while their block runs (the chunk's
`transient_weight`); between uses the storage is resized to 0 and the persistent copy is
`weight_shard` [s] (s = N/W):
  stage 3        a block's weights are sharded over the W ranks: fetching is an all-gather of
                 the shards (each rank receives (W-1)/W·N elements), launched asynchronously.
  streamed       --offload-params cpu: the shard lives in pinned host RAM; fetching is a
                 host→device copy of s elements on a side stream (`copy_stream`), then, on
                 several ranks, the same all-gather.
Module hooks order it, per block i (forward order): before block i's forward, wait for its
fetch and start block i+1's (prefetch: it overlaps block i's compute); after the forward, free
block i (the last block is kept: the backward needs it at once). Before block i's backward, wait
for its fetch and start block i-1's. The gradient hook (engine/chunked/reduce.py) frees the weights
once the chunk's backward is complete. Peak: two blocks' full weights resident at once.

A chunk whose fetch is in flight holds its handle in `c.fetch_work`; waiting on it makes the
compute stream wait (an NCCL handle or a recorded CUDA event): no host sync. On CPU runs the
host tier is the same memory and the copy is immediate.
"""

from __future__ import annotations

import torch
from torch import nn

from fitgpt.engine.chunked.chunk import Chunk
from fitgpt.engine.chunked.offload import HostOptimizer
from fitgpt.engine.comm import Peers


class WeightFetch:
    def __init__(
        self,
        peers: Peers,
        device: torch.device,
        host_opt: HostOptimizer | None,
        streams: bool,
    ) -> None:
        """streams: some chunk's weights are streamed from host RAM (a copy stream is made)."""
        self.peers, self.device, self.host_opt = peers, device, host_opt
        self.cuda = device.type == "cuda"
        self.copy_stream = torch.cuda.Stream(device) if streams and self.cuda else None

    def register(self, modules: list[nn.Module], blocks: list[list[Chunk]]) -> list:
        """Fetch/free hooks on each block's module, for its chunks (a sparse block's experts are
        a chunk of their own, fetched and freed with their block); returns the handles (removed
        at close)."""
        hooks = []
        for i, (module, cs) in enumerate(zip(modules, blocks)):
            nxt = blocks[i + 1] if i + 1 < len(blocks) else []
            prv = blocks[i - 1] if i > 0 else []
            last = not nxt

            def pre_forward(_m, _args, cs=cs, nxt=nxt):
                for c in cs:
                    self.ensure(c)
                for c in nxt:
                    self.prefetch(c)

            def post_forward(_m, _args, _out, cs=cs, last=last):
                if not last or not torch.is_grad_enabled():
                    for c in cs:
                        c.free_weight()  # the last block is needed again at once by backward

            def pre_backward(_m, _grad, cs=cs, prv=prv):
                for c in cs:
                    self.ensure(c)
                for c in prv:
                    self.prefetch(c)

            hooks += [
                module.register_forward_pre_hook(pre_forward),
                module.register_forward_hook(post_forward),
                module.register_full_backward_pre_hook(pre_backward),
            ]
        return hooks

    def prefetch(self, c: Chunk) -> None:
        """Start bringing c's full weights in (nothing if they are resident)."""
        if c.resident:
            return
        if self.host_opt is not None:
            self.host_opt.wait(c)  # a prefetch must not gather a shard the host is still updating
        c.alloc_weight()  # allocated on the compute stream; NCCL's stream waits on it at launch
        if c.streamed:
            c.fetch_work = self._stream_in(c)
            return
        c.fetch_work = c.peers.all_gather(c.weight, c.weight_shard)

    def ensure(self, c: Chunk) -> None:
        """c's full weights, resident and complete before the compute stream's next use."""
        self.prefetch(c)
        work, c.fetch_work = c.fetch_work, None
        if work is not None:
            self.peers.wait(work, f"all-gather weights of {c.spec.name}")

    def _stream_in(self, c: Chunk):
        """Host→device copy of a streamed chunk's weights (this rank's shard, then all-gathered
        across ranks), on the copy stream so it overlaps the block running now. Returns a handle
        whose wait() makes the compute stream wait for it (no host sync)."""
        if not self.cuda:
            shard = c.weight[c.lo : c.hi] if c.peers.world > 1 else c.weight
            shard.copy_(c.weight_shard)  # CPU runs: the host tier is the same memory, a copy
            return c.peers.all_gather(c.weight, shard)
        compute = torch.cuda.current_stream(self.device)
        self.copy_stream.wait_stream(compute)  # the weight's storage was allocated on `compute`
        with torch.cuda.stream(self.copy_stream):
            c.weight[c.lo : c.hi].copy_(c.weight_shard, non_blocking=True)
            if c.peers.world > 1:
                # launched from the copy stream, so NCCL's stream waits for the copy (it waits on
                # the stream current at launch) and the compute stream only where ensure() waits
                # for the gather. Making the compute stream wait for the copy here instead, as
                # this did before 2026-11-26, held the block running now (the prefetch comes
                # from its pre-hook) until the next block's host copy had landed: every
                # streamed block's PCIe time exposed on several ranks (4x H200:
                # benchmarks/results/x4_peers_h200_2026-11-26/README.md).
                return c.peers.all_gather(c.weight, c.weight[c.lo : c.hi])
            landed = torch.cuda.Event()
            landed.record(self.copy_stream)
        return _EventWork(landed)


class _EventWork:
    """A handle like a collective's: wait() makes the current stream wait for a recorded event."""

    def __init__(self, event: torch.cuda.Event) -> None:
        self.event = event

    def wait(self) -> bool:
        torch.cuda.current_stream().wait_event(self.event)
        return True
