"""Where every chunk's state lives, in which format, and what it costs: one value, the Placement.

It is computed once, from the model's chunk layout, the engine config and the world size, and
everything that needs those facts reads it: the planner's memory and step-time models
(plan/memory.py, plan/throughput.py), the host-RAM and disk checks, the engine (which builds each
chunk from its ChunkPlan) and the checkpoint writer. So the bytes the planner prices are the
bytes the engine holds, by construction (tests/test_plan.py checks them against the tensors).

Tiers are filled in the order GPU, host RAM, disk. Only the last `offload_blocks` transformer
blocks send their fp32 master weights and Adam moments to the offload tier: the next step's
forward needs the first blocks first, so their updates (on the GPU) are ready at once while the
host finishes the last blocks' updates during that forward. Of the offloaded blocks the last
`nvme_blocks` keep that state in files (their updates are needed last); the disk is ~30× slower
to stream than host RAM.

Shape legend (elements, per chunk): n the parameters, N = n padded to a multiple of world·ALIGN,
s = N/W one rank's shard; a rank's optimizer range is s at ZeRO stage ≥ 1, else N.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from fitgpt.engine.config import EngineConfig
from fitgpt.engine.formats.compact import piece_elems, state_layout
from fitgpt.engine.formats.moments import store_nbytes
from fitgpt.engine.layout import ChunkSpec
from fitgpt.errors import UserError

ALIGN = 128  # shard boundaries on 256-byte multiples (bf16): aligned NCCL and vector loads
HOST_SLOTS = 3  # chunks in flight between the GPU and the host optimizer (pinned staging)
MAX_INFLIGHT = 2  # gradient reductions in flight at once: bounds the transient full gradients


def padded(n: int, world: int) -> int:
    m = world * ALIGN
    return -(-n // m) * m


@dataclass(frozen=True)
class ChunkPlan:
    """One chunk on one rank: its sizes, and the home and format of each kind of state."""

    spec: ChunkSpec
    N: int  # padded elements of the whole chunk
    shard: int  # N / world
    opt_elems: int  # this rank's optimizer range
    home: str  # master weights and moments: "device", "cpu" (host RAM) or "nvme" (files)
    moments: str  # the moments' format: fp32, bf16 or int8 (engine/formats/moments.py)
    weights: str  # working weights: "device", "sharded" (stage 3, gathered per use), "host"
    # the master's format: "alias" (fp32 compute on its device: the working weights are the
    # master), "fp32", or "split" (the bf16 working weight plus an int16 remainder)
    master: str = "fp32"
    # how the ZeRO stage shards this chunk, decided here and read by the engine's parts and the
    # planner's prices (no part sees the stage): the optimizer state and its update cut into 1/W
    # shards (stage >= 1), the gradients reduce-scattered every micro-batch into a shard (stage
    # >= 2), a block's weights kept as 1/W shards and all-gathered before each use (stage 3:
    # `weights` "sharded", or "host" where the shard is streamed in from host RAM first)
    shard_opt: bool = False
    shard_grads: bool = False
    gather_weights: bool = False

    @property
    def compact(self) -> bool:
        """State kept by engine/formats/compact.py (stepped in pieces through fp32 scratch)."""
        return self.master == "split" or self.moments != "fp32"

    def state_layout(self) -> dict[str, int]:
        """{name: bytes} of this rank's optimizer-state tensors (the disk tier's files)."""
        return state_layout(self.opt_elems, self.master, self.moments, self.compact)

    def state_nbytes(self) -> int:
        """Bytes of this rank's master weights and moments (what the disk tier moves)."""
        return sum(self.state_layout().values())

    @property
    def block(self) -> bool:
        return self.spec.name.startswith("block.")

    @property
    def gathers_updated(self) -> bool:
        """Each rank updates its shard of weights that every rank holds whole (stages 1-2):
        the updated shards are all-gathered after the step."""
        return self.shard_opt and self.weights == "device"

    @property
    def offloaded(self) -> bool:
        return self.home != "device"

    @property
    def on_disk(self) -> bool:
        return self.home == "nvme"

    @property
    def streamed(self) -> bool:
        """Working weights in pinned host RAM, copied in just before each use."""
        return self.weights == "host"


@dataclass(frozen=True)
class Placement:
    chunks: tuple[ChunkPlan, ...]
    world: int
    stage: int
    w: int  # bytes of one working element: 2 (bf16/fp16) or 4 (fp32)
    offloaded_blocks: int
    nvme_blocks: int
    device: str = "cuda"  # the compute device's type (the compact update's piece size)
    # host RAM (bytes) the user stated the machine gives (EngineConfig.cpu_mem; 0: measured),
    # which the host-RAM check (engine/chunked/accounting.py) holds host_bytes() against
    cpu_mem: int = 0
    # False for --engine ddp: plain PyTorch holds the model's own fp32 parameters (its state is
    # plan/memory.py torch_state, not these chunks' bytes), reduces fp32 gradients and autocasts
    chunked: bool = True

    @classmethod
    def of(
        cls,
        layout: list[ChunkSpec],
        ecfg: EngineConfig,
        world: int,
        w: int,
        device: str = "cuda",
    ) -> Placement:
        """The placement of `layout` under `ecfg` on `world` ranks (w bytes per working
        element, compute on `device`); a block count the model does not have is refused in one
        line. Formats left "auto" are fp32 here: the planner replaces them before pricing."""
        layers = sorted({c.layer for c in layout if c.layer is not None})
        k = offloaded_blocks(ecfg, len(layers))
        d = disk_blocks(ecfg, k)
        homes = {c.index: "device" for c in layout}
        tier = {
            layer: "nvme" if j >= k - d else "cpu"
            for j, layer in enumerate(layers[-k:] if k else [])
        }
        for c in layout:
            # a sparse block's two chunks go together, or (--offload-experts) its experts alone
            if c.layer in tier and (c.experts or not ecfg.offload_experts):
                homes[c.index] = tier[c.layer]
        stage = ecfg.zero_stage if ecfg.engine == "zero" else 0
        # the experts' chunks are reduced and sharded over the ranks that hold the same experts
        # (world / P under expert parallelism), every other chunk over the whole world
        ep = max(1, ecfg.expert_parallel)
        chunks = tuple(
            _chunk(c, homes[c.index], ecfg, world // ep if c.experts else world, stage, w)
            for c in layout
        )
        return cls(chunks, world, stage, w, k, d, device, ecfg.cpu_mem, ecfg.engine == "zero")

    # ---- views ----------------------------------------------------------------------------
    @property
    def hosted(self) -> list[ChunkPlan]:
        return [c for c in self.chunks if c.offloaded]

    @property
    def compact(self) -> bool:
        return any(c.compact for c in self.chunks)

    @property
    def streams(self) -> bool:
        return any(c.streamed for c in self.chunks)

    @property
    def resident(self) -> bool:
        """No chunk is updated on the host or streamed in: nothing waits on the host between
        blocks (what lets --compile take the whole model as one graph,
        engine/transforms/compile.py)."""
        return not any(c.offloaded or c.streamed for c in self.chunks)

    @property
    def replicated(self) -> bool:
        """Every rank holds the whole optimizer state (stage 0): rank 0 alone writes it to a
        checkpoint, the others' copies being the same; otherwise every rank writes its shard."""
        return not any(c.shard_opt for c in self.chunks)

    @property
    def scatters_grads(self) -> bool:
        """Gradients are reduce-scattered into shards every micro-batch (stage >= 2), not
        accumulated whole and reduced once per step."""
        return any(c.shard_grads for c in self.chunks)

    @property
    def gathers_weights(self) -> bool:
        """Blocks' weights are kept as 1/W shards, all-gathered before each use (stage 3)."""
        return any(c.gather_weights for c in self.chunks)

    @property
    def fetches_weights(self) -> bool:
        """Some block's weights are absent between uses (gathered at stage 3, or streamed in
        from host RAM): the engine fetches them ahead of each use."""
        return any(c.weights != "device" for c in self.chunks)

    def refusal(self, precision: str) -> str | None:
        """The one line refusing what this placement cannot run under `precision`, or None."""
        split = any(c.master == "split" for c in self.chunks)
        return (
            (split and split_master_refusal(precision))
            or (self.streams and stream_refusal(self.world, self.stage))
            or None
        )

    def offloaded_elems(self) -> int:
        """Optimizer elements this rank updates on the host (host RAM and disk tiers)."""
        return sum(c.opt_elems for c in self.hosted)

    def on_disk_elems(self) -> int:
        return sum(c.opt_elems for c in self.chunks if c.on_disk)

    def streamed_elems(self) -> int:
        """Working-weight elements this rank streams in from host RAM per use of every block."""
        return sum(c.shard for c in self.chunks if c.streamed)

    # ---- bytes ----------------------------------------------------------------------------
    def state_bytes(self) -> dict[str, dict[str, int]]:
        """Bytes of persistent state this rank holds, {"device": ..., "host": ..., "nvme": ...}:
        exactly what ChunkEngine.memory_report() measures ("device" is the compute device)."""
        w = self.w
        dev = {"weights": 0, "weight_shards": 0, "grads": 0, "master_weights": 0, "optimizer": 0}
        host = {"master_weights": 0, "optimizer": 0, "host_staging": 0}
        nvme = {"master_weights": 0, "optimizer": 0}
        for c in self.chunks:
            if c.streamed:
                host["weights"] = host.get("weights", 0) + c.shard * w  # pinned
            elif c.weights == "sharded":
                dev["weight_shards"] += c.shard * w
            else:
                dev["weights"] += c.N * w
            dev["grads"] += (0 if c.shard_grads else c.N * w) + (c.shard * w if c.shard_opt else 0)
            where = {"device": dev, "cpu": host, "nvme": nvme}[c.home]
            where["master_weights"] += {"alias": 0, "fp32": 4, "split": 2}[c.master] * c.opt_elems
            where["optimizer"] += 2 * store_nbytes(c.moments, c.opt_elems)
        biggest = max((c.opt_elems for c in self.hosted), default=0)
        if biggest:
            # the host optimizer: staging buffers in the working dtype, and an fp32 gradient
            # for chunks in fp32 formats (compact ones upcast piece by piece in their scratch)
            plain = max((c.opt_elems for c in self.hosted if not c.compact), default=0)
            host["host_staging"] = HOST_SLOTS * biggest * w + 4 * plain
        # a split master whose working weights are on the GPU: the worker needs their bits too
        fetched = [c.opt_elems for c in self.hosted if c.master == "split" and not c.streamed]
        if fetched and self.device == "cuda":
            host["weight_staging"] = HOST_SLOTS * max(fetched) * w
        for name, tier in (("device", dev), ("host", host)):
            if self.scratch_elems(name):
                tier["compact_scratch"] = 16 * self.scratch_elems(name)  # 4 fp32 pieces
        out = {"device": dev, "host": host}
        disk = [c.state_nbytes() for c in self.chunks if c.on_disk]
        if disk:
            host["nvme_swap"] = HOST_SLOTS * max(disk)  # one disk chunk's state per slot
            out["nvme"] = nvme
        return out

    def scratch_elems(self, tier: str) -> int:
        """Elements per piece of the compact update's scratch on `tier` ("device": the main
        thread's, "host": the host optimizer worker's; engine/formats/compact.py), 0 where no chunk
        there is compact: a piece, or the largest such chunk if it is smaller."""
        homes = ("device",) if tier == "device" else ("cpu", "nvme")
        elems = [c.opt_elems for c in self.chunks if c.compact and c.home in homes]
        on = "cuda" if tier == "device" and self.device == "cuda" else "cpu"
        return min(max(elems), piece_elems(torch.device(on))) if elems else 0

    def disk_traffic(self) -> tuple[int, int]:
        """Bytes this rank reads from and writes to the disk tier per optimizer step (every
        disk-homed chunk's state, in its formats, read in and written back once)."""
        b = sum(c.state_nbytes() for c in self.chunks if c.on_disk)
        return b, b

    def host_bytes(self) -> int:
        """Host RAM this rank's offloaded state takes (0 with nothing offloaded)."""
        return sum(self.state_bytes()["host"].values()) if self.hosted else 0

    def disk_bytes(self) -> int:
        return sum(self.state_bytes().get("nvme", {}).values())

    def describe(self) -> str:
        """One line: where the blocks' state lives."""
        n = len({c.spec.layer for c in self.chunks if c.block})
        where = "all on the device"
        if self.offloaded_blocks:
            where = (
                f"the optimizer state of the last {self.offloaded_blocks} of {n} blocks on the host"
            )
            if self.nvme_blocks:
                where += f" ({self.nvme_blocks} of them in files)"
            if self.streams:
                where += ", their weights streamed from host RAM"
        return f"ZeRO stage {self.stage} on {self.world} rank(s), {where}"


# ---- what a placement cannot be (plan/validate.py asks before torchrun, the engine at build)
def stream_refusal(dp: int, stage: int) -> str | None:
    """Streamed weights on several data-parallel ranks need ZeRO-3: each rank streams its own
    shard, and only stage 3 gathers the whole weights per use."""
    if dp > 1 and stage < 3:
        return (
            f"--offload-params cpu on {dp} data-parallel ranks streams each rank's shard of the "
            "weights: use --zero-stage 3"
        )
    return None


def split_master_refusal(precision: str) -> str | None:
    """A split master keeps its high half in the bf16 working weights: fp16 has other bits."""
    if precision == "fp16":
        return (
            "--master split shares the master's high half with bf16 working weights: use "
            "--precision bf16, or --master fp32 with fp16"
        )
    return None


def offloaded_blocks(ecfg: EngineConfig, blocks: int) -> int:
    """How many (last) blocks send their optimizer state to the offload tier."""
    if ecfg.offload_optimizer == "none":
        return 0
    k = blocks if ecfg.offload_blocks is None else ecfg.offload_blocks
    if k > blocks:
        raise UserError(f"--offload-blocks {k}: the model has {blocks} transformer blocks")
    return k


def disk_blocks(ecfg: EngineConfig, offloaded: int) -> int:
    """How many of the offloaded blocks keep their optimizer state in files."""
    if ecfg.offload_optimizer != "nvme":
        return 0
    d = offloaded if ecfg.nvme_blocks is None else ecfg.nvme_blocks
    if d > offloaded:
        raise UserError(
            f"--nvme-blocks {d}: only {offloaded} blocks are offloaded; use at most that many"
        )
    return d


def _chunk(
    c: ChunkSpec, home: str, ecfg: EngineConfig, world: int, stage: int, w: int
) -> ChunkPlan:
    N = padded(c.numel, world)
    s = N // world
    block = c.name.startswith("block.")
    if ecfg.offload_params == "cpu" and home != "device" and block:
        weights = "host"
    elif stage >= 3 and block:
        weights = "sharded"  # the embedding and head stay resident: the tied one is used twice
    else:
        weights = "device"
    moments = ecfg.moments if home != "device" else ecfg.device_moments
    moments = "fp32" if moments == "auto" else moments
    if w == 4:
        # fp32 compute: a device-homed master is the weights themselves; an offloaded one has
        # no bf16 half to share, so a split master is a plain fp32 one
        master = "alias" if home == "device" else "fp32"
    else:
        master = "split" if ecfg.master == "split" else "fp32"
    return ChunkPlan(
        c, N, s, s if stage >= 1 else N, home, moments, weights, master,
        shard_opt=stage >= 1, shard_grads=stage >= 2, gather_weights=stage >= 3 and block,
    )  # fmt: skip
