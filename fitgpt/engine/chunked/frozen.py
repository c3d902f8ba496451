"""A frozen base's blocks (an adapter run's: fitgpt/adapters), held packed and brought in per use.

Each transformer block's frozen weights are one FrozenChunk: its bytes in the run's base format
(engine/formats/frozen_base.py: fp32, bf16, int8 or NF4) on the GPU (`device` tier) or in pinned host RAM
(`host` tier, streamed), and a working buffer in the compute dtype the block's parameters are
views of, filled (unpacked) only while the block runs: weights are dequantised per block per use
and freed after. A frozen chunk has no gradient buffer and no optimizer state.

The streaming is the chunk engine's (engine/chunked/fetch.py WeightFetch): the same hooks order
it (block i+1's copy overlaps block i's compute, on the copy stream) and a FrozenChunk answers
the attributes WeightFetch reads of a Chunk (resident, weight, weight_shard, lo/hi, streamed,
alloc_weight, free_weight, fetch_work). FrozenFetch adds what a frozen chunk needs beyond a
fetch: the unpack once the bytes have landed, and the free of block i+1 once the backward has
reached block i (there is no gradient hook to free it, as reduce.py does for a trained chunk).

Sharded (--base-sharded, over the data-parallel ranks): each rank holds [lo, hi) of every
block's packed bytes on its tier and the fetch all-gathers them, as for a ZeRO stage-3 block.

Bytes, per block of p parameters: held p·b (b: 4, 2, ~1 or ~0.52 by format) on its tier; while
it runs, p·w for the working copy (w = 2 in bf16) plus, streamed, p·b on the GPU for the landed
bytes until unpacked. Peak: two blocks' working copies (the running block and the prefetched).
"""

from __future__ import annotations

import warnings

import torch
from torch import Tensor, nn

from fitgpt.engine.chunked.fetch import WeightFetch
from fitgpt.engine.comm import Peers
from fitgpt.engine.formats.frozen_base import ALIGN, BlockCodec
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
        on_disk: bool = False,
        peers: Peers | None = None,
    ) -> None:
        """peers: the ranks the packed bytes are sharded over (None: held whole here); the
        fetch gathers over them (a Chunk's `peers`, as WeightFetch reads it)."""
        self.peers = peers = peers or Peers(None, 1, 0)
        rank, world = peers.rank, peers.world
        self.spec, self.codec, self.streamed, self.device = spec, codec, streamed, device
        # a disk block: a streamed block whose host copy is a staging buffer of DiskBlocks',
        # filled from its file ahead of use (weight_shard None while it has none)
        self.on_disk = on_disk
        self.disk: DiskBlocks | None = None  # set by DiskBlocks
        # packed bytes, padded to a multiple of world·ALIGN; sharded over `world` ranks (each
        # holds [lo, hi) and all-gathers the rest per use, as stage 3 gathers a trained block)
        self.N = -(-codec.nbytes // (world * ALIGN)) * world * ALIGN
        self.s = self.N // world
        self.lo, self.hi = rank * self.s, (rank + 1) * self.s
        self.transient = streamed or world > 1  # the full bytes only while the block runs
        self.fetch_work = None
        # weight: the packed bytes on the device; weight_shard: this rank's home of them
        # (pinned host RAM, a disk block's staging buffer, its shard on the device, or the
        # bytes themselves on an unsharded device block). work: the working weights, the
        # packed bytes themselves where nothing is unpacked (codec.direct)
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
        self.weight_shard = self.weight
        if on_disk:
            self.weight_shard = None
        elif streamed:
            self.weight_shard = pinned.zeros(self.s, torch.uint8)
        elif world > 1:
            self.weight_shard = torch.zeros(self.s, dtype=torch.uint8, device=device)
        self.resident = not self.transient
        if self.transient:
            self._resize(self.weight, 0)  # frees N bytes on the device until fetched
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
        if self.transient and self.resident:
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
            if self.transient:
                self._resize(self.weight, 0)
                self.resident = False
        self.unpacked = True

    @torch.no_grad()
    def load(self, flat: Tensor) -> None:
        """The block's weights `flat` [n] (fp32, any device) packed into their home. Quantising
        runs on the compute device (one block's fp32 there at a time)."""
        packed = torch.zeros(self.N, dtype=torch.uint8, device=self.device)
        self.codec.pack(flat.to(self.device, torch.float32), packed)
        if self.on_disk:
            self.disk.write(self, packed[self.lo : self.hi].cpu())
            return
        self.weight_shard.copy_(packed[self.lo : self.hi])
        if self.transient:
            self.free_weight()
        elif not self.codec.direct:
            self.free_weight()  # the working copy is stale: unpacked again at the next use


class FrozenFetch(WeightFetch):
    """WeightFetch for frozen chunks: a chunk is ready once unpacked; block i+1 is freed when
    the backward reaches block i (its own backward is done)."""

    disk: DiskBlocks | None = None

    def prefetch(self, c: FrozenChunk) -> None:
        if c.unpacked:
            return
        if c.on_disk and not c.resident:  # its bytes from the disk first (read ahead, mostly)
            self.disk.stage(c)
            super().prefetch(c)
            self.disk.copying(c, c.fetch_work)
            return
        super().prefetch(c)

    def ensure(self, c: FrozenChunk) -> None:
        super().ensure(c)
        c.unpack()

    def register(self, modules: list[nn.Module], blocks: list[FrozenChunk]) -> list:
        # the first block's input (the frozen embedding's output) needs no gradient, so torch
        # warns that its backward pre-hook fires when the gradients of the block's outputs are
        # computed: that is when it is meant to fire (before the block's backward)
        warnings.filterwarnings("ignore", message="Full backward hook is firing when gradients")
        hooks = super().register(modules, [[c] for c in blocks])  # one chunk per frozen block
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
        disk_blocks: int = 0,
        nvme_path: str = "",
        peers: Peers | None = None,
    ) -> None:
        """peers: the ranks the base's bytes are sharded over (None: each holds them whole)."""
        peers = peers or Peers(None, 1, 0)
        specs = [c for c in layout if c.name.startswith("block.")]
        self.pinned = PinnedArena(device.type == "cuda")
        first_host, first_disk = len(specs) - host_blocks, len(specs) - disk_blocks
        self.chunks = [
            FrozenChunk(
                s,
                BlockCodec(s, fmt, working),
                i >= first_host,
                device,
                self.pinned,
                on_disk=i >= first_disk,
                peers=peers,
            )
            for i, s in enumerate(specs)
        ]
        on_disk = [c for c in self.chunks if c.on_disk]
        self.disk = DiskBlocks(nvme_path, on_disk, self.pinned, device) if on_disk else None
        self.by_name = {c.spec.name: c for c in self.chunks}
        for c in self.chunks:
            for slot, p in zip(c.spec.slots, c.params):
                owner, _, leaf = slot.name.rpartition(".")
                model.get_submodule(owner)._parameters[leaf] = p
        streams = any(c.streamed for c in self.chunks)
        self.fetch = FrozenFetch(peers, device, None, streams)
        self.fetch.disk = self.disk
        self.hooks = []
        # else every block is whole on the device, as it runs: nothing to bring in
        if streams or peers.world > 1 or not all(c.codec.direct for c in self.chunks):
            self.hooks = self.fetch.register(list(model.blocks), self.chunks)

    def release(self) -> None:
        """Every block's working copy and landed bytes freed (after a step's backward: block 0
        and the last are still held)."""
        for c in self.chunks:
            c.free_weight()

    def held_bytes(self) -> dict[str, int]:
        """Bytes held between uses, by tier: the packed blocks on the device and in host RAM."""
        out = {"device": 0, "host": 0, "disk": 0}
        for c in self.chunks:
            out["disk" if c.on_disk else "host" if c.streamed else "device"] += c.s
        if self.disk is not None:
            out["host"] += sum(b.numel() for b in self.disk.ring)  # the staging buffers
        return out

    def close(self) -> None:
        for h in self.hooks:
            h.remove()
        self.hooks = []
        if self.disk is not None:
            self.disk.close()  # removes the files
        self.pinned.close()


class DiskBlocks:
    """The disk tier of a frozen base: each disk block's packed bytes in a file of its own
    (engine/host/nvme.py's store, under --nvme-path; removed at exit), read into one of RING
    pinned staging buffers ahead of use, then streamed to the GPU as a host block is.

    Read-ahead: staging block i for its fetch starts the read of the next disk block in the
    same direction (i+1 in the forward, i-1 in the backward), so one read overlaps one block's
    compute. A staging buffer is reused only once the host→device copy out of it has landed
    (its event waited on: a host sync, on a copy issued two blocks earlier). Costs: RING × the
    largest block's packed bytes of pinned host RAM; every disk block read once per forward
    and once per backward (the disk's bandwidth, ~2 GB/s, against PCIe's ~25-50)."""

    RING = 3  # the block being copied, the one being read ahead, and one free to start

    def __init__(self, path: str, chunks: list[FrozenChunk], pinned: PinnedArena, device) -> None:
        from fitgpt.engine.host.nvme import NvmeStore

        self.chunks = chunks
        self.store = NvmeStore(path, need_bytes=sum(c.s for c in chunks))
        for c in chunks:  # this rank's shard of each block (all of it on one rank)
            c.disk = self
            self.store.alloc(self._key(c), c.s)
        big = max(c.s for c in chunks)
        self.ring = [pinned.zeros(big, torch.uint8) for _ in range(self.RING)]
        self.owner: list[FrozenChunk | None] = [None] * self.RING
        self.landed: list = [None] * self.RING  # the copy out of each buffer, if on CUDA
        self.reads: dict[int, object] = {}  # id(chunk) -> the read's future
        self.next, self.last = 0, -1

    @staticmethod
    def _key(c: FrozenChunk) -> str:
        return f"frozen-{c.spec.index}"

    def write(self, c: FrozenChunk, packed: Tensor) -> None:
        self.store.write(self._key(c), packed).result()

    def _start(self, c: FrozenChunk, keep: FrozenChunk | None = None) -> None:
        """Begin reading c's bytes into a staging buffer, round robin, never `keep`'s (the
        block being fetched now); nothing if c has its bytes or their read is under way."""
        if c.weight_shard is not None or id(c) in self.reads:
            return
        i = self.next
        if self.owner[i] is not None and self.owner[i] is keep:
            i = (i + 1) % self.RING
        self.next = (i + 1) % self.RING
        if self.landed[i] is not None:
            self.landed[i].synchronize()  # host sync: the GPU has read this buffer out
            self.landed[i] = None
        if self.owner[i] is not None:
            self.owner[i].weight_shard = None
        self.owner[i] = c
        c.weight_shard = self.ring[i][: c.s]
        self.reads[id(c)] = self.store.read(self._key(c), c.weight_shard)

    def stage(self, c: FrozenChunk) -> None:
        """c's bytes in host RAM (read now, or waited for), and the next disk block's read
        started."""
        self._start(c)
        fut = self.reads.pop(id(c), None)
        if fut is not None:
            fut.result()
        at = self.chunks.index(c)
        step = 1 if at > self.last else -1
        self.last = at
        if 0 <= at + step < len(self.chunks):
            self._start(self.chunks[at + step], keep=c)

    def copying(self, c: FrozenChunk, work) -> None:
        """The copy out of c's staging buffer was issued (`work`: its handle)."""
        event = getattr(work, "event", None)
        if event is not None:
            self.landed[self.owner.index(c)] = event

    def close(self) -> None:
        for fut in self.reads.values():
            fut.result()
        self.reads = {}
        self.store.close()
