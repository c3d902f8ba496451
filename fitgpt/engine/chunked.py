"""fitgpt's chunked engine (`--engine zero`): ZeRO stages 0-3 over flat per-chunk buffers.

Every piece of state lives in a Chunk (engine/chunk.py): one chunk per transformer block plus the
embedding and head chunks. The model's parameters are views into the chunks' flat working-dtype
buffers, so the model code never changes. Mixed precision keeps bf16/fp16 weights and gradients
for compute and fp32 master weights and Adam moments over each rank's optimizer range.

Communication, per step (W ranks):
  stage 0  gradients all-reduced once, at the last micro-batch, chunk by chunk as each chunk's
           backward completes (overlapped with the rest of backward); every rank updates all.
  stage 1  the same, but reduce-scattered: each rank updates its shard, then all-gathers weights.
  stage 2  reduce-scattered at every micro-batch (full gradients exist only transiently).
  stage 3  block weights are all-gathered just before each block's forward and backward
           (the next block prefetched asynchronously) and freed right after.
The 1/W of the data-parallel mean is folded into the backward's loss scaling, so collectives sum.

Offload tiers (engine/offload.py, engine/nvme.py): the last blocks' optimizer state lives in host
RAM or files and is updated by the host optimizer; with --offload-params cpu their weights live in
pinned host RAM too and are streamed in before each use like stage-3 gathers (a host→device copy
on a side stream, the next block prefetched), and freed after it. With --delayed-update the host's
new weights are applied at the next step's update instead of before the next forward.
"""

from __future__ import annotations

import os
from collections import deque
from collections.abc import Callable
from pathlib import Path

import torch
from torch import Tensor

from fitgpt.dist import DistContext
from fitgpt.engine import comm
from fitgpt.engine.activation import checkpoint_blocks
from fitgpt.engine.base import Batch, Engine, StepStats, batch_to
from fitgpt.engine.chunk import Chunk, padded
from fitgpt.engine.config import EngineConfig, OptimConfig, PrecisionConfig
from fitgpt.engine.layout import chunk_layout
from fitgpt.engine.moments import store_nbytes
from fitgpt.engine.offload import HOST_SLOTS, DiskTier, HostOptimizer
from fitgpt.engine.pinned import PinnedArena
from fitgpt.engine.placement import optimizer_homes
from fitgpt.engine.scaler import LossScaler
from fitgpt.engine.state_io import KINDS, Piece, StateReader, write_pieces
from fitgpt.engine.timing import StepClock
from fitgpt.errors import UserError
from fitgpt.model import GPT, ModelConfig
from fitgpt.model.gpt import alibi_slopes
from fitgpt.plan.hardware import host_usable

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
MAX_INFLIGHT = 2  # gradient reductions in flight at once: bounds the transient full-grad buffers


class ChunkEngine(Engine):
    def __init__(
        self,
        model_cfg: ModelConfig,
        ecfg: EngineConfig,
        pcfg: PrecisionConfig,
        ocfg: OptimConfig,
        ctx: DistContext,
        seed: int = 0,
    ) -> None:
        self.model_cfg, self.ecfg, self.ocfg, self.ctx = model_cfg, ecfg, ocfg, ctx
        self.device, self.stage = ctx.device, ecfg.zero_stage
        self.cuda = self.device.type == "cuda"
        self.dtype = DTYPES[pcfg.precision]
        self.scaler = LossScaler(pcfg)
        self.world = ctx.world if ctx.distributed else 1
        self.group = ctx.group if ctx.distributed else None

        with torch.device("meta"):
            model = GPT(model_cfg)  # no memory: every parameter is replaced by a chunk view below
        self.layout = chunk_layout(model)
        self.homes = optimizer_homes(self.layout, ecfg)
        streams = ecfg.offload_params == "cpu" and any(h != "device" for h in self.homes)
        if streams and self.world > 1 and self.stage < 3:
            raise UserError(
                f"--offload-params cpu on {self.world} ranks streams each rank's shard of the "
                "weights: use --zero-stage 3"
            )
        check_host_room(
            self.layout,
            self.homes,
            self.dtype,
            self.world,
            self.stage,
            self.device,
            ecfg.host_moments,
            weights_on_host=streams,
            delayed=ecfg.delayed_update,
        )
        self.pinned = PinnedArena(self.cuda)  # streamed weights, delayed updates
        # compressed moments of host-homed chunks decode into one shared fp32 pair (the worker
        # updates one chunk at a time): 8 bytes per element of the largest such chunk
        ram = [
            _opt_elems(s, self.world, self.stage)
            for s, h in zip(self.layout, self.homes)
            if h == "cpu"
        ]
        self.moment_scratch = None
        if ecfg.host_moments != "fp32" and ram:
            self.moment_scratch = (torch.zeros(max(ram)), torch.zeros(max(ram)))
        host = torch.device("cpu")
        if model_cfg.position == "alibi":
            model.alibi_slopes_N = alibi_slopes(model_cfg.n_head).to(self.device)
        self.chunks: list[Chunk] = []
        self.optimizers: list[torch.optim.AdamW] = []
        on_disk = {
            spec.index: _opt_elems(spec, self.world, self.stage)
            for spec, h in zip(self.layout, self.homes)
            if h == "nvme"
        }
        # the disk tier's free space is checked before anything is allocated
        self.disk = DiskTier(ecfg.nvme_path, on_disk) if on_disk else None
        for spec, home in zip(self.layout, self.homes):
            is_block = spec.name.startswith("block.")
            c = Chunk(
                spec,
                rank=ctx.rank if self.world > 1 else 0,
                world=self.world,
                shard_opt=self.stage >= 1,
                shard_grads=self.stage >= 2,
                # embed/head stay resident under stage 3: the tied embedding is used at both ends
                shard_weights=self.stage >= 3 and is_block,
                dtype=self.dtype,
                device=self.device,
                opt_device=self.device if home == "device" else host,
                offloaded=home != "device",
                on_disk=home == "nvme",
                moments=ecfg.host_moments if home == "cpu" else "fp32",
                moment_scratch=self.moment_scratch,
                stream_weights=streams and home != "device" and is_block,
                pinned=self.pinned,
            )
            for slot, p in zip(spec.slots, c.params):
                owner, _, leaf = slot.name.rpartition(".")
                setattr(model.get_submodule(owner), leaf, p)
            self._init_chunk(model, c, seed)  # one chunk at a time: init transients stay small
            # the optimizer's views must be cut while the state is resident
            self.optimizers.append(self._optimizer(c))
            if c.on_disk:
                self.disk.write_out(c)  # host RAM holds one disk-homed chunk's state at a time
            self.chunks.append(c)
        assert not any(t.is_meta for t in [*model.parameters(), *model.buffers()])
        self.blocks = [c for c in self.chunks if c.spec.name.startswith("block.")]
        if ecfg.checkpointing != "off":
            checkpoint_blocks(model, to_host=ecfg.checkpointing == "cpu")
        self.model = model
        self.hooks: list = []  # handles of the engine's hooks, removed at close()
        self.hosted = [c for c, h in zip(self.chunks, self.homes) if h != "device"]
        self.host_opt = None
        if self.hosted:
            biggest = max(c.opt_hi - c.opt_lo for c in self.hosted)
            self.host_opt = HostOptimizer(self.device, self.dtype, biggest, disk=self.disk)
            self._register_host_waits()
        self.pending: deque[tuple[object, str, Callable[[], None] | None, tuple]] = deque()
        self.last_micro = True
        self.clock = StepClock(self.device)
        self._register_grad_hooks()
        self.gathers: dict[int, object] = {}  # chunk index -> handle of its gather in flight
        self.streamed = [c for c in self.chunks if c.streamed]
        self.copy_stream = torch.cuda.Stream(self.device) if self.streamed and self.cuda else None
        if self.stage >= 3 or self.streamed:
            self._register_gather_hooks()
        # --delayed-update: per host-homed chunk, a pinned buffer the host optimizer writes the
        # new weights into; they reach the model at the next step's update (2 bytes/element)
        self.steps_done = 0
        self.next_weights: dict[int, Tensor] = {}
        self.reusable: dict[int, torch.cuda.Event] = {}
        if ecfg.delayed_update:
            for c in self.hosted:
                self.next_weights[c.spec.index] = self.pinned.zeros(c.opt_hi - c.opt_lo, self.dtype)

    # ---- construction -------------------------------------------------------------------------
    @torch.no_grad()
    def _init_chunk(self, model: GPT, c: Chunk, seed: int) -> None:
        """Each parameter made whole in fp32 from its own seeded generator, then scattered into
        the chunk's buffers: the same initial weights at every world size, stage and tier.
        Transient: one chunk in fp32 (4·N_c bytes), freed on return."""
        flat = torch.zeros(c.N, dtype=torch.float32, device=self.device)
        for s in c.spec.slots:
            model.init_parameter_(s.name, flat[s.offset : s.offset + s.numel].view(s.shape), seed)
        c.weight.copy_(flat)
        if c.transient_weight:
            c.weight_shard.copy_(flat[c.lo : c.hi])
        if not c.master_aliases_weight:
            c.master.copy_(flat[c.opt_lo : c.opt_hi])
        c.free_weight()  # stage 3: the full block weights live only while gathered

    def _optimizer(self, c: Chunk) -> torch.optim.AdamW:
        """torch's fused AdamW over the chunk's flat fp32 views; its moments are our buffers."""
        groups, d, m = [], c.decay_end, c.opt_hi - c.opt_lo
        views = [
            (c.master[:d], c.exp_avg[:d], c.exp_avg_sq[:d], self.ocfg.weight_decay),
            (c.master[d:m], c.exp_avg[d:m], c.exp_avg_sq[d:m], 0.0),
        ]
        views = [v for v in views if v[0].numel() > 0]
        for p, *_, wd in views:
            groups.append({"params": [p], "weight_decay": wd})
        opt = torch.optim.AdamW(
            groups, lr=0.0, betas=(self.ocfg.beta1, self.ocfg.beta2), eps=self.ocfg.eps, fused=True
        )
        for p, ea, es, _ in views:
            opt.state[p] = {
                "step": torch.zeros((), dtype=torch.float32, device=p.device),
                "exp_avg": ea,
                "exp_avg_sq": es,
            }
        return opt

    # ---- gradient flow ------------------------------------------------------------------------
    def _register_grad_hooks(self) -> None:
        for c in self.chunks:
            for p in c.params:
                h = p.register_post_accumulate_grad_hook(lambda _p, c=c: self._on_param_grad(c))
                self.hooks.append(h)

    def _on_param_grad(self, c: Chunk) -> None:
        c.grads_seen += 1
        if c.grads_seen < len(c.params):
            return
        c.grads_seen = 0  # the chunk's backward is complete for this micro-batch
        c.free_weight()  # stage 3 and streamed chunks: the weights' memory is freed here
        if self.stage >= 2:
            self._reduce_scatter_now(c)
        elif self.last_micro:
            if self.stage == 1:
                work = comm.reduce_scatter(c.grad_shard, c.grad, self.group, self.world, True)
                self._launch(work, f"reduce-scatter gradients of {c.spec.name}")
            else:
                work = comm.all_reduce(c.grad, self.group, self.world, True)
                self._launch(work, f"all-reduce gradients of {c.spec.name}")

    def _reduce_scatter_now(self, c: Chunk) -> None:
        """Stages 2-3: flatten this micro-batch's gradients, reduce-scatter them into a transient
        shard, and free the full gradients; the shard is added to the accumulator on completion."""
        full = torch.empty(c.N, dtype=self.dtype, device=self.device)
        torch.cat([p.grad.reshape(-1) for p in c.params], out=full[: c.n])
        full[c.n :].zero_()
        for p in c.params:
            p.grad = None  # autograd's per-parameter gradients are freed here
        part = torch.empty(c.s, dtype=self.dtype, device=self.device)
        work = comm.reduce_scatter(part, full, self.group, self.world, True)
        label = f"reduce-scatter gradients of {c.spec.name}"
        self._launch(work, label, lambda: c.grad_shard.add_(part), keep=(full, part))

    def _launch(
        self, work, label: str, finish: Callable[[], None] | None = None, keep: tuple = ()
    ) -> None:
        self.pending.append((work, label, finish, keep))
        while len(self.pending) > MAX_INFLIGHT:
            self._finish_one()

    def _finish_one(self) -> None:
        work, label, finish, _keep = self.pending.popleft()
        comm.wait(work, label, self.ctx.rank)  # on GPU: the compute stream waits, no host sync
        if finish is not None:
            finish()

    def _finish_all(self) -> None:
        while self.pending:
            self._finish_one()

    # ---- stage 3 and streamed weights: gather before use, free after -------------------------
    def _register_gather_hooks(self) -> None:
        blocks = list(self.model.blocks)
        for i, (module, c) in enumerate(zip(blocks, self.blocks)):
            nxt = self.blocks[i + 1] if i + 1 < len(self.blocks) else None
            prv = self.blocks[i - 1] if i > 0 else None
            last = nxt is None

            def pre_forward(_m, _args, c=c, nxt=nxt):
                self._ensure(c)
                if nxt is not None:
                    self._gather(nxt)  # prefetch: overlaps with this block's forward

            def post_forward(_m, _args, _out, c=c, last=last):
                if not last or not torch.is_grad_enabled():
                    c.free_weight()  # the last block is needed again at once by backward

            def pre_backward(_m, _grad, c=c, prv=prv):
                self._ensure(c)
                if prv is not None:
                    self._gather(prv)

            self.hooks += [
                module.register_forward_pre_hook(pre_forward),
                module.register_forward_hook(post_forward),
                module.register_full_backward_pre_hook(pre_backward),
            ]

    def _gather(self, c: Chunk) -> None:
        if c.resident:
            return
        if self.host_opt is not None:
            self.host_opt.wait(c)  # a prefetch must not gather a shard the host is still updating
        c.alloc_weight()  # allocated on the compute stream; NCCL's stream waits on it at launch
        if c.streamed:
            self.gathers[c.spec.index] = self._stream_in(c)
            return
        self.gathers[c.spec.index] = comm.all_gather(
            c.weight, c.weight_shard, self.group, self.world, True
        )

    def _stream_in(self, c: Chunk):
        """Host→device copy of a streamed chunk's weights (this rank's shard, then all-gathered
        across ranks), on the copy stream so it overlaps the block running now. Returns a handle
        whose wait() makes the compute stream wait for it (no host sync)."""
        if not self.cuda:
            shard = c.weight[c.lo : c.hi] if self.world > 1 else c.weight
            shard.copy_(c.weight_shard)  # CPU runs: the host tier is the same memory, a copy
            return comm.all_gather(c.weight, shard, self.group, self.world, True)
        compute = torch.cuda.current_stream(self.device)
        self.copy_stream.wait_stream(compute)  # the weight's storage was allocated on `compute`
        with torch.cuda.stream(self.copy_stream):
            c.weight[c.lo : c.hi].copy_(c.weight_shard, non_blocking=True)
            landed = torch.cuda.Event()
            landed.record(self.copy_stream)
        if self.world == 1:
            return _EventWork(landed)
        compute.wait_event(landed)
        return comm.all_gather(c.weight, c.weight[c.lo : c.hi], self.group, self.world, True)

    def _ensure(self, c: Chunk) -> None:
        self._gather(c)
        work = self.gathers.pop(c.spec.index, None)
        if work is not None:
            comm.wait(work, f"all-gather weights of {c.spec.name}", self.ctx.rank)

    # ---- the step -----------------------------------------------------------------------------
    def _to_device(self, t: Tensor) -> Tensor:
        return batch_to(t, self.device)

    def train_step(self, micro_batches: list[Batch], lr: float) -> StepStats:
        n, scale = len(micro_batches), self.scaler.scale
        self.clock.close_step()  # the previous step's phases, complete since its host sync
        self.clock.mark("start")
        loss_sum = torch.zeros((), device=self.device, dtype=torch.float32)
        for i, (x, y) in enumerate(micro_batches):
            self.last_micro = i == n - 1
            loss = self.model(self._to_device(x), self._to_device(y))
            (loss * (scale / (n * self.world))).backward()
            loss_sum += loss.detach().float()
        self.clock.mark("backward_done")
        self._finish_all()
        loss_avg = loss_sum / n
        sq = torch.zeros((), device=self.device, dtype=torch.float32)
        for c in self.chunks:
            sq += torch.linalg.vector_norm(c.opt_grad, dtype=torch.float32).square()
        if self.world > 1:
            if self.stage >= 1:  # each rank holds a different shard of the reduced gradient
                comm.wait(
                    comm.all_reduce(sq, self.group, self.world, True),
                    "all-reduce grad norm",
                    self.ctx.rank,
                )
            comm.wait(
                comm.all_reduce(loss_avg, self.group, self.world, True),
                "all-reduce loss",
                self.ctx.rank,
            )
            loss_avg /= self.world
        loss_v, sq_v = torch.stack([loss_avg, sq]).tolist()  # host sync: one per step
        self.clock.mark("synced")
        norm = sq_v**0.5 / scale
        overflow = not (norm == norm and norm != float("inf"))
        if not overflow:
            clip = self.ocfg.grad_clip
            coef = min(1.0, clip / (norm + 1e-6)) if clip > 0 else 1.0
            self._update(lr, coef / scale)
        self.scaler.update(overflow)
        self._zero_grads()
        self.steps_done += 1
        self.clock.mark("updated")
        return StepStats(loss_v, norm, scale, overflow)

    def breakdown(self) -> dict[str, float]:
        """Seconds per phase of the last completed step (GPU time between phase boundaries), and
        the host optimizer's counters so far (worker busy time, main-thread waits)."""
        out = dict(self.clock.last)
        if self.host_opt is not None:
            out["host_adamw_busy_total"] = self.host_opt.busy_s
            out["host_wait_total"] = self.host_opt.wait_s
            out["slot_wait_total"] = self.host_opt.slot_wait_s
            out["copy_d2h_total"] = self.host_opt.d2h_s
            out["copy_h2d_total"] = self.host_opt.h2d_s
        if self.disk is not None:
            io = self.disk.stats()
            out["nvme_wait_total"] = self.host_opt.disk_wait_s  # the worker, waiting on the disk
            out["nvme_read_gb_total"] = io["bytes_read"] / 1e9
            out["nvme_written_gb_total"] = io["bytes_written"] / 1e9
        return out

    def _register_host_waits(self) -> None:
        """The next forward waits for a host-homed block's new weights just before the block
        (registered before the stage-3 gather hooks, so the gather sees updated shards)."""
        by_index = {c.spec.index: c for c in self.hosted}
        for module, c in zip(self.model.blocks, self.blocks):
            if c.spec.index in by_index:
                h = module.register_forward_pre_hook(lambda _m, _a, c=c: self.host_opt.wait(c))
                self.hooks.append(h)

    def _sync_host(self) -> None:
        """Wait for every pending host update and apply delayed ones (before eval, checkpoints
        and generation: they see the newest weights)."""
        if self.host_opt is not None:
            self.host_opt.drain(self.hosted)
            self._apply_delayed()

    def _home_weights(self, c: Chunk) -> Tensor:
        """Where a host-homed chunk's updated weights go: the device weights (or this rank's
        shard of them), or for a streamed chunk its pinned host copy."""
        return c.weight_shard if (self.stage >= 1 or c.streamed) else c.weight

    def _apply_delayed(self) -> None:
        """--delayed-update: copy the new weights the host optimizer left in the pinned buffers
        into the model (host→device on the compute stream; between steps nothing reads them).
        The worker overwrites a buffer only after its copy has landed (`reusable` events)."""
        if not self.next_weights:
            return  # no delayed updates in this run
        gathers = []
        for c in self.hosted:
            if not self.host_opt.wait_delayed(c):
                continue
            self._home_weights(c).copy_(self.next_weights[c.spec.index], non_blocking=True)
            if self.cuda:
                self.reusable[c.spec.index] = torch.cuda.Event()
                self.reusable[c.spec.index].record()
            if self.world > 1 and self.stage in (1, 2):
                work = comm.all_gather(c.weight, c.weight_shard, self.group, self.world, True)
                gathers.append((work, f"all-gather updated weights of {c.spec.name}"))
        for work, label in gathers:
            comm.wait(work, label, self.ctx.rank)

    def _update(self, lr: float, grad_mul: float) -> None:
        gathers, delay = [], False
        if self.host_opt is not None:
            self._apply_delayed()  # the previous step's delayed weights, before new updates
            delay = bool(self.next_weights) and self.steps_done >= self.ecfg.delayed_update_after
            # host-homed chunks first, in forward order: their copies and host AdamW start at
            # once and run while the GPU updates the device-homed chunks below
            for c in self.hosted:
                i = c.spec.index
                target = self.next_weights[i] if delay else self._home_weights(c)
                opt = self.optimizers[i]
                self.host_opt.submit(
                    c,
                    opt,
                    _group_ranges(c),
                    lr,
                    grad_mul,
                    target,
                    delayed=delay,
                    target_free=self.reusable.pop(i, None),
                )
        for c, opt, home in zip(self.chunks, self.optimizers, self.homes):
            if home != "device":
                continue
            g32 = c.opt_grad.float()  # transient fp32 copy of one chunk's gradient
            if grad_mul != 1.0:
                g32.mul_(grad_mul)
            for group, (lo, hi) in zip(opt.param_groups, _group_ranges(c)):
                group["lr"] = lr
                group["params"][0].grad = g32[lo:hi]
            opt.step()
            for group in opt.param_groups:
                group["params"][0].grad = None
            del g32
            if not c.master_aliases_weight:
                c.weight_shard.copy_(c.master) if self.stage >= 1 else c.weight.copy_(c.master)
            if self.stage >= 1 and not c.shard_weights:
                work = comm.all_gather(c.weight, c.weight_shard, self.group, self.world, True)
                gathers.append((work, f"all-gather updated weights of {c.spec.name}"))
        if self.world > 1 and self.stage in (1, 2) and not delay:
            # the other ranks need this rank's updated shard: wait for the host, then gather
            for c in self.hosted:
                self.host_opt.wait(c)
                work = comm.all_gather(c.weight, c.weight_shard, self.group, self.world, True)
                gathers.append((work, f"all-gather updated weights of {c.spec.name}"))
        for work, label in gathers:
            comm.wait(work, label, self.ctx.rank)

    def _zero_grads(self) -> None:
        for c in self.chunks:
            if c.grad is not None:
                c.grad.zero_()
            elif c.grad_shard is not None:
                c.grad_shard.zero_()

    @torch.no_grad()
    def eval_loss(self, batch: Batch) -> float:
        self._sync_host()
        self.model.eval()
        x, y = (self._to_device(t) for t in batch)
        loss = self.model(x, y).float()
        if self.world > 1:
            comm.all_reduce(loss, self.group, self.world)
            loss /= self.world
        self.model.train()
        return loss.item()

    # ---- checkpoints --------------------------------------------------------------------------
    def _writes(self) -> bool:
        return self.stage >= 1 or self.ctx.rank == 0  # stage 0 is replicated: rank 0 writes

    def save_state(self, folder: Path, optimizer: bool = True) -> None:
        self._sync_host()
        if not self._writes():
            return
        write_pieces(folder, self.ctx.rank, self._pieces(KINDS if optimizer else KINDS[:1]))

    def _pieces(self, kinds: tuple[str, ...]):
        """Each chunk's state as a Piece, one at a time: a disk-homed chunk is read in, written
        by write_pieces, and freed before the next, so saving needs no more host RAM than a step."""
        for c in self.chunks:
            lo, hi = c.unpadded(c.opt_lo, c.opt_hi)
            k = hi - lo
            if k <= 0:
                continue
            if c.on_disk:
                self.disk.read_in(c)
            if len(kinds) > 1:
                c.decode_moments()  # compressed moments: into the shared scratch, saved as fp32
            tensors = dict(zip(kinds, (c.master[:k], c.exp_avg[:k], c.exp_avg_sq[:k])))
            # safetensors exports through numpy, which pins a storage's size for good: a
            # disk-homed chunk's buffers must stay resizable, so it hands over copies
            tensors = {n: (t.clone() if c.on_disk else t.float().cpu()) for n, t in tensors.items()}
            yield Piece(c.spec.index, lo, hi, tensors)
            c.free_state()

    @torch.no_grad()
    def load_state(self, folder: Path, extra: dict, optimizer: bool = True) -> None:
        """Weights and optimizer state; with optimizer=False (a weights-only checkpoint) the
        weights alone, the moments zero and the optimizer's step 0, as in a fresh run."""
        self._sync_host()
        reader = StateReader(folder)
        step = float(extra.get("optimizer_step", 0)) if optimizer else 0.0
        for c, opt in zip(self.chunks, self.optimizers):
            lo, hi = c.unpadded(c.opt_lo, c.opt_hi)
            k = max(0, hi - lo)
            c.alloc_state()  # a disk-homed chunk: its buffers back, filled from the checkpoint
            for kind, buf in zip(KINDS, (c.master, c.exp_avg, c.exp_avg_sq)):
                buf.zero_()  # the padding beyond k stays zero; so do fresh moments
                if k and (optimizer or kind == "master"):
                    buf[:k].copy_(reader.read(c.spec.index, kind, lo, hi))
            for st in opt.state.values():
                st["step"].fill_(step)
            c.encode_moments()
            self._weights_from_master(c)
            if c.on_disk:
                self.disk.write_out(c)
        if optimizer:
            self.scaler.load_state_dict(extra["scaler"])
        self.steps_done = int(step)

    def _weights_from_master(self, c: Chunk) -> None:
        if c.master_aliases_weight:
            src = c.weight_shard if self.stage >= 1 else c.weight
        else:
            src = c.master
        if self.stage == 0 and not c.streamed:
            c.weight.copy_(src)
            return
        c.weight_shard.copy_(src)
        if not c.transient_weight:
            comm.all_gather(c.weight, c.weight_shard, self.group, self.world)

    def extra_state(self) -> dict:
        steps = [st["step"] for opt in self.optimizers for st in opt.state.values()]
        return {
            "optimizer_step": int(steps[0].item()) if steps else 0,
            "scaler": self.scaler.state_dict(),
        }

    def memory_report(self) -> dict[str, dict[str, int]]:
        out: dict[str, dict[str, int]] = {}
        for c in self.chunks:
            for dev, kinds in c.bytes_by_kind().items():
                for k, v in kinds.items():
                    out.setdefault(dev, {}).setdefault(k, 0)
                    out[dev][k] += v
        if self.host_opt is not None:
            out.setdefault("host", {})["host_staging"] = self.host_opt.nbytes()
        if self.next_weights:
            out["host"]["delayed_weights"] = sum(t.nbytes for t in self.next_weights.values())
        if self.moment_scratch is not None:
            out["host"]["moment_scratch"] = sum(t.numel() * 4 for t in self.moment_scratch)
        if self.disk is not None:
            # the most disk-homed chunks swapped in at once: one per staging slot
            big = max(c.master.numel() for c in self.chunks if c.on_disk)
            out["host"]["nvme_swap"] = HOST_SLOTS * 12 * big
        return out

    def close(self) -> None:
        """Stop the host optimizer, remove the disk tier's files, and release every buffer: the
        hooks (which refer back to the engine through tensors the garbage collector does not
        see into) are removed, so dropping the engine frees its GPU and host memory."""
        for h in self.hooks:
            h.remove()
        self.hooks = []
        if self.host_opt is not None:
            self.host_opt.close()  # joins the worker, then removes the disk tier's files
        if self.cuda:
            torch.cuda.synchronize(self.device)  # no copy may still read a buffer unregistered next
        self.pinned.close()

    @torch.no_grad()
    def inference_model(self) -> GPT:
        """A fresh GPT holding the full current weights (gathered from the shards)."""
        self._sync_host()
        model = GPT(self.model_cfg).to(self.device, self.dtype)
        params = dict(model.named_parameters())
        for c in self.chunks:
            if c.transient_weight:
                self._ensure(c)  # stage 3 and streamed chunks: their weights, brought in
            for s in c.spec.slots:
                params[s.name].copy_(c.weight[s.offset : s.offset + s.numel].view(s.shape))
            c.free_weight()
        return model.eval()


def _opt_elems(spec, world: int, stage: int) -> int:
    """Elements of a chunk's optimizer range on one rank."""
    return padded(spec.numel, world) // (world if stage >= 1 else 1)


def host_state_bytes(
    layout,
    homes: list[str],
    dtype: torch.dtype,
    world: int,
    stage: int,
    moments: str = "fp32",
    weights_on_host: bool = False,
    delayed: bool = False,
) -> int:
    """Bytes this rank will hold in host memory for offloaded chunks: fp32 master weights and
    two Adam moments of host-homed chunks (and the moments' fp32 scratch when compressed), the
    swap buffers of disk-homed ones (one chunk per staging slot), the host optimizer's staging
    buffers, and per offloaded chunk its streamed weights and delayed-update buffer if used."""
    ram = [_opt_elems(s, world, stage) for s, h in zip(layout, homes) if h == "cpu"]
    disk = [_opt_elems(s, world, stage) for s, h in zip(layout, homes) if h == "nvme"]
    if not ram and not disk:
        return 0
    biggest = max(ram + disk)
    swap = HOST_SLOTS * 12 * max(disk) if disk else 0
    held = sum(4 * n + 2 * store_nbytes(moments, n) for n in ram)
    if ram and moments != "fp32":
        held += 8 * max(ram)
    held += (weights_on_host + delayed) * dtype.itemsize * sum(ram + disk)
    return held + swap + biggest * (HOST_SLOTS * dtype.itemsize + 4)


def check_host_room(
    layout,
    homes,
    dtype,
    world: int,
    stage: int,
    device: torch.device,
    moments: str = "fp32",
    weights_on_host: bool = False,
    delayed: bool = False,
) -> None:
    """Refuse, before allocating anything, a placement whose host state does not fit in the RAM
    the machine can give now (every local rank takes the same share): being OOM-killed an hour
    into a run is the failure users of other offload engines report most."""
    need = host_state_bytes(layout, homes, dtype, world, stage, moments, weights_on_host, delayed)
    if not need or device.type != "cuda":
        return  # on CPU-only runs every tier is host memory; the planner accounts for it
    local = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    avail = host_usable() // max(1, local)
    if avail and need > avail:
        raise UserError(
            f"the offloaded optimizer state needs {need / 2**30:.1f} GiB of host RAM per rank but "
            f"{avail / 2**30:.1f} GiB can be used (short by {(need - avail) / 2**30:.1f} GiB): "
            "offload a smaller --offload-fraction, train fewer layers, or free host memory"
        )


def _group_ranges(c: Chunk) -> list[tuple[int, int]]:
    d, m = c.decay_end, c.opt_hi - c.opt_lo
    return [r for r in ((0, d), (d, m)) if r[1] > r[0]]


class _EventWork:
    """A handle like a collective's: wait() makes the current stream wait for a recorded event."""

    def __init__(self, event: torch.cuda.Event) -> None:
        self.event = event

    def wait(self) -> bool:
        torch.cuda.current_stream().wait_event(self.event)
        return True
