"""Activation checkpointing, applied to a built model from outside (the model file knows nothing).

`full`: each block keeps only its input for backward and recomputes its forward there. That costs
one extra forward per block (about a third more FLOPs) and saves ~34·b·s·h bytes per layer.

`cpu` (`checkpoint_blocks(model, to_host=True)`): the same recompute, and the one tensor a block
still keeps, its input (b·s·h elements of w bytes: 2 under the zero engine's bf16 weights, 4 for
the fp32 residual stream of the ddp engine's autocast), is kept in pinned host memory instead.

- What is kept where. GPU: a block input lives only until its copy to the host has landed
  (forward), and again from the start of block i+1's recompute, when it is prefetched, until
  block i's backward ends (backward): about two block inputs at a time instead of n_layer. Pinned
  host memory: n_layer·b·s·h·w bytes for each micro-batch whose forward has run and whose
  backward has not (one, in both engines, which run each micro-batch's backward before the next
  forward). torch's pinned-memory cache rounds every buffer up to a power of two, so budget up to
  twice that; pinned pages are never swapped out.
- What it costs. 2·b·s·h·w bytes over PCIe per block per micro-batch (one way in forward, back in
  backward), 2·b·s·h·2 under bf16. The copies run on a side stream, so they overlap compute: a
  block's forward does ~24·b·s·h² FLOPs and moves b·s·h·w bytes, so its copy hides when
  h > w·R/(24·B), about 2000 for bf16 at R = 600 TFLOP/s and B = 25 GB/s (PCIe 4 x16). Narrower
  models wait on the link. The link is shared with the optimizer offload's traffic.
- When it pays: when activations, not weights or optimizer state, are what does not fit, i.e.
  when `full` still runs out of memory because n_layer block inputs are too many (long sequences,
  large micro-batches, deep models), and host RAM has the room. Otherwise use `full`: this only
  adds PCIe traffic and pinned RAM. Weights and optimizer state are ZeRO's and offload's job.

Why not `torch.autograd.graph.save_on_cpu(pin_memory=True)`: it copies on the compute stream, so
each block's next kernels wait for its copy, it brings nothing back ahead of need, and it copies
every saved tensor, the ALiBi bias all blocks share included. The hooks here copy on a side
stream, prefetch block i-1's input while block i recomputes, and leave CPU tensors and no-grad
tensors where they are.
"""

from __future__ import annotations

import functools
import weakref
from dataclasses import dataclass

import torch
from torch import Tensor, nn
from torch.autograd.graph import saved_tensors_hooks
from torch.utils.checkpoint import checkpoint


@dataclass(eq=False)
class _Stash:
    """One block input in pinned host memory, and the state of its way back."""

    device: torch.device
    host: Tensor  # pinned, the block input's shape and dtype
    landed: torch.cuda.Event  # recorded on the copy stream after the device→host copy
    prev: weakref.ref[_Stash] | None  # the previous block's stash in the same forward
    back: Tensor | None = None  # on the device, brought back ahead of need
    back_ready: torch.cuda.Event | None = None  # recorded after `back` was filled


class HostActivations:
    """The saved-tensor hooks of `checkpoint_blocks(model, to_host=True)`, one set per model.

    Around a checkpointed call they see only what the checkpoint itself keeps, the block's
    positional tensor inputs (torch's own hooks take over inside the block). CUDA tensors that
    need grad go to pinned host memory; everything else passes through untouched: CPU tensors
    (nothing to offload) and tensors that need no grad, like the ALiBi bias shared by every
    block (offloading it would copy one N·T·T tensor per block). Tensors passed by keyword are
    held by the checkpoint's closure and stay on the device; DecoderLM passes them
    positionally.
    """

    def __init__(self) -> None:
        self._copy_streams: dict[torch.device, torch.cuda.Stream] = {}
        self._last: weakref.ref[_Stash] | None = None  # the latest stash of this forward

    def hooks(self, first_block: bool) -> saved_tensors_hooks:
        """The context to run one checkpointed block call in; the first block starts a chain."""
        if first_block:
            self._last = None  # a new forward: never prefetch another micro-batch's inputs
        return saved_tensors_hooks(self.pack, self.unpack)

    def pack(self, t: Tensor) -> Tensor | _Stash:
        """Forward: start copying `t` to pinned host memory; do not wait for the copy."""
        if not (t.is_cuda and t.requires_grad):
            return t
        compute = torch.cuda.current_stream(t.device)
        side = self._copy_stream(t.device)
        side.wait_stream(compute)  # t is written by kernels already queued on the compute stream
        with torch.cuda.stream(side):
            host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
            host.copy_(t, non_blocking=True)  # asynchronous: no host-device sync
            landed = side.record_event()
        # t's GPU memory is freed when forward drops t, but the caching allocator must not reuse
        # it before the copy has read it: record_stream defers the reuse until then.
        t.record_stream(side)
        stash = _Stash(t.device, host, landed, self._last)
        self._last = weakref.ref(stash)
        return stash

    def unpack(self, packed: Tensor | _Stash) -> Tensor:
        """Backward, at the start of a block's recompute: its input on the device, and the
        previous block's input set on its way back so it has arrived when that block starts."""
        if isinstance(packed, Tensor):
            return packed
        x = self._bring_back(packed)
        prev = packed.prev() if packed.prev is not None else None
        if prev is not None and prev.back is None:
            self._prefetch(prev)
        return x

    def _bring_back(self, s: _Stash) -> Tensor:
        compute = torch.cuda.current_stream(s.device)
        if s.back is not None:
            compute.wait_event(s.back_ready)  # the device waits for the prefetch; the host does not
            x, s.back = s.back, None  # handed over: the stash holds no GPU memory any more
            return x
        compute.wait_event(s.landed)  # not prefetched (the last block): copy now, in stream order
        return s.host.to(s.device, non_blocking=True)

    def _prefetch(self, s: _Stash) -> None:
        compute = torch.cuda.current_stream(s.device)
        side = self._copy_stream(s.device)
        back = torch.empty(s.host.shape, dtype=s.host.dtype, device=s.device)
        side.wait_stream(compute)  # `back`'s memory may still be read by queued compute kernels
        with torch.cuda.stream(side):
            back.copy_(s.host, non_blocking=True)
            s.back_ready = side.record_event()
        back.record_stream(side)  # dropped unused (partial backward), it waits for the copy
        s.back = back  # one extra block input on the GPU, b·s·h·w bytes

    def _copy_stream(self, device: torch.device) -> torch.cuda.Stream:
        if device not in self._copy_streams:
            self._copy_streams[device] = torch.cuda.Stream(device=device)
        return self._copy_streams[device]


def checkpoint_blocks(model: nn.Module, to_host: bool = False, keep: int = 0) -> None:
    """Recompute every block but the last `keep` in backward; with `to_host`, keep the
    recomputed blocks' inputs in pinned host memory between forward and backward (see the
    module docstring for the costs).

    Why the last ones keep their activations (--keep-activations K): their backward runs first,
    so their saved sets are freed before the first recompute starts, and the peak is (n-K) block
    inputs plus K saved sets, never a recompute's set on top of the kept ones. Each kept block
    saves one more forward's worth of compute, ~1/n of the recompute's third of a step.

    Hooks registered on the blocks still run once per forward call, outside the checkpointed
    region, because we wrap `forward`, not `__call__`."""
    host = HostActivations() if to_host else None
    blocks = list(model.blocks)
    for i, block in enumerate(blocks[: len(blocks) - keep]):
        run = _Recompute(block, block.forward)

        @functools.wraps(run.inner)
        def forward(*args, _run=run, _first=i == 0, **kwargs):
            _run.in_forward = True
            try:
                if host is None:
                    return checkpoint(_run, *args, use_reentrant=False, **kwargs)
                with host.hooks(first_block=_first):
                    return checkpoint(_run, *args, use_reentrant=False, **kwargs)
            finally:
                _run.in_forward = False

        block.forward = forward


class _Recompute:
    """A block's forward as the checkpoint calls it: once in forward, again in backward.

    The recompute runs the block's Python code again, side effects included. A module that
    keeps something of its training forward for the loss (SparseMoe.route, the routing
    statistics of the aux loss) then keeps the recompute's copy, and the copy's graph keeps every
    tensor the recompute saved before it (the block's attention, its norms, the router): one
    layer's attention activations more for every sparse block already through its backward,
    held to the next forward (tests/test_moe_recompute.py measures the growth). Qwen3-MoE-30B at
    4 × 4096 tokens: ~0.4 GiB a layer by the planner's attention terms; the eager 4x H200 run of
    2026-11-28 ran out of memory 10-15 GiB above its plan. (Compiled blocks did not keep it:
    torch stops the recompute, by raising once the tensors it needs are back, before dynamo
    replays the attribute write.) So after a recompute, ended or stopped early, each module's
    `drop_forward_state()` forgets it. The recompute itself is left as it is: it must save the
    same tensors as the forward did, compiled or not."""

    def __init__(self, block: nn.Module, inner) -> None:
        self.block, self.inner = block, inner
        self.in_forward = False  # set by the wrapper around the checkpoint's first call

    def __call__(self, *args, **kwargs):
        if self.in_forward:
            return self.inner(*args, **kwargs)
        try:
            return self.inner(*args, **kwargs)
        finally:
            for m in self.block.modules():
                if (drop := getattr(m, "drop_forward_state", None)) is not None:
                    drop()  # memory freed here: the recompute's graph kept through the module
