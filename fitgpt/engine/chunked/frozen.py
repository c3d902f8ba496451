"""A frozen base's blocks (an adapter run's: fitgpt/adapters), held packed and brought in per use.

Each transformer block's frozen weights are one FrozenChunk: its bytes in the run's base format
(adapters/quant.py: fp32, bf16, int8 or NF4) on the GPU (`device` tier) or in pinned host RAM
(`host` tier, streamed), and a working buffer in the compute dtype the block's parameters are
views of, filled (unpacked) only while the block runs: weights are dequantised per block per use
and freed after. A frozen chunk has no gradient buffer and no optimizer state.

The streaming is the chunk engine's (engine/chunked/fetch.py WeightFetch): the same hooks order
it (block i+1's copy overlaps block i's compute, on the copy stream) and a FrozenChunk answers
the attributes WeightFetch reads of a Chunk (resident, weight, weight_shard, lo/hi, streamed,
alloc_weight, free_weight, fetch_work). FrozenFetch adds what a frozen chunk needs beyond a
fetch: the unpack once the bytes have landed, and the free of block i+1 once the backward has
reached block i (there is no gradient hook to free it, as reduce.py does for a trained chunk).

Bytes, per block of p parameters: held p·b (b: 4, 2, ~1 or ~0.52 by format) on its tier; while
it runs, p·w for the working copy (w = 2 in bf16) plus, streamed, p·b on the GPU for the landed
bytes until unpacked. Peak: two blocks' working copies (the running block and the prefetched).
"""

from __future__ import annotations

import warnings

import torch
from torch import Tensor, nn

from fitgpt.adapters.quant import BlockCodec
from fitgpt.engine.chunked.fetch import WeightFetch
from fitgpt.engine.comm import Peers
from fitgpt.engine.host.pinned import PinnedArena
from fitgpt.engine.layout import ChunkSpec


class FrozenChunk:
    def __init__(
        self,
        spec: ChunkSpec,
        codec: BlockCodec,
        streamed: bool,
        device: torch.device,
        pinned: PinnedArena,
    ) -> None:
        self.spec, self.codec, self.streamed, self.device = spec, codec, streamed, device
        self.N = codec.nbytes  # packed bytes (WeightFetch copies [lo, hi) of them)
        self.lo, self.hi = 0, self.N
        self.fetch_work = None
        # weight: the packed bytes on the device; weight_shard: their home (pinned host RAM, or
        # the same bytes on the device tier)
        # weight: the packed bytes on the device; weight_shard: their home (pinned host RAM, or
        # the same bytes on the device tier). work: the working weights, the packed bytes
        # themselves where nothing is unpacked (codec.direct)
        self.weight = torch.zeros(self.N, dtype=torch.uint8, device=device)
        direct = codec.direct
        self.work = (
            self.weight.view(codec.working)
            if direct
            else torch.zeros(spec.numel, dtype=codec.working, device=device)
        )
        # the block's frozen parameters: views of the working buffer, cut from a .data alias (the
        # unpack's writes are not edits autograd tracks: engine/chunked/chunk.py says why), before
        # the buffers are freed (a view is cut within a storage's bounds)
        alias = self.work.data
        self.params = [
            nn.Parameter(alias[s.offset : s.offset + s.numel].view(s.shape), requires_grad=False)
            for s in spec.slots
        ]
        self.resident = True
        self.weight_shard = self.weight
        if streamed:
            self.weight_shard = pinned.zeros(self.N, torch.uint8)
            self._resize(self.weight, 0)  # frees N bytes on the device until fetched
            self.resident = False
        if not direct:
            self._resize(self.work, 0)  # unpacked per use
        self.unpacked = direct and self.resident

    @staticmethod
    def _resize(t: Tensor, n: int) -> None:
        t.untyped_storage().resize_(n * t.element_size())

    # ---- what WeightFetch calls ----------------------------------------------------------------
    def alloc_weight(self) -> None:
        """Storage for the packed bytes to land in (contents undefined until the copy)."""
        if not self.resident:
            self._resize(self.weight, self.N)
            self.resident = True

    def free_weight(self) -> None:
        """The block has run: its working copy freed (p·w bytes), and a streamed block's
        landed bytes (p·b)."""
        if not self.codec.direct and self.unpacked:
            self._resize(self.work, 0)
        if self.streamed and self.resident:
            self._resize(self.weight, 0)
            self.resident = False
        self.unpacked = self.codec.direct and self.resident

    # ---- the frozen chunk's own ----------------------------------------------------------------
    def unpack(self) -> None:
        """The working weights from the landed bytes (on the compute stream, after the fetch's
        wait); a streamed block's bytes are freed at once, the working copy is what runs."""
        if self.unpacked:
            return
        if not self.codec.direct:
            self._resize(self.work, self.spec.numel)
            self.codec.unpack(self.weight, self.work)
            if self.streamed:
                self._resize(self.weight, 0)
                self.resident = False
        self.unpacked = True

    @torch.no_grad()
    def load(self, flat: Tensor) -> None:
        """The block's weights `flat` [n] (fp32, any device) packed into their home. Quantising
        runs on the compute device (one block's fp32 there at a time)."""
        packed = torch.zeros(self.N, dtype=torch.uint8, device=self.device)
        self.codec.pack(flat.to(self.device, torch.float32), packed)
        self.weight_shard.copy_(packed)
        if self.streamed:
            self.free_weight()
        elif not self.codec.direct:
            self.free_weight()  # the working copy is stale: unpacked again at the next use


class FrozenFetch(WeightFetch):
    """WeightFetch for frozen chunks: a chunk is ready once unpacked; block i+1 is freed when
    the backward reaches block i (its own backward is done)."""

    def prefetch(self, c: FrozenChunk) -> None:
        if not c.unpacked:
            super().prefetch(c)

    def ensure(self, c: FrozenChunk) -> None:
        super().ensure(c)
        c.unpack()

    def register(self, modules: list[nn.Module], blocks: list[FrozenChunk]) -> list:
        # the first block's input (the frozen embedding's output) needs no gradient, so torch
        # warns that its backward pre-hook fires when the gradients of the block's outputs are
        # computed: that is when it is meant to fire (before the block's backward)
        warnings.filterwarnings("ignore", message="Full backward hook is firing when gradients")
        hooks = super().register(modules, blocks)
        for module, nxt in zip(modules, blocks[1:]):

            def done_after(_m, _grad, nxt=nxt):
                nxt.free_weight()

            hooks.append(module.register_full_backward_pre_hook(done_after))
        return hooks


class FrozenStore:
    """The frozen blocks of an adapter run's model: one FrozenChunk a block, its first
    `len(blocks) - host_blocks` on the device, the last `host_blocks` streamed from pinned host
    RAM; the model's block parameters replaced by the chunks' views, the fetch hooks on its
    blocks. `layout`: the whole model's chunks (the base's)."""

    def __init__(
        self,
        model: nn.Module,
        layout: list[ChunkSpec],
        fmt: str,
        working: torch.dtype,
        host_blocks: int,
        device: torch.device,
    ) -> None:
        specs = [c for c in layout if c.name.startswith("block.")]
        self.pinned = PinnedArena(device.type == "cuda")
        first_host = len(specs) - host_blocks
        self.chunks = [
            FrozenChunk(s, BlockCodec(s, fmt, working), i >= first_host, device, self.pinned)
            for i, s in enumerate(specs)
        ]
        self.by_name = {c.spec.name: c for c in self.chunks}
        for c in self.chunks:
            for slot, p in zip(c.spec.slots, c.params):
                owner, _, leaf = slot.name.rpartition(".")
                model.get_submodule(owner)._parameters[leaf] = p
        streams = any(c.streamed for c in self.chunks)
        self.fetch = FrozenFetch(Peers(None, 1, 0), device, None, streams)
        self.hooks = []
        if streams or not all(c.codec.direct for c in self.chunks):  # else nothing to bring in
            self.hooks = self.fetch.register(list(model.blocks), self.chunks)

    def release(self) -> None:
        """Every block's working copy and landed bytes freed (after a step's backward: block 0
        and the last are still held)."""
        for c in self.chunks:
            c.free_weight()

    def held_bytes(self) -> dict[str, int]:
        """Bytes held between uses, by tier: the packed blocks on the device and in host RAM."""
        out = {"device": 0, "host": 0}
        for c in self.chunks:
            out["host" if c.streamed else "device"] += c.N
        return out

    def close(self) -> None:
        for h in self.hooks:
            h.remove()
        self.hooks = []
        self.pinned.close()
