"""The plain PyTorch engine (`--engine ddp`): the baseline the seed compared against.

fp32 parameters, gradients and AdamW moments all live on the GPU (16 bytes per parameter plus
activations); bf16/fp16 compute through autocast; torch's fused AdamW. With several ranks the
model is wrapped in DistributedDataParallel: gradients are all-reduced in buckets overlapped with
backward, and accumulation micro-batches skip the all-reduce (no_sync). On one device there is no
wrapper at all. Kept honest and tuned because every speed-up fitgpt claims is measured against it.

With LoRA adapters (fitgpt/adapters, --lora-rank) the base is frozen: no gradient, no optimizer
state and no part in DDP's buckets; the adapters are what trains, is clipped, stepped, saved and
loaded (`layout`), and the base is loaded through `frozen` from the run's --init-from source.
An fp32 base on the device is the model's own fp32 parameters (4 bytes per parameter); any other
(--base-format bf16/int8/nf4, blocks in host RAM or on the disk, sharded) is a FrozenStore
(engine/chunked/frozen.py): the model built on the meta device, its blocks made or read one at
a time straight into their packed form and tier, unpacked per use (_adapt_packed).
"""

from __future__ import annotations

import contextlib
from functools import partial
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from fitgpt.adapters import AdapterConfig, lora_targets
from fitgpt.adapters.lora import attach_lora, init_lora
from fitgpt.dist import DistContext
from fitgpt.engine import comm
from fitgpt.engine.base import (
    Batch,
    Engine,
    FrozenWeights,
    StepStats,
    batch_to,
    loss_weights,
    step_share,
    token_mean,
)
from fitgpt.engine.chunked.frozen import FrozenStore
from fitgpt.engine.comm import Peers
from fitgpt.engine.config import EngineConfig, OptimConfig, PrecisionConfig
from fitgpt.engine.formats.frozen_base import base_format, packed_base
from fitgpt.engine.layout import ChunkSpec, chunk_layout, decays
from fitgpt.engine.scaler import LossScaler
from fitgpt.engine.state_io import write_pieces
from fitgpt.engine.transforms.activation import checkpoint_blocks
from fitgpt.engine.transforms.build import build
from fitgpt.engine.transforms.compile import compile_regions, scope_of
from fitgpt.engine.transforms.tp_state import (
    TPGradNorm,
    sync_replicated,
)
from fitgpt.model import DecoderLM, ModelConfig, build_model

AUTOCAST = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": None}
DDP_BUCKET_MB = 100  # larger than DDP's 25 MB default: fewer, fuller NCCL calls for big models


def total_norm(grads: list[torch.Tensor]) -> torch.Tensor:
    """Global L2 norm of a list of gradients, on their device (no host sync)."""
    if not grads:
        return torch.zeros(())
    return torch.linalg.vector_norm(torch.stack(torch._foreach_norm(grads, 2.0)), 2.0)


class TorchEngine(Engine):
    def __init__(
        self,
        model_cfg: ModelConfig,
        ecfg: EngineConfig,
        pcfg: PrecisionConfig,
        ocfg: OptimConfig,
        ctx: DistContext,
        seed: int = 0,
        adapter: AdapterConfig | None = None,
    ) -> None:
        # ctx: laid out for ecfg (engine/factory.py); DDP runs over every rank, CP or not
        self.model_cfg, self.ecfg, self.pcfg, self.ocfg, self.ctx = model_cfg, ecfg, pcfg, ocfg, ctx
        self.device, self.mesh = ctx.device, ctx.mesh
        built = build(model_cfg, self.mesh, ecfg.sequence_parallel, self.device, ctx.cp)
        model, self.layout, self.local_layout = built.model, built.layout, built.local_layout
        self.view = built.view
        self.store: FrozenStore | None = None  # a base held packed or streamed (_adapt_packed)
        if adapter is not None and adapter.active and packed_base(adapter, pcfg.precision):
            self._adapt_packed(model, adapter, seed)  # built straight into its tiers
        else:
            model.to_empty(device=self.device)
            model.materialize_buffers(self.device)  # to_empty left the non-persistent undefined
            self._init(model, seed)
            if adapter is not None and adapter.active:  # before compiling: the blocks change
                self._adapt(model, adapter, seed)
        scope = scope_of(ecfg)  # the planner's (engine/transforms/compile.py compile_scope)
        self.compiled = compile_regions(model, ctx.is_main) if scope != "off" else None
        if ecfg.checkpointing != "off":  # after compiling: the checkpoint wraps compiled blocks
            checkpoint_blocks(model, ecfg.checkpointing == "cpu", ecfg.keep_activations)
        self.model = model
        self.dp = ctx.dp_world if ctx.distributed else 1
        if self.dp > 1 and self.frozen is not None:  # no broadcast of the base (each rank
            # loads it from the source), no bucket for it
            frozen = [n for n, p in model.named_parameters() if not p.requires_grad]
            DDP._set_params_and_buffers_to_ignore_for_model(model, frozen)
        self.module = (
            DDP(
                model,
                device_ids=[self.device.index] if self.device.type == "cuda" else None,
                bucket_cap_mb=DDP_BUCKET_MB,
                gradient_as_bucket_view=True,  # grads are views into the buckets: no extra copy
                process_group=ctx.dp_group,  # every rank, or the ranks of this TP index
            )
            if self.dp > 1
            else model
        )
        params = dict(model.named_parameters())
        self.params = [params[s.name] for c in self.local_layout for s in c.slots]
        # under TP the global norm counts a replicated gradient once (_norm)
        slots = [s for c in self.local_layout for s in c.slots]
        self.split = [params[s.name] for s in slots if s.split is not None]
        self.replicated = [params[s.name] for s in slots if s.split is None]
        named = [(s.name, params[s.name]) for c in self.local_layout for s in c.slots]
        decay = [p for n, p in named if decays(n, p.ndim)]  # the layout's rule
        no_decay = [p for n, p in named if not decays(n, p.ndim)]
        self.opt = torch.optim.AdamW(
            [
                {"params": decay, "weight_decay": ocfg.weight_decay},
                {"params": no_decay, "weight_decay": 0.0},
            ],
            lr=0.0,
            betas=(ocfg.beta1, ocfg.beta2),
            eps=ocfg.eps,
            fused=True,
        )
        self.scaler = LossScaler(pcfg)
        self.autocast_dtype = AUTOCAST[pcfg.precision]

    def _adapt(self, model: DecoderLM, adapter: AdapterConfig, seed: int) -> None:
        """LoRA (fitgpt/adapters): every base parameter frozen, the adapters attached and
        initialised as PEFT does from `seed`; from here `layout` is the adapters' chunks."""
        targets = lora_targets(self.model_cfg, adapter)
        attach_lora(model, targets, adapter)
        init_lora(model, targets, seed)
        self.frozen = FrozenBase(self, self.layout)
        self.layout = self.local_layout = chunk_layout(model, trained=True)

    def _adapt_packed(self, model: DecoderLM, adapter: AdapterConfig, seed: int) -> None:
        """LoRA on a base held in --base-format, its last --base-host-blocks blocks in pinned
        host RAM (engine/chunked/frozen.py): the model stays on the meta device until each part
        has its home; the blocks' weights are made (seeded, or read later by `frozen`) one block
        at a time into their packed form, so no whole base is ever materialised in fp32."""
        targets = lora_targets(self.model_cfg, adapter)
        attach_lora(model, targets, adapter)  # on meta: the adapters' shapes
        working = AUTOCAST[self.pcfg.precision] or torch.float32
        fmt = base_format(adapter, self.pcfg.precision)
        self.store = FrozenStore(
            model, self.layout, fmt, working, adapter.base_host_blocks or 0, self.device,
            disk_blocks=adapter.base_disk_blocks or 0, nvme_path=self.ecfg.nvme_path,
            peers=self._base_peers(adapter),
        )  # fmt: skip
        # the rest on the device: the adapters in fp32, the embedding and head as the blocks'
        # vectors (fp32 for an fp32 base, else the compute dtype); tied weights stay tied
        outer = torch.float32 if fmt == "fp32" else working
        made: dict[int, nn.Parameter] = {}
        for module in model.modules():
            for name, p in list(module._parameters.items()):
                if p is None or not p.is_meta:
                    continue
                if id(p) not in made:
                    dtype = torch.float32 if p.requires_grad else outer
                    t = torch.empty(p.shape, dtype=dtype, device=self.device)
                    made[id(p)] = nn.Parameter(t, requires_grad=p.requires_grad)
                module._parameters[name] = made[id(p)]
        model.materialize_buffers(self.device)
        init = self.view.init(partial(model.init_parameter_, seed=seed))
        with torch.no_grad():
            for name, p in model.named_parameters():
                if p.requires_grad:
                    continue
                chunk = name.split(".")[:2]
                if chunk[0] == "blocks":
                    continue
                if p.dtype == torch.float32:
                    init(name, p)
                else:  # drawn in fp32 as the plain engine draws it, then rounded
                    t = torch.empty(p.shape, dtype=torch.float32, device=self.device)
                    init(name, t)
                    p.copy_(t)
            for c in self.store.chunks:  # one block's fp32 at a time
                flat = torch.empty(c.spec.numel, dtype=torch.float32, device=self.device)
                for s in c.spec.slots:
                    init(s.name, flat[s.offset : s.offset + s.numel].view(s.shape))
                c.load(flat)
                del flat
        init_lora(model, targets, seed)
        self.frozen = FrozenBase(self, self.layout)
        self.layout = self.local_layout = chunk_layout(model, trained=True)

    def _base_peers(self, adapter: AdapterConfig) -> Peers | None:
        """The data-parallel ranks a sharded base (--base-sharded) is cut over; None: whole."""
        ctx = self.ctx
        dp = ctx.dp_world if ctx.distributed else 1
        if not adapter.base_sharded or dp == 1:
            return None
        return Peers(ctx.dp_group, dp, ctx.dp_rank)

    @torch.no_grad()
    def _init(self, model: DecoderLM, seed: int) -> None:
        """The seeded initial weights; under TP each rank's part of the unsplit model's."""
        init = self.view.init(partial(model.init_parameter_, seed=seed))
        for name, p in model.named_parameters():
            init(name, p)

    def _norm(self, grads: list[torch.Tensor]) -> torch.Tensor:
        """The global gradient norm: under TP the split gradients' squares summed over the TP
        group, the replicated ones' (equal on every TP rank) counted once."""
        if self.mesh is None:
            return total_norm(grads)
        split = [p.grad for p in self.split if p.grad is not None]
        rep = [p.grad for p in self.replicated if p.grad is not None]
        sq = total_norm(split).square() + total_norm(rep).square() / self.mesh.tp
        return TPGradNorm(self.mesh).total(sq.to(self.device)).sqrt()

    def _autocast(self):
        if self.autocast_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self.autocast_dtype)

    def _to_device(self, t: torch.Tensor) -> torch.Tensor:
        return batch_to(t, self.device)

    def train_step(self, micro_batches: list[Batch], lr: float) -> StepStats:
        for g in self.opt.param_groups:
            g["lr"] = lr
        n, scale = len(micro_batches), self.scaler.scale
        loss_sum = torch.zeros((), device=self.device)
        # each micro-batch's share of the step's token mean (engine/base.py loss_weights)
        weights, counted = loss_weights(micro_batches, self.device, self._dp_sum, self.dp)
        for i, b in enumerate(micro_batches):
            x, y, seg = (None if t is None else self._to_device(t) for t in Batch(*b))
            last = i == n - 1
            sync = (
                contextlib.nullcontext()
                if last or self.module is self.model
                else self.module.no_sync()
            )
            with sync:
                with self._autocast():
                    loss = step_share(self.model, partial(self._forward, x, y, seg), weights[i])
                (loss * (scale / n)).backward()
            loss_sum += loss.detach()
        if self.ecfg.sequence_parallel:  # replicated gradients: partial sums over the tokens
            sync_replicated([p.grad for p in self.replicated if p.grad is not None], self.mesh)
        grads = [p.grad for p in self.params if p.grad is not None]
        if scale != 1.0:
            torch._foreach_mul_(grads, 1.0 / scale)
        norm = self._norm(grads)
        if self.ocfg.grad_clip > 0:
            coef = torch.clamp(self.ocfg.grad_clip / (norm + 1e-6), max=1.0)
            torch._foreach_mul_(grads, coef)
        loss_avg = loss_sum / n
        if self.dp > 1:
            work = dist.all_reduce(loss_avg, group=self.ctx.dp_group, async_op=True)
            comm.wait(work, "all-reduce loss (after DDP's gradient all-reduce)", self.ctx.rank)
            loss_avg /= self.dp
        stats = torch.stack([loss_avg, norm.to(loss_avg), counted.to(loss_avg)])
        loss_v, norm_v, counted_v = stats.tolist()  # host sync
        overflow = not (norm_v == norm_v and abs(norm_v) != float("inf"))
        if not overflow and counted_v > 0:  # no counted target: nothing to learn, no update
            self.opt.step()
        self.scaler.update(overflow)
        self.opt.zero_grad(set_to_none=True)  # free the gradients until the next backward
        return StepStats(loss_v, norm_v, scale, overflow, int(counted_v))

    def _forward(self, x, y, seg):
        """The model's mean loss; segments passed only for packed data (a plain batch calls the
        model exactly as before: DDP's forward and every hook see the same call)."""
        return self.module(x, y) if seg is None else self.module(x, y, segments_BT=seg)

    def _dp_sum(self, t: torch.Tensor) -> None:
        """t summed over the data-parallel ranks, in place (the device waits, not the host)."""
        if self.dp > 1:
            work = dist.all_reduce(t, group=self.ctx.dp_group, async_op=True)
            comm.wait(work, "all-reduce counted targets", self.ctx.rank)

    @torch.no_grad()
    def eval_loss(self, batches: list[Batch]) -> float:
        self.model.eval()

        def loss_of(b: Batch) -> torch.Tensor:
            x, y, seg = (None if t is None else self._to_device(t) for t in b)
            with self._autocast():
                loss = self.model(x, y) if seg is None else self.model(x, y, segments_BT=seg)
            return loss.float()

        loss = token_mean(loss_of, batches, self.device, self._dp_sum)
        self.model.train()
        return loss

    # ---- checkpoints ---------------------------------------------------------------------
    def _flat(self, chunk, getter) -> torch.Tensor:
        params = dict(self.model.named_parameters())
        return torch.cat(
            [getter(params[s.name]).detach().reshape(-1).float().cpu() for s in chunk.slots]
        )

    def save_state(self, folder: Path, optimizer: bool = True) -> None:
        # every data-parallel rank holds the same state: rank 0 writes it once (under TP, its
        # TP group gathers the splits first)
        if self.ctx.dp_rank != 0 or (self.mesh is None and not self.ctx.is_main):
            return

        def moment(key):
            def get(p):
                st = self.opt.state.get(p)
                return st[key] if st else torch.zeros_like(p)

            return get

        getters = {"master": lambda p: p}
        if optimizer:
            getters.update(exp_avg=moment("exp_avg"), exp_avg_sq=moment("exp_avg_sq"))
        local = ((c, {k: self._flat(c, g) for k, g in getters.items()}) for c in self.local_layout)
        pieces = self.view.pieces(local)  # under TP whole tensors, gathered over the group
        if self.ctx.is_main:
            write_pieces(folder, 0, pieces)
        else:
            for _ in pieces:  # the other ranks of rank 0's TP group take part in the gathers
                pass

    def load_state(self, folder: Path, extra: dict, optimizer: bool = True) -> None:
        """Weights and optimizer state; with optimizer=False (a weights-only checkpoint) the
        weights alone and no optimizer state, as in a fresh run (AdamW starts it at step 1)."""
        self._load(self.local_layout, folder, extra, optimizer)

    @torch.no_grad()
    def _load(
        self, layout: list[ChunkSpec], folder, extra: dict, optimizer: bool, base: bool = False
    ) -> None:
        """The parameters of `layout` (what trains, or with `base` the frozen base: its blocks
        packed into the store, if it has one) from `folder`."""
        reader = self.view.reader(folder)  # under TP the whole chunks read, this rank's parts kept
        params = dict(self.model.named_parameters())
        step = int(extra.get("optimizer_step", 0)) if optimizer else 0
        kinds = ("master", "exp_avg", "exp_avg_sq") if optimizer else ("master",)
        for c in layout:
            if base and self.store is not None and c.name in self.store.by_name:  # packed
                self.store.by_name[c.name].load(reader.read(c.index, "master", 0, c.numel))
                continue
            flat = {k: reader.read(c.index, k, 0, c.numel) for k in kinds}
            for s in c.slots:
                p = params[s.name]
                view = {k: v[s.offset : s.offset + s.numel].view(s.shape) for k, v in flat.items()}
                p.copy_(view["master"])
                self.opt.state.pop(p, None)
                if step > 0:
                    self.opt.state[p] = {
                        # fused AdamW keeps its step counter as a float32 tensor on the device
                        "step": torch.tensor(float(step), dtype=torch.float32, device=p.device),
                        "exp_avg": view["exp_avg"].to(p.device, p.dtype).clone(),
                        "exp_avg_sq": view["exp_avg_sq"].to(p.device, p.dtype).clone(),
                    }
        if optimizer:
            self.scaler.load_state_dict(extra["scaler"])

    def extra_state(self) -> dict:
        steps = [int(st["step"].item()) for st in self.opt.state.values() if "step" in st]
        return {"optimizer_step": max(steps, default=0), "scaler": self.scaler.state_dict()}

    def describe(self) -> dict:
        out = super().describe()
        where = f"replicated on {self.dp} rank(s)"
        if self.mesh is not None:
            where = f"1/{self.mesh.tp} of each layer (tensor-parallel), {where}"
        what = "every parameter, gradient and Adam moment"
        if self.frozen is not None:
            what = (
                "the frozen base's weights, and the adapters with their gradients and Adam moments,"
            )
        placement = f"{what} in fp32 on the device, {where}"
        if self.store is not None:
            c = self.store.chunks[0]
            held = sum(not c.streamed for c in self.store.chunks)
            disk = sum(c.on_disk for c in self.store.chunks)
            placement = (
                f"the frozen base's blocks in {c.codec.fmt} ({held} on the device, "
                f"{len(self.store.chunks) - held} streamed from host RAM"
                + (f", {disk} of them read from the disk" if disk else "")
                + (f", each cut over {self.store.fetch.peers.world} ranks" if c.s != c.N else "")
                + ", each unpacked to "
                f"{str(c.codec.working).removeprefix('torch.')} while it runs), the adapters "
                f"with their gradients and Adam moments in fp32 on the device, {where}"
            )
        out.update(engine="ddp", placement=placement)
        if self.dp > 1:
            out["streams"] = ["DDP's bucketed all-reduce, overlapped with the backward"]
        return out

    def memory_report(self) -> dict[str, dict[str, int]]:
        def nbytes(ts):
            return sum(t.numel() * t.element_size() for t in ts if t is not None)

        states = [st for st in self.opt.state.values()]
        dev = self.device.type
        held = {
            "master_weights": nbytes(self.params),  # fp32 params are the master copy
            "grads": nbytes(p.grad for p in self.params),
            "optimizer": nbytes(
                [st["exp_avg"] for st in states] + [st["exp_avg_sq"] for st in states]
            ),
        }
        if self.store is not None:  # a packed base: its blocks' bytes by tier, the rest
            tiers = self.store.held_bytes()
            blocks = {id(p) for c in self.store.chunks for p in c.params}
            rest = (
                p for p in self.model.parameters() if not p.requires_grad and id(p) not in blocks
            )
            held["frozen_weights"] = tiers["device"] + nbytes(rest)
            out = {dev: held}
            if dev != "cpu":
                out["cpu"] = {"frozen_weights": tiers["host"]}
            else:
                held["frozen_weights"] += tiers["host"]
            if tiers["disk"]:
                out["nvme"] = {"frozen_weights": tiers["disk"]}
            return out
        elif self.frozen is not None:  # an adapter run's base: weights alone
            held["frozen_weights"] = nbytes(
                p for p in self.model.parameters() if not p.requires_grad
            )
        return {dev: held}

    def close(self) -> None:
        """A packed base's hooks removed and its pinned host RAM unregistered (idempotent)."""
        if self.store is not None:
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)  # no copy may still read a pinned buffer
            self.store.close()

    def inference_model(self) -> DecoderLM:
        if self.mesh is None and self.ctx.cp is None:
            return self.model
        # the whole weights, gathered over TP; a context-parallel model's are whole already, but
        # it takes slices of rows and trades heads: a plain model samples
        model = build_model(self.model_cfg).to(self.device)
        unsplit = self.view.unsplit or (lambda name, t: t)
        with torch.no_grad():
            for name, p in self.model.named_parameters():
                dict(model.named_parameters())[name].copy_(unsplit(name, p.detach()))
        return model.eval()


class FrozenBase(FrozenWeights):
    """A TorchEngine's frozen base (an adapter run's): its parameters, read from a checkpoint
    folder or a WeightSource in the whole model's `layout`."""

    def __init__(self, engine: TorchEngine, layout: list[ChunkSpec]) -> None:
        self.engine, self.layout = engine, layout

    def load_state(self, folder, extra: dict, optimizer: bool = False) -> None:
        self.engine._load(self.layout, folder, extra, optimizer=False, base=True)
