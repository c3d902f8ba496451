"""fitgpt's chunked engine (`--engine zero`): ZeRO stages 0-3 over flat per-chunk buffers.

Every piece of state lives in a Chunk (engine/chunked/chunk.py): one chunk per transformer block
(a sparse block's experts a second one) plus the embedding and head chunks. The model's
parameters are views into the chunks' flat working-dtype buffers, so the model code never
changes. Mixed precision keeps bf16/fp16 weights and gradients for compute and fp32 master
weights and Adam moments over each rank's optimizer range.

This file is the facade: it builds the model (engine/transforms/build.py) and the chunks from the
placement (engine/chunked/chunk_build.py) and runs the step; each concern is its own part of
engine/chunked/, reached only from here:
  reduce.py       gradient reduction, overlapped with the backward (all-reduce at stage 0,
                  reduce-scatter from stage 1; every micro-batch from stage 2)
  fetch.py        weight fetch: stage-3 all-gathers and host→device streaming of
                  --offload-params blocks, prefetched one block ahead, freed after use
  update.py       the tiered update: device AdamW, the host optimizer (offload.py, host RAM or
                  the disk tier), gathers of new weights
  chunk_state.py  checkpoints in and out, and a plain model for sampling
  accounting.py   bytes per tier: the host-RAM check before anything is allocated, and
                  memory_report after
Expert parallelism (--expert-parallel P, fitgpt/parallel/experts.py) keeps E/P experts in each
experts' chunk, reduced and sharded over the W/P ranks holding the same ones (Chunk.peers).
Tensor parallelism (fitgpt/parallel, --tensor-parallel T) splits the model before the chunks are
laid out: each rank's chunks hold its 1/T of the split weights, ZeRO runs over the data-parallel
group, and checkpoints are gathered to the unsplit layout (engine/transforms/tp_state.py).
The step, per micro-batch: forward (fetch hooks), backward scaled by scale/(n·W) (reduction
hooks); then every reduction completed, the loss and global gradient norm summed over ranks (one
host sync per step), the clip coefficient, the update, the gradients zeroed.

Offload tiers: the last blocks' optimizer state lives in host RAM or files and is updated by the
host optimizer; with --offload-params cpu their weights live in pinned host RAM too and are
streamed in before each use like stage-3 gathers.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from pathlib import Path

import torch
from torch import Tensor

from fitgpt.dist import DistContext
from fitgpt.engine.base import (
    Batch,
    Engine,
    StepStats,
    batch_to,
    loss_weights,
    step_share,
    token_mean,
)
from fitgpt.engine.chunked.accounting import check_host_room, memory_report
from fitgpt.engine.chunked.chunk_build import build_chunks, shared_state, warm_up_codecs
from fitgpt.engine.chunked.chunk_state import ChunkStateIO
from fitgpt.engine.chunked.fetch import WeightFetch
from fitgpt.engine.chunked.offload import HostOptimizer
from fitgpt.engine.chunked.placement import Placement
from fitgpt.engine.chunked.reduce import GradReducer
from fitgpt.engine.chunked.update import TieredUpdate
from fitgpt.engine.comm import Peers
from fitgpt.engine.config import EngineConfig, OptimConfig, PrecisionConfig
from fitgpt.engine.host.pinned import PinnedArena
from fitgpt.engine.scaler import LossScaler
from fitgpt.engine.state_io import KINDS, write_pieces
from fitgpt.engine.timing import StepClock
from fitgpt.engine.transforms.activation import checkpoint_blocks
from fitgpt.engine.transforms.build import build
from fitgpt.engine.transforms.compile import compile_regions, scope_of
from fitgpt.engine.transforms.tp_state import (
    SequenceParallelGrads,
    TPGradNorm,
    replicated_ranges,
)
from fitgpt.engine.transforms.wgrad import fuse_weight_grads
from fitgpt.errors import UserError
from fitgpt.model import DecoderLM, ModelConfig
from fitgpt.parallel.experts import expert_parallel_refusal

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


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
        self.device = ctx.device
        self.cuda = self.device.type == "cuda"
        self.precision, self.dtype = pcfg.precision, DTYPES[pcfg.precision]
        self.scaler = LossScaler(pcfg)
        # the data-parallel group (ctx, laid out for ecfg: engine/factory.py): every rank, or
        # with --tensor-parallel T the ranks sharing this rank's TP index (dist/mesh.py); ZeRO
        # shards and gradient reductions run over it (--context-parallel C: every rank; its CP
        # group only trades attention's heads)
        self.world = ctx.dp_world if ctx.distributed else 1
        self.peers = Peers(ctx.dp_group if self.world > 1 else None, self.world, ctx.dp_rank)
        # --shard-within node (HSDP): the ZeRO shards span one machine's ranks (`peers`), and
        # each shard's replicas on the other machines sum their gradients (`replicas`); the
        # loss and the data stay the whole job's (self.world)
        self.replicas: Peers | None = None
        if ecfg.shard_within == "node" and self.world > 1:
            self.peers, self.replicas = node_peers(ctx)

        self.mesh = ctx.mesh
        why = expert_parallel_refusal(
            ecfg.expert_parallel, model_cfg, ctx.world, ctx.tp, ctx.cp_size
        )
        if why:
            raise UserError(why)
        # --expert-parallel P: the experts' chunks are reduced and sharded over the W/P ranks
        # holding the same experts (their replica group), every other chunk over the DP group
        ep = ctx.ep
        self.expert_peers = (
            Peers(ep.replica_group, ep.replicas, ep.replica_rank) if ep is not None else self.peers
        )
        # on meta, no memory: every parameter is replaced by a chunk view below
        built = build(model_cfg, self.mesh, ecfg.sequence_parallel, self.device, ctx.cp, ep)
        model, self.layout, self.local_layout = built.model, built.layout, built.local_layout
        self.view = built.view
        model.materialize_buffers(self.device)
        self.placement = self._placement()
        self.pinned = PinnedArena(self.cuda)  # streamed weights
        self.scratch, self.disk = shared_state(self.placement, self.device, self.ecfg.nvme_path)
        # under TP each rank's part of the weights an unsplit run starts from
        init = self.view.init(partial(model.init_parameter_, seed=seed))
        self.chunks = build_chunks(
            self.placement, model, init, self.ocfg,
            peers_of=lambda plan: self.expert_peers if plan.spec.experts else self.peers,
            dtype=self.dtype,
            device=self.device, pinned=self.pinned, scratch=self.scratch, disk=self.disk,
        )  # fmt: skip
        warm_up_codecs(self.chunks, self.scratch)
        assert not any(t.is_meta for t in [*model.parameters(), *model.buffers()])
        self.blocks = [c for c in self.chunks if c.spec.name.startswith("block.")]
        self.compiled = None
        scope = scope_of(ecfg)  # the planner's (engine/transforms/compile.py compile_scope)
        if scope != "off":
            self.compiled = compile_regions(model, ctx.is_main, whole=scope == "model")
        if ecfg.checkpointing != "off":  # after compiling: the checkpoint wraps compiled blocks
            checkpoint_blocks(model, ecfg.checkpointing == "cpu", ecfg.keep_activations)
        self.model = model
        self.hosted = [c for c in self.chunks if c.offloaded]
        self.streamed = [c for c in self.chunks if c.streamed]
        self.host_opt = None
        if self.hosted:
            hosted = self.placement.hosted
            split_dev = [c.opt_elems for c in hosted if c.master == "split" and not c.streamed]
            self.host_opt = HostOptimizer(
                self.device,
                self.dtype,
                max(c.opt_elems for c in hosted),
                disk=self.disk,
                plain_elems=max((c.opt_elems for c in hosted if not c.compact), default=0),
                weight_elems=max(split_dev, default=0) if self.cuda else 0,
                scratch=self.scratch.get("host"),
            )
        self._connect_parts()

    # ---- construction -------------------------------------------------------------------------
    def _placement(self) -> Placement:
        """Where every chunk's state lives (engine/chunked/placement.py: the same object the planner
        priced); refuses what cannot run here, before anything is allocated. After construction
        the parts see chunks and their flags, never the engine config's offload fields."""
        placement = Placement.of(
            self.local_layout, self.ecfg, self.peers.world, self.dtype.itemsize, self.device.type
        )
        if why := placement.refusal(self.precision):
            raise UserError(why)
        check_host_room(placement, self.device, self.ctx.group, self.ctx.world)
        return placement

    def _connect_parts(self) -> None:
        """The engine's parts, and their hooks on the model (handles removed at close())."""
        # a sparse block's two chunks (block.i, block.i.experts) go with its module
        blocks, modules = self.blocks, [self.model.blocks[c.spec.layer] for c in self.blocks]
        by_layer = [[c for c in blocks if c.spec.layer == i] for i in range(len(self.model.blocks))]
        self.updater = TieredUpdate(
            self.chunks, self.host_opt, self.peers, self.scratch.get("device"),
            speculative=self.ecfg.speculative_update, one_pass=self.compiled is not None,
            warn=self.compiled.warn if self.compiled is not None else print,
        )  # fmt: skip
        self.reducer = GradReducer(self.peers, self.dtype, self.device, self.replicas)
        if self.mesh is not None:
            self.reducer.tp_norm = TPGradNorm(self.mesh)
            self.reducer.tp_ranges = [replicated_ranges(c) for c in self.local_layout]
            if self.ecfg.sequence_parallel:
                self.reducer.sp_sync = SequenceParallelGrads(self.mesh, self.local_layout)
        if self.updater.speculative:
            self.reducer.on_final = self.updater.on_final
        self.fetcher = WeightFetch(self.peers, self.device, self.host_opt, bool(self.streamed))
        self.state_io = ChunkStateIO(
            self.chunks,
            self.disk,
            self.peers,
            self.placement.replicated,
            self.scratch,
            self.device,
            to_full=getattr(self.view, "to_full", None),
        )
        self.hooks: list = []
        if self.host_opt is not None:  # before the fetch hooks: a gather sees updated shards
            self.hooks += self.updater.register_host_waits(modules, blocks)
        self.hooks += self.reducer.register(self.chunks)
        if self.compiled is not None and self.compiled.scope == "regions":
            # the block linears' weight gradients accumulated by their product, which saves an
            # add pass over each gradient per micro-batch (engine/transforms/wgrad.py); only where
            # .grad is a persistent view (stages 0-1) of weights whose storage stays put (not
            # streamed)
            owner = {id(p): c for c in self.chunks for p in c.params}
            keeps = lambda p: owner[id(p)].grad is not None and not owner[id(p)].transient_weight  # noqa: E731
            self.hooks.append(fuse_weight_grads(list(self.model.blocks), keeps))
        if self.placement.fetches_weights:
            self.hooks += self.fetcher.register(list(self.model.blocks), by_layer)
        self.clock = StepClock(self.device)
        self._stats_host: Tensor | None = None  # the step's loss and norm², pinned (_stats_down)

    # ---- the step -----------------------------------------------------------------------------
    def _to_device(self, t: Tensor) -> Tensor:
        return batch_to(t, self.device)

    def train_step(self, micro_batches: list[Batch], lr: float) -> StepStats:
        n, scale = len(micro_batches), self.scaler.scale
        self.clock.close_step()  # the previous step's phases, complete since its host sync
        self.clock.mark("start")
        loss_sum = torch.zeros((), device=self.device, dtype=torch.float32)
        # each micro-batch's share of the step's token mean (engine/base.py loss_weights)
        weights, counted = loss_weights(micro_batches, self.device, self._dp_sum, self.world)
        self.updater.begin_step(lr, scale)
        for i, b in enumerate(micro_batches):
            self.reducer.last_micro = i == n - 1
            loss = step_share(self.model, partial(self._forward, Batch(*b)), weights[i])
            (loss * (scale / (n * self.world))).backward()
            loss_sum += loss.detach()
        self.clock.mark("backward_done")
        self.reducer.finish_all()
        loss_avg, sq = self.reducer.totals(loss_sum / n, self.chunks)
        empty = counted == 0  # no counted target on any rank: no update (StepStats.counted)
        clip = self.ocfg.grad_clip
        if self.updater.sync_free:
            # the clip coefficient and the overflow test on the device, in float64 as the host
            # computes them below (the same grad_mul to the bit): the update is queued behind
            # the backward, and the step's one host sync comes after it
            norm_t = sq.double().sqrt() / scale
            coef = (clip / (norm_t + 1e-6)).clamp(max=1.0) if clip > 0 else torch.ones_like(norm_t)
            skip = (~torch.isfinite(norm_t) | empty).float()
            ready = self._stats_down(torch.stack([loss_avg, sq, counted.float()]))
            self.clock.mark("synced")
            self.updater.step_on_device(lr, (coef / scale).float().reshape(1), skip)
            self.reducer.zero_grads(self.chunks)
            self.clock.mark("updated")
            loss_v, sq_v, counted_v = ready()  # host sync: one per step, the update still running
            norm, overflow = _norm_of(sq_v, scale)
        else:
            stats = torch.stack([loss_avg, sq, counted.float()])
            loss_v, sq_v, counted_v = stats.tolist()  # host sync: one per step
            self.clock.mark("synced")
            norm, overflow = _norm_of(sq_v, scale)
            grad_mul = None  # an overflow or nothing counted: no step (speculative ones undone)
            if not overflow and counted_v > 0:
                coef = min(1.0, clip / (norm + 1e-6)) if clip > 0 else 1.0
                grad_mul = coef / scale
            self.updater.step(lr, grad_mul)
            self.reducer.zero_grads(self.chunks)
            self.clock.mark("updated")
        self.scaler.update(overflow)
        return StepStats(loss_v, norm, scale, overflow, int(counted_v))

    def _forward(self, b: Batch) -> Tensor:
        """The model's mean loss; segments passed only for packed data (a plain batch calls the
        model exactly as before)."""
        x, y = self._to_device(b.inputs), self._to_device(b.targets)
        if b.segments is None:
            return self.model(x, y)
        return self.model(x, y, segments_BT=self._to_device(b.segments))

    def _dp_sum(self, t: Tensor) -> None:
        """t summed over the data-parallel ranks, in place (the device waits, not the host)."""
        if self.world > 1:
            self.peers.wait(self.peers.all_reduce(t), "all-reduce counted targets")
            if self.replicas is not None:
                self.replicas.wait(self.replicas.all_reduce(t), "all-reduce counted targets")

    def _stats_down(self, stats: Tensor) -> Callable[[], list[float]]:
        """Start copying the step's [loss, squared norm] to the host ahead of the update; the
        returned call waits for that copy alone, not for the update queued behind it, so the
        host takes up the next step while the GPU still updates (a sync after the update idled
        the GPU for the host's turn: 3-4 ms of a 2.7b step on an H100)."""
        if not self.cuda:
            return stats.tolist
        if self._stats_host is None:
            self._stats_host = torch.empty(3, dtype=torch.float32, pin_memory=True)
        self._stats_host.copy_(stats, non_blocking=True)
        done = torch.cuda.Event()
        done.record()

        def ready() -> list[float]:
            done.synchronize()
            return self._stats_host.tolist()

        return ready

    @torch.no_grad()
    def eval_loss(self, batches: list[Batch]) -> float:
        self._sync_host()
        self.model.eval()
        loss = token_mean(lambda b: self._forward(b).float(), batches, self.device, self._dp_sum)
        self.model.train()
        return loss

    def _sync_host(self) -> None:
        """Every host update landed: eval, checkpoints and generation see the newest weights."""
        self.updater.sync()

    # ---- state --------------------------------------------------------------------------------
    def save_state(self, folder: Path, optimizer: bool = True) -> None:
        self._sync_host()
        if self.mesh is None:
            if self.replicas is None or self.replicas.rank == 0:  # HSDP: machine 0's shards
                self.state_io.save(folder, optimizer)
            return
        # tensor parallelism: whole chunks gathered over DP then TP, written by rank 0 alone in
        # the unsplit layout (engine/transforms/tp_state.py), so any run can load them
        kinds = KINDS if optimizer else KINDS[:1]
        local = ((c.spec, t) for c, t in self.state_io.whole_chunks(kinds))
        pieces = self.view.pieces(local)
        if self.ctx.rank == 0:
            write_pieces(folder, 0, pieces)
        else:
            for _ in pieces:  # every rank takes part in the gathers
                pass

    def load_state(self, folder: Path, extra: dict, optimizer: bool = True) -> None:
        """Weights and optimizer state; with optimizer=False (a weights-only checkpoint) the
        weights alone, the moments zero and the optimizer's step 0, as in a fresh run."""
        self._sync_host()
        step = float(extra.get("optimizer_step", 0)) if optimizer else 0.0
        # under TP the checkpoint's whole chunks read, this rank's parts kept
        self.state_io.load(folder, step, optimizer, self.view.reader(folder))
        if optimizer:
            self.scaler.load_state_dict(extra["scaler"])
        self.updater.last_clean = bool(extra.get("last_step_clean", False)) and optimizer

    def extra_state(self) -> dict:
        steps = [c.step_count for c in self.chunks if c.step_count is not None]
        return {
            "optimizer_step": int(steps[0].item()) if steps else 0,
            "scaler": self.scaler.state_dict(),
            "last_step_clean": self.updater.last_clean,  # the speculative update's rule
        }

    def inference_model(self) -> DecoderLM:
        """A fresh model holding the full current weights (gathered from the shards)."""
        self._sync_host()
        return self.state_io.inference_model(
            self.model_cfg, self.device, self.dtype, self.fetcher.ensure, self.view.unsplit
        )

    # ---- accounting and lifetime --------------------------------------------------------------
    def describe(self) -> dict:
        out = super().describe()
        streams = []
        if self.world > 1:
            streams.append("collectives: gradient reductions overlapped with the backward")
        if any(c.shard_weights for c in self.chunks):
            streams.append("all-gathers of the next block's weights (prefetch)")
        if self.streamed:
            streams.append("host→device copies of streamed blocks' weights (copy stream)")
        if self.host_opt is not None:
            streams.append("the host optimizer: gradients down and weights up on a side stream, "
                           "AdamW on a worker thread")  # fmt: skip
        if self.disk is not None:
            streams.append("the disk tier's reads and writes (I/O threads)")
        placement = self.placement.describe()
        if self.mesh is not None:
            placement = (
                f"tensor-parallel {self.mesh.tp} (1/{self.mesh.tp} of each layer), {placement}"
            )
            streams.insert(0, "tensor-parallel all-reduces: 2 per layer forward, 2 backward")
        if self.ctx.ep is not None:
            p = self.ctx.ep.size
            placement = f"expert-parallel {p} (1/{p} of each sparse layer's experts), {placement}"
            streams.insert(0, "expert all-to-alls: 2 per sparse layer forward, 2 backward")
        out.update(engine=f"zero-{self.placement.stage}", placement=placement)
        out["streams"] = streams
        return out

    def memory_report(self) -> dict[str, dict[str, int]]:
        return memory_report(self.chunks, self.host_opt, self.scratch, self.disk)

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
            out["speculated_steps_total"] = self.updater.speculated_steps
            out["rollbacks_total"] = self.updater.rollbacks
        if self.disk is not None:
            io = self.disk.stats()
            out["nvme_wait_total"] = self.host_opt.disk_wait_s  # the worker, waiting on the disk
            out["nvme_read_gb_total"] = io["bytes_read"] / 1e9
            out["nvme_written_gb_total"] = io["bytes_written"] / 1e9
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


def node_peers(ctx: DistContext) -> tuple[Peers, Peers | None]:
    """(this machine's ranks, this rank's replicas on the other machines, None on one machine)
    as Peers, for --shard-within node (collective: every rank builds every group,
    dist/mesh.py)."""
    from fitgpt.dist.mesh import build_node_groups
    from fitgpt.dist.nodes import node_shape

    per_node, nodes = node_shape(ctx.world)
    mine = build_node_groups(ctx.rank, ctx.world, per_node)
    return Peers(*mine["node"]), Peers(*mine["replica"]) if nodes > 1 else None


def _norm_of(sq: float, scale: float) -> tuple[float, bool]:
    """The gradient's global norm (unscaled) from its square, and whether it overflowed."""
    norm = sq**0.5 / scale
    return norm, not (norm == norm and norm != float("inf"))
