"""State I/O of the chunked engine: checkpoints in and out, and a plain model for sampling.

The files are state_io's: per chunk and rank, the rank's range [lo, hi) of the chunk's unpadded
flat buffer, fp32 master weights and (full checkpoints) the two Adam moments, readable at any
world size, stage and tier. This rank's range is its optimizer range (stage 0: the whole chunk,
written by rank 0 alone; stages 1-3: its shard s = N/W), cut to the unpadded n.

Host memory: chunks are written and read one at a time. A disk-homed chunk's state is read in
(12 bytes per element), handed over, and freed before the next, so a save or a load needs no
more host RAM than a step; compressed moments are decoded into the shared fp32 scratch and
saved as fp32. Loading ends with the weights rebuilt from the master copy: an all-gather of the
shards (stages 1-2), or only this rank's shard (stage 3, streamed chunks: fetched before use).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import torch
from torch import Tensor

from fitgpt.engine.chunked.chunk import Chunk
from fitgpt.engine.chunked.disk_tier import DiskTier
from fitgpt.engine.comm import Peers
from fitgpt.engine.formats.compact import Scratch
from fitgpt.engine.state_io import KINDS, Piece, StateReader, write_pieces
from fitgpt.model import DecoderLM, ModelConfig, build_model


class ChunkStateIO:
    def __init__(
        self,
        chunks: list[Chunk],
        disk: DiskTier | None,
        peers: Peers,
        replicated: bool,
        scratch: dict[str, Scratch],
        device: torch.device | None = None,
        to_full: Callable[[Piece], list[Piece]] | None = None,
    ) -> None:
        # replicated: every rank holds the whole state (stage 0; engine/chunked/placement.py)
        self.chunks, self.disk, self.peers, self.replicated = chunks, disk, peers, replicated
        self.device = device or torch.device("cpu")  # where whole_chunks' collectives run
        self.scratch = scratch  # the compact formats' pieces, per tier (engine/formats/compact.py)
        # a piece of this rank's layout as pieces of the full one (expert parallelism: an
        # experts' chunk holds E/P experts, fitgpt/parallel/experts.py); None: the same layout
        self.to_full = to_full

    def _scratch(self, c: Chunk) -> Scratch:
        return self.scratch["host" if c.offloaded else "device"]

    @staticmethod
    def writes(c: Chunk) -> bool:
        """Whether this rank writes chunk c: its shard, or the whole chunk from the first rank
        of the group holding the same copy (stage 0: rank 0; an experts' chunk under expert
        parallelism: the first rank of its replica group, one per E/P experts)."""
        return c.shard_opt or c.peers.rank == 0

    def save(self, folder: Path, optimizer: bool) -> None:
        """Write this rank's pieces into `folder` (a rank with none writes no index)."""
        if any(self.writes(c) for c in self.chunks):
            write_pieces(folder, self.peers.rank, self.pieces(KINDS if optimizer else KINDS[:1]))

    def pieces(self, kinds: tuple[str, ...]) -> Iterator[Piece]:
        """Each chunk's state as a Piece, one at a time: a disk-homed chunk is read in, written
        by write_pieces, and freed before the next, so saving needs no more host RAM than a step."""
        for c in self.chunks:
            piece = self._piece(c, kinds) if self.writes(c) else None
            if piece is None:
                continue
            yield from (self.to_full(piece) if self.to_full is not None else [piece])
            c.free_state()

    def _piece(self, c: Chunk, kinds: tuple[str, ...]) -> Piece | None:
        """This rank's range of chunk c as a Piece (None: the range is padding only); the caller
        frees a disk-homed chunk's state (c.free_state()) once the piece is used."""
        lo, hi = c.unpadded(c.opt_lo, c.opt_hi)
        k = hi - lo
        if k <= 0:
            return None
        if c.on_disk:
            self.disk.read_in(c)
        if c.compact is not None:
            # compact formats are saved decoded, as fp32 (12·k bytes of host RAM for the
            # time of this chunk's write): any run can load them into any format
            state = c.compact.export(c.home_weights, k, self._scratch(c))
            tensors = dict(zip(kinds, state))
        else:
            tensors = dict(zip(kinds, (c.master[:k], c.exp_avg[:k], c.exp_avg_sq[:k])))
            # safetensors exports through numpy, which pins a storage's size for good: a
            # disk-homed chunk's buffers must stay resizable, so it hands over copies
            tensors = {n: (t.clone() if c.on_disk else t.float().cpu()) for n, t in tensors.items()}
        return Piece(c.spec.index, lo, hi, tensors)

    def whole_chunks(self, kinds: tuple[str, ...]) -> Iterator[tuple[Chunk, dict[str, Tensor]]]:
        """Each chunk's whole unpadded state on every rank ({kind: [n] fp32 CPU}), one chunk at
        a time: stages 1-3 all-gather the shards over the data-parallel group (collective:
        every rank iterates it). Tensor parallelism's save gathers these over its group next."""
        for c in self.chunks:
            piece = self._piece(c, kinds)
            if not c.shard_opt or c.peers.world == 1:
                assert piece is not None and piece.hi - piece.lo == c.n
                yield c, piece.tensors
                c.free_state()
                continue
            whole = {}
            for kind in kinds:
                shard = torch.zeros(c.s, dtype=torch.float32, device=self.device)
                if piece is not None:
                    shard[: piece.hi - piece.lo].copy_(piece.tensors[kind])
                full = torch.empty(c.N, dtype=torch.float32, device=self.device)
                c.peers.all_gather(full, shard, async_op=False)
                whole[kind] = full[: c.n].cpu()
            if piece is not None:
                c.free_state()
            yield c, whole

    @torch.no_grad()
    def load(self, folder: Path, step: float, optimizer: bool, reader=None) -> None:
        """Weights and optimizer state; with optimizer=False the weights alone, the moments zero
        (and `step` given as 0: the optimizer's step count as in a fresh run). `reader`: what
        reads the ranges (default a StateReader of `folder`; tensor parallelism's TPReader)."""
        reader = reader or StateReader(folder)
        for c in self.chunks:
            lo, hi = c.unpadded(c.opt_lo, c.opt_hi)
            k = max(0, hi - lo)
            c.alloc_state()  # a disk-homed chunk: its buffers back, filled from the checkpoint
            if c.compact is not None:
                self._load_compact(c, reader, lo, hi, optimizer)
            else:
                for kind, buf in zip(KINDS, (c.master, c.exp_avg, c.exp_avg_sq)):
                    buf.zero_()  # the padding beyond k stays zero; so do fresh moments
                    if k and (optimizer or kind == "master"):  # straight into the buffer
                        reader.read(c.spec.index, kind, lo, hi, out=buf[:k])
            c.set_step(step)
            self._weights_from_master(c)
            if c.on_disk:
                self.disk.write_out(c)

    def _load_compact(self, c: Chunk, reader: StateReader, lo: int, hi: int, opt: bool) -> None:
        """fp32 values from the checkpoint, stored in the chunk's formats; a split master writes
        its working weights (this rank's range) as it goes."""
        k = max(0, hi - lo)
        got = {
            kind: reader.read(c.spec.index, kind, lo, hi) if k and (opt or kind == "master")
            else None
            for kind in KINDS
        }  # fmt: skip
        master = got["master"] if got["master"] is not None else torch.zeros(0)
        c.compact.load(master, got["exp_avg"], got["exp_avg_sq"], c.home_weights,
                       self._scratch(c))  # fmt: skip

    def _weights_from_master(self, c: Chunk) -> None:
        """The working weights from the master (a compact chunk wrote its range already), and
        the full weights gathered from the shards where they are resident."""
        if c.compact is not None:
            if c.gathers_updated:
                c.peers.all_gather(c.weight, c.weight_shard, async_op=False)
            return
        if c.master_aliases_weight:
            src = c.weight_shard if c.shard_opt else c.weight
        else:
            src = c.master
        if not c.shard_opt and not c.streamed:
            c.weight.copy_(src)
            return
        c.weight_shard.copy_(src)
        if not c.transient_weight:
            c.peers.all_gather(c.weight, c.weight_shard, async_op=False)

    @torch.no_grad()
    def inference_model(
        self,
        cfg: ModelConfig,
        device: torch.device,
        dtype: torch.dtype,
        ensure: Callable,
        unsplit: Callable[[str, Tensor], Tensor] | None = None,
    ) -> DecoderLM:
        """A fresh model holding the full current weights; `ensure(c)` brings a chunk's full
        weights in (stage 3 and streamed chunks), one chunk at a time; `unsplit(name, t)` (tensor
        parallelism, collective) makes a parameter whole from every TP rank's part."""
        model = build_model(cfg).to(device, dtype)
        params = dict(model.named_parameters())
        for c in self.chunks:
            if c.transient_weight:
                ensure(c)
            for s in c.spec.slots:
                w = c.weight[s.offset : s.offset + s.numel].view(s.shape)
                params[s.name].copy_(w if unsplit is None else unsplit(s.name, w))
            c.free_weight()
        return model.eval()
