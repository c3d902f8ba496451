"""One chunk's state on one rank: flat buffers whose placement is an attribute, not a code path.

Shape legend: n the chunk's parameter count, N = n padded to a multiple of world·ALIGN, s = N/W
the shard of one rank. Padded coordinates throughout; the padding stays zero forever.

Buffers, by ZeRO stage (a stage shards everything the stages below it shard):
  weight       [N] working dtype   the model's parameters are views into it. Stage 3: resident
                                   only between gather() and release() (storage resized to 0).
  weight_shard [s] working dtype   stage 3: this rank's persistent slice; else a view of weight.
                                   Streamed chunks (--offload-params cpu): the persistent slice
                                   lives in pinned host RAM and `weight` is resident only while
                                   its block runs, as under stage 3.
  grad         [N] working dtype   stages 0-1: the params' .grad are views, autograd accumulates
                                   micro-batches into it in place. Stages 2-3: absent.
  grad_shard   [s] working dtype   stage 1: reduce-scatter target of the last micro-batch;
                                   stages 2-3: accumulator of every micro-batch's reduce-scatter.
  master, exp_avg, exp_avg_sq      fp32 over the optimizer range: [N] at stage 0, else [s].
                                   Live on `opt_device` (GPU or host: the offload tier). With
                                   fp32 compute on the same device, master aliases the weights.
                                   Compact formats (plan.compact): none of these; `compact`
                                   (engine/formats/compact.py) holds the state in its formats
                                   instead.

A chunk also owns its optimizer (torch's fused AdamW over views of master and the moments, one
param group per weight-decay range; a compact chunk's CompactState steps the same kernel) and its
in-flight state between the engine's parts: the handle of a weight fetch in flight
(engine/chunked/fetch.py).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor, nn

from fitgpt.engine.chunked.placement import ChunkPlan
from fitgpt.engine.comm import Peers
from fitgpt.engine.config import OptimConfig
from fitgpt.engine.formats.compact import CompactState, Scratch
from fitgpt.engine.host.pinned import PinnedArena


class Chunk:
    def __init__(
        self,
        plan: ChunkPlan,
        *,
        rank: int,
        dtype: torch.dtype,
        device: torch.device,
        pinned: PinnedArena | None = None,
    ) -> None:
        """The buffers `plan` (engine/chunked/placement.py) says this chunk has, on this rank."""
        spec = self.spec = plan.spec
        self.n, self.N, self.s = spec.numel, plan.N, plan.shard
        self.lo, self.hi = rank * self.s, (rank + 1) * self.s  # this rank's shard
        # the ZeRO stage as this chunk's placement says it (engine/chunked/placement.py ChunkPlan)
        shard_opt = self.shard_opt = plan.shard_opt
        self.shard_grads, self.shard_weights = plan.shard_grads, plan.weights == "sharded"
        self.gathers_updated = plan.gathers_updated
        self.streamed = plan.streamed  # weights homed in host RAM, streamed in per use
        self.transient_weight = self.shard_weights or self.streamed  # freed between uses
        self.opt_lo, self.opt_hi = (self.lo, self.hi) if shard_opt else (0, self.N)
        self.dtype, self.device = dtype, device
        self.opt_device = device if plan.home == "device" else torch.device("cpu")

        self.offloaded = plan.offloaded  # state homed on the offload tier (host memory)
        # nvme tier: the fp32 state lives in files; these host buffers hold it only between
        # alloc_state() and free_state() (storage resized to 0 and back, as stage-3 weights)
        self.on_disk = plan.on_disk
        self._alloc_weights(pinned)
        self._alloc_grads(shard_opt)
        # [0, decay_end) of the optimizer range gets weight decay (layout puts decayed params first)
        self.decay_end = max(0, min(spec.decay_numel, self.opt_hi) - self.opt_lo)
        self.compact: CompactState | None = None  # build_optimizer(): compact formats' state
        self._alloc_opt_state(shard_opt, plan)
        self.grads_seen = 0  # params whose gradient is complete in the current backward

        self.optimizer: torch.optim.AdamW | None = None  # build_optimizer(), once state exists
        self.fetch_work = None  # handle of this chunk's weight gather / host→device copy in flight
        # the ranks this chunk is reduced and sharded over (chunk_build.py sets it)
        self.peers: Peers | None = None

    # ---- construction ------------------------------------------------------------------------
    def _alloc_weights(self, pinned: PinnedArena | None) -> None:
        """weight [N] and the parameters cut from it; weight_shard [s] (its own buffer, pinned
        host RAM for a streamed chunk, else a view of weight)."""
        self.weight = torch.zeros(self.N, dtype=self.dtype, device=self.device)
        self.resident = True
        # The model's parameters: views into the flat buffer (they share its storage, so resizing
        # the storage to 0 and back frees and restores every parameter at once). They are cut
        # from a `.data` alias, which has its own autograd version counter: the engine's writes
        # into `weight` (a stage-3 re-gather before backward, the optimizer's update) are then
        # not mistaken for in-place edits of tensors autograd saved in forward.
        alias = self.weight.data
        self.params = [
            nn.Parameter(alias[s.offset : s.offset + s.numel].view(s.shape))
            for s in self.spec.slots
        ]
        if self.streamed:
            assert pinned is not None
            self.weight_shard = pinned.zeros(self.s, self.dtype)
        elif self.shard_weights:
            self.weight_shard = torch.zeros(self.s, dtype=self.dtype, device=self.device)
        else:
            self.weight_shard = self.weight[self.lo : self.hi]

    def _alloc_grads(self, shard_opt: bool) -> None:
        """grad [N] (stages 0-1; the params' .grad are views of it) and grad_shard [s]."""
        self.grad: Tensor | None = None
        if not self.shard_grads:
            self.grad = torch.zeros(self.N, dtype=self.dtype, device=self.device)
            for p, slot in zip(self.params, self.spec.slots):
                p.grad = self.grad[slot.offset : slot.offset + slot.numel].view(slot.shape)
        self.grad_shard = (
            torch.zeros(self.s, dtype=self.dtype, device=self.device) if shard_opt else None
        )

    def _alloc_opt_state(self, shard_opt: bool, plan: ChunkPlan) -> None:
        """fp32 master and the two moments over the optimizer range, on opt_device; a chunk in
        compact formats (plan.compact) gets them in build_optimizer()
        (engine/formats/compact.py)."""
        m, opt_device = self.opt_hi - self.opt_lo, self.opt_device
        self.plan = plan
        self.master_aliases_weight = plan.master == "alias"
        self.master = self.exp_avg = self.exp_avg_sq = None
        self.state_resident = True
        if plan.compact:
            return
        if self.master_aliases_weight:
            # fp32 compute: the working weights are the master copy, no second fp32 buffer.
            self.master = self.weight_shard if shard_opt else self.weight
        else:
            # host-homed state stays pageable: only the host optimizer's staging buffers take
            # part in DMA, and torch's pinned allocator would round each chunk up to a power of 2
            self.master = torch.zeros(m, dtype=torch.float32, device=opt_device)
        self.exp_avg = torch.zeros(m, dtype=torch.float32, device=opt_device)
        self.exp_avg_sq = torch.zeros(m, dtype=torch.float32, device=opt_device)

    def bind(self, model: nn.Module) -> None:
        """Make the chunk's parameter views the model's parameters (replacing meta tensors)."""
        for slot, p in zip(self.spec.slots, self.params):
            owner, _, leaf = slot.name.rpartition(".")
            setattr(model.get_submodule(owner), leaf, p)

    @torch.no_grad()
    def init_weights(self, init: Callable[[str, Tensor], None], scratch: Scratch | None) -> None:
        """Each parameter made whole in fp32 by `init(name, tensor)` (the model's seeded
        initialiser), then scattered into the chunk's buffers: the same initial weights at every
        world size, stage and tier. Transient: one chunk in fp32 (4·N bytes), freed on return.
        A compact chunk splits its master through `scratch` (its tier's)."""
        flat = torch.zeros(self.N, dtype=torch.float32, device=self.device)
        for s in self.spec.slots:
            init(s.name, flat[s.offset : s.offset + s.numel].view(s.shape))
        self.weight.copy_(flat)
        if self.transient_weight:
            self.weight_shard.copy_(flat[self.lo : self.hi])
        if self.compact is not None:
            # the same bf16 values the copies above wrote (both are torch's cast)
            self.compact.load(flat[self.opt_lo : self.opt_hi], None, None, self.home_weights,
                              scratch)  # fmt: skip
        elif not self.master_aliases_weight:
            self.master.copy_(flat[self.opt_lo : self.opt_hi])
        self.free_weight()  # stage 3: the full block weights live only while gathered

    @property
    def home_weights(self) -> Tensor:
        """The working weights over this rank's optimizer range, which its update writes: the
        full weights (stage 0), else this rank's shard (pinned host RAM for a streamed chunk)."""
        return self.weight_shard if (self.shard_opt or self.streamed) else self.weight

    @property
    def group_ranges(self) -> list[tuple[int, int]]:
        """The optimizer's param groups as [lo, hi) of the optimizer range: decayed, then not."""
        d, m = self.decay_end, self.opt_hi - self.opt_lo
        return [r for r in ((0, d), (d, m)) if r[1] > r[0]]

    def build_optimizer(self, ocfg: OptimConfig) -> torch.optim.AdamW | None:
        """torch's fused AdamW over the chunk's flat fp32 views; its moments are our buffers.
        Must run while the state is resident (a disk-homed chunk: before its first write-out).
        A chunk in compact formats gets its CompactState instead (None returned)."""
        d, m = self.decay_end, self.opt_hi - self.opt_lo
        if self.plan.compact:
            groups = [(0, d, ocfg.weight_decay), (d, m, 0.0)]
            groups = [g for g in groups if g[1] > g[0]]
            self.compact = CompactState(
                m, self.plan.master, self.plan.moments, self.opt_device, groups,
                (ocfg.beta1, ocfg.beta2), ocfg.eps,
            )  # fmt: skip
            self.optimizer = None
            return None
        views = [
            (self.master[:d], self.exp_avg[:d], self.exp_avg_sq[:d], ocfg.weight_decay),
            (self.master[d:m], self.exp_avg[d:m], self.exp_avg_sq[d:m], 0.0),
        ]
        views = [v for v in views if v[0].numel() > 0]
        groups = [{"params": [p], "weight_decay": w} for p, *_, w in views]
        opt = torch.optim.AdamW(
            groups, lr=0.0, betas=(ocfg.beta1, ocfg.beta2), eps=ocfg.eps, fused=True
        )
        for p, ea, es, _ in views:
            opt.state[p] = {
                "step": torch.zeros((), dtype=torch.float32, device=p.device),
                "exp_avg": ea,
                "exp_avg_sq": es,
            }
        self.optimizer = opt
        return opt

    # ---- ranges --------------------------------------------------------------------------
    @property
    def opt_grad(self) -> Tensor:
        """The reduced gradient over the optimizer range (valid after the step's reductions)."""
        return self.grad if self.grad_shard is None else self.grad_shard

    def unpadded(self, lo: int, hi: int) -> tuple[int, int]:
        return min(lo, self.n), min(hi, self.n)

    # ---- stage 3: weights resident only while used -------------------------------------------
    def alloc_weight(self) -> None:
        """Give the flat weight its storage back (contents undefined until gathered). The
        parameters and any views autograd saved share this storage, so they see the data again."""
        if not self.resident:
            self.weight.untyped_storage().resize_(self.N * self.weight.element_size())
            self.resident = True

    def free_weight(self) -> None:
        """Return the full weights' memory to the allocator (frees N·2 bytes in bf16)."""
        if self.resident and self.transient_weight:
            self.weight.untyped_storage().resize_(0)
            self.resident = False

    # ---- nvme tier: optimizer state resident only while swapped in ---------------------------
    def state_tensors(self) -> dict[str, Tensor]:
        """The optimizer state's buffers by name (the disk tier keeps one file each)."""
        if self.compact is not None:
            return self.compact.tensors()
        return {"master": self.master, "exp_avg": self.exp_avg, "exp_avg_sq": self.exp_avg_sq}

    @property
    def step_count(self) -> Tensor | None:
        """The optimizer's step counter (a 0-d tensor), None for a chunk with no state here."""
        if self.compact is not None:
            return self.compact.step_count
        states = list(self.optimizer.state.values()) if self.optimizer is not None else []
        return states[0]["step"] if states else None

    def set_step(self, step: float) -> None:
        if self.compact is not None:
            self.compact.step_count.fill_(step)
        elif self.optimizer is not None:
            for st in self.optimizer.state.values():
                st["step"].fill_(step)

    def alloc_state(self) -> None:
        """Give the state its host storage back (contents undefined until read in); the
        optimizer's views share the storage, so they see it again."""
        if not self.state_resident:
            for t in self.state_tensors().values():
                t.untyped_storage().resize_(t.numel() * t.element_size())
            self.state_resident = True

    def free_state(self) -> None:
        """Return a disk-homed chunk's host copy of its state (12 bytes per element in fp32)."""
        if self.on_disk and self.state_resident:
            for t in self.state_tensors().values():
                t.untyped_storage().resize_(0)
            self.state_resident = False

    def bytes_by_kind(self) -> dict[str, dict[str, int]]:
        """{device type: {kind: bytes}} actually held now."""

        def nb(t: Tensor | None) -> int:
            return 0 if t is None else t.numel() * t.element_size()

        dev = self.device.type
        opt = "nvme" if self.on_disk else ("host" if self.offloaded else self.opt_device.type)
        out: dict[str, dict[str, int]] = {dev: {}, opt: {}}
        out[dev]["weights"] = nb(self.weight) if self.resident else 0
        if self.streamed:
            out.setdefault("host", {})["weights"] = nb(self.weight_shard)
        elif self.shard_weights:
            out[dev]["weight_shards"] = nb(self.weight_shard)
        out[dev]["grads"] = nb(self.grad) + nb(self.grad_shard)
        if self.compact is not None:
            master, moments = self.compact.master_nbytes(), self.compact.moments_nbytes()
        else:
            master = 0 if self.master_aliases_weight else nb(self.master)
            moments = nb(self.exp_avg) + nb(self.exp_avg_sq)
        if master:
            out[opt]["master_weights"] = out[opt].get("master_weights", 0) + master
        out[opt]["optimizer"] = out[opt].get("optimizer", 0) + moments
        return out
