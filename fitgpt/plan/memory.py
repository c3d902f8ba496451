"""The memory model: bytes per rank, per device, for a workload under a plan.

One source of truth: the planner decides with it, the tests check it against the bytes the
engines report holding, and docs/memory.md derives every term. Persistent state is computed
from the same chunk layout and padding the engine uses, so it is exact; activations, logits and
transients are first-principles estimates checked against torch.cuda.max_memory_allocated on
GPUs (benchmarks/results/memory_*).

Notation: n parameters, L layers, h hidden, S sequence, b micro-batch, V padded vocabulary,
W data-parallel ranks, w bytes per working element (2 for bf16/fp16, 4 for fp32), sbh = S·b·h,
T tensor-parallel ranks (--tensor-parallel): the job's ranks are T × W; persistent state is
priced from this rank's chunk layout (the split model's: 1/T of every split weight), and the
activations inside attention and the MLP are 1/T per rank (fitgpt/parallel).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field, replace

import torch

from fitgpt.dist.mesh import ExpertGroups, Mesh
from fitgpt.engine.chunked.placement import MAX_INFLIGHT, Placement
from fitgpt.engine.config import EngineConfig
from fitgpt.engine.layout import ChunkSpec, chunk_layout
from fitgpt.engine.transforms.compile import compiled
from fitgpt.model import ModelConfig, build_model, family_of
from fitgpt.model.loss import loss_pieces, piece_bytes

GiB = 2**30
# Process baseline RSS: the interpreter, torch, and on GPU machines the CUDA/NCCL libraries.
# Measured: 1.2 GiB on nvidia-h100-x1 (one process), 0.31 GiB on the 2-core CPU box.
HOST_BASE = {"cuda": int(1.2 * GiB), "cpu": int(0.32 * GiB)}
HOST_DIST = int(0.3 * GiB)  # more with W > 1: NCCL/gloo state (1.5 GiB measured on 2×H200)
# Outside torch's allocator on each GPU: CUDA context and cuBLAS workspaces (~0.6 GiB), NCCL's
# own buffers when W > 1 (~0.5 GiB); plus a fragmentation margin on what torch allocates.
CUDA_CONTEXT = int(0.6 * GiB)
NCCL_BUFFERS = int(0.5 * GiB)
FRAGMENTATION = 0.04
# A plan may fill each GPU only up to its memory less this share. Over the 113 GPU trials
# recorded in benchmarks/results/ (2026-11-22, H100 and H200, 0.1-14 B, every engine and tier)
# the model's allocator peak was 0.7% to 15% ABOVE the measured one, never below, and its total
# adds the 4% fragmentation margin above. Those trials share one vocabulary and sequence length;
# the margin covers shapes the model has not been checked on (the one OOM on record came from a
# model other than the one planned). 2% of 80 GB is 1.6 GiB, about 0.1 B parameters of capacity.
GPU_SAFETY_MARGIN = 0.02


def gpu_budget(gpu_mem: int) -> int:
    """The bytes of a GPU of `gpu_mem` bytes that a plan may fill."""
    return int(gpu_mem * (1 - GPU_SAFETY_MARGIN))


def tokens_per_step(micro_batch: int, grad_accum: int, seq_len: int, dp_ranks: int = 1) -> int:
    """Tokens one optimizer step trains on: `grad_accum` micro-batches of `micro_batch`
    sequences of `seq_len` tokens on each of `dp_ranks` data-parallel ranks. The one rank
    convention: under T-way tensor parallelism the data-parallel ranks are world / T (the T ranks
    of a group share every micro-batch, so they add no tokens); dp_ranks=1 counts one rank's
    share. The warm-up (train/schedule.py) counts these tokens; the planner (Workload below),
    `fitgpt plan`'s table, resume's changed-settings line and the benchmark harness count with
    the same function."""
    return micro_batch * grad_accum * dp_ranks * seq_len


@dataclass(frozen=True)
class Workload:
    model: ModelConfig
    micro_batch: int
    world: int = 1
    precision: str = "bf16"  # resolved: bf16, fp16 or fp32
    device: str = "cuda"  # where compute runs: cuda or cpu
    # the run's optimizer steps: what --compile auto weighs a compile against (0: not known,
    # priced as a short run, which compiles nothing)
    steps: int = 0
    # machines the world spans, world/nodes ranks on each (the collectives' links: plan/links.py)
    nodes: int = 1

    @property
    def ranks_per_node(self) -> int:
        return max(1, self.world // max(1, self.nodes))

    @property
    def w(self) -> int:
        return 4 if self.precision == "fp32" else 2

    def dp_ranks(self, tp: int = 1) -> int:
        """The data-parallel ranks under T-way tensor parallelism: the world over T."""
        return self.world // max(1, tp)

    def tokens_per_step(self, grad_accum: int, tp: int = 1, cp: int = 1) -> int:
        """Tokens one optimizer step of the job trains on, over its world/(T·C) data-parallel
        ranks: C context-parallel ranks share each sequence (tokens_per_step above, the one rank
        convention)."""
        ranks = self.dp_ranks(tp) // max(1, cp)
        return tokens_per_step(self.micro_batch, grad_accum, self.model.seq_len, ranks)


@dataclass
class Estimate:
    """Bytes per rank. `compute` is the compute device (the GPU, or the CPU for CPU runs)."""

    compute: dict[str, int] = field(default_factory=dict)
    host: dict[str, int] = field(default_factory=dict)
    nvme: dict[str, int] = field(default_factory=dict)
    peak_phase: str = ""

    @property
    def compute_peak(self) -> int:
        """What torch.cuda.max_memory_allocated should read (allocator bytes, no context)."""
        return sum(v for k, v in self.compute.items() if not k.startswith("outside:"))

    @property
    def compute_total(self) -> int:
        """What the device must hold: the allocator's peak, a fragmentation margin, the context."""
        outside = sum(v for k, v in self.compute.items() if k.startswith("outside:"))
        return int(self.compute_peak * (1 + FRAGMENTATION)) + outside

    @property
    def host_total(self) -> int:
        return sum(self.host.values())


def layout_of(model: ModelConfig, tp: int = 1, ep: int = 1) -> list[ChunkSpec]:
    """The chunk layout of one rank: the model's, or with tp > 1 the split model's, or with
    ep > 1 the model holding E/P experts of each sparse layer."""
    return list(_layout(model, max(1, tp), max(1, ep)))


@functools.lru_cache(maxsize=64)
def _layout(model: ModelConfig, tp: int = 1, ep: int = 1) -> tuple[ChunkSpec, ...]:
    # building the model on the meta device takes ~3 ms a block; the capacity search and the
    # refusal's "what fits" plan the same sizes many times over
    with torch.device("meta"):
        m = build_model(model)
        if tp > 1:  # the shapes of TP rank 0 (every rank's are the same); no group needed
            from fitgpt.parallel import parallelize

            m = parallelize(m, Mesh(tp, 1, 0, 0, None, None))
        if ep > 1:  # the shapes of EP rank 0 (every rank's are the same); no group needed
            from fitgpt.parallel.experts import expert_parallel

            m = expert_parallel(m, ExpertGroups(ep, 0, None, 1, 0, None))
        return tuple(chunk_layout(m))


def tp_of(ecfg: EngineConfig) -> int:
    return max(1, ecfg.tensor_parallel)  # 0 (auto) is the planner's to replace before pricing


def ep_of(ecfg: EngineConfig) -> int:
    return max(1, ecfg.expert_parallel)


def rank_layout(work: Workload, ecfg: EngineConfig, layout: list[ChunkSpec] | None):
    """This rank's layout: `layout` (the unsplit model's, given by the caller) unless T > 1 or
    P > 1."""
    tp, ep = tp_of(ecfg), ep_of(ecfg)
    if tp > 1 or ep > 1:
        return layout_of(work.model, tp, ep)
    return layout or layout_of(work.model)


# ---- persistent state ------------------------------------------------------------------------
def shard_ranks(work: Workload, ecfg: EngineConfig) -> int:
    """The ranks the ZeRO state is sharded over: the W = world/T data-parallel ranks, or with
    --shard-within node (HSDP) one node's (each node holds a replica)."""
    ranks = work.ranks_per_node if ecfg.shard_within == "node" else work.world
    return max(1, ranks // tp_of(ecfg))


def placement_of(work: Workload, ecfg: EngineConfig, layout: list[ChunkSpec] | None = None):
    """The Placement the engine would execute for this workload and plan (over the ranks
    shard_ranks gives, with this rank's layout)."""
    dp = shard_ranks(work, ecfg)
    return Placement.of(rank_layout(work, ecfg, layout), ecfg, dp, work.w, work.device)


def zero_state(
    work: Workload, ecfg: EngineConfig, layout: list[ChunkSpec] | None = None
) -> dict[str, dict[str, int]]:
    """Exactly what ChunkEngine.memory_report() returns (engine/chunked/placement.py computes it)."""
    return placement_of(work, ecfg, layout).state_bytes()


def torch_state(work: Workload, layout: list[ChunkSpec] | None = None) -> dict[str, int]:
    """What TorchEngine holds: fp32 parameters (the master copy), fp32 gradients, two moments
    (`layout`: this rank's, under TP)."""
    n = sum(c.numel for c in layout) if layout else work.model.num_params()
    return {"master_weights": 4 * n, "grads": 4 * n, "optimizer": 8 * n}


# ---- activations ----------------------------------------------------------------------------
def attention_path(model: ModelConfig, device: str) -> str:
    """The attention kernel a training forward runs, as the model decides it: "mask" where a
    dense T×T mask or bias is built (model/gpt.py: ALiBi's float bias, [N, T, T]; model/llama.py:
    a sliding window shorter than the sequence on a CPU, a [T, T] boolean, since FlexAttention
    has no CPU backward), "flex" for such a window on CUDA (FlexAttention's block mask: no T×T
    tensor, and the kernel skips the blocks outside the window; model/llama.py on the
    long-context branch), "flash" otherwise (SDPA is_causal: no S² term). Packed rows
    (model/packing.py) are the data's choice, not priced here. A family with attention sinks
    (gpt-oss, families/gpt_oss/model.py SinkMasks) runs FlexAttention on CUDA, whatever its
    windows, and SDPA's math kernel on a mask elsewhere."""
    if model.position == "alibi":
        return "mask"
    if family_of(model).attention_sinks:
        return "flex" if device == "cuda" else "mask"
    W = model.sliding_window
    if W is not None and model.seq_len > W:
        return "flex" if device == "cuda" else "mask"
    return "flash"


def mlp_working_bytes(model: ModelConfig, batch: int, w: int, tp: int = 1, sp: bool = False):
    """(elements per token to take off block_activations' cut, bytes of one piece's transient):
    the one place the planner prices the MLP's working set. A family's MLP runs whole up to a
    size the model decides (model/pieces.py mlp_piece_tokens): its intermediates (Llama: gate
    and up, silu(gate), the product, 4F per token) are then among the saved elements
    block_activations counts, and this returns (0, 0). Past it the MLP runs a piece of tokens at
    a time, each piece checkpointed: a block saves only the piece's input, and one piece of one
    block holds its intermediates and their gradients at once, in the forward and the backward
    (Family.mlp_piece_elems, per rank, tensor and sequence parallelism included)."""
    family = family_of(model)
    piece = family.mlp_piece_elems(model, batch, model.seq_len, tp, sp)
    if not piece:
        return 0, 0
    return family.mlp_activations(model)[0], piece * w


def attention_bytes(work: Workload, tp: int = 1) -> dict[str, int]:
    """Attention's bytes past q, k, v and its output (which block_activations counts), by the
    kernel that runs (attention_path), for one micro-batch on this rank (heads 1/T):
      stats      per block, saved: the softmax's log-sum-exp, fp32 [b, N, S] (flash, flex and
                 the masked kernels alike): 4·N·S·b
      mask       per block, saved with it: a window's [S, S] boolean (S² bytes, CPU), or the
                 ALiBi bias cast to the working dtype, [N, S, S] (N·S²·w; none in fp32)
      shared     once per forward, alive until the backward ends: ALiBi's fp32 bias, N·S²·4
      backward   one block's backward at a time: the kernel's fp32 dq accumulator and the
                 gradients of k and v expanded to the N query heads before the grouped sum:
                 b·S·N·D·(4 + 2w)
    """
    m, b, w = work.model, work.micro_batch, work.w
    S, N = m.seq_len, m.n_head // tp
    out = {"stats": 4 * N * S * b, "mask": 0, "shared": 0}
    out["backward"] = b * S * N * m.head_dim * (4 + 2 * w)
    if attention_path(m, work.device) == "mask":
        if m.position == "alibi":
            out["shared"] = N * S * S * 4
            out["mask"] = N * S * S * w if w != 4 else 0
        else:
            out["mask"] = S * S
    if family_of(m).attention_sinks and attention_path(m, work.device) == "mask":
        # sinks off CUDA run SDPA on a dense mask with grouped kv heads (a [S, 1+S] mask):
        # the math kernel, which holds the weights, [b, N, S, 1+S] in the working dtype, for
        # the backward, and their gradient and the scores' beside them in it. Not priced
        # before: gpt-oss-20b at 4 × 4,096 tokens planned at 133.5 GiB of an H200 ran out of
        # memory in its first backward (results/moe_h200_2026-11-28, before its flex path)
        scores = b * N * S * (S + 1) * w
        out["mask"] += scores
        out["backward"] += 2 * scores
    return out


def activation_bytes(
    work: Workload,
    checkpointing: str,
    tp: int = 1,
    sp: bool = False,
    compiled: bool = False,
    cp: int = 1,
    keep: int = 0,
) -> dict[str, int]:
    """Bytes of the activation peak, as terms of two moments of the last micro-batch's backward
    that never overlap (estimate() takes the larger): the head's, from the loss's forward to
    the final norm's backward ("final_norm", "logits"), and a block's backward
    ("working_gradients", "block_backward"); "activations" (what the blocks hold between their
    forward and backward) and "attention_bias" are alive at both. By the first block's backward
    the head is done: the loss's gradients went into the norm's input gradient and the head
    weight's gradient, and the final norm's saved input was freed.

    Under C-way context parallelism (parallel/context.py) a rank holds S/C tokens of each
    sequence outside attention, and inside it all S tokens of N/C heads: the same element
    counts as S/C tokens of all heads, so a rank is priced as the model at seq_len S/C. What
    that misses: a T×T mask or ALiBi bias (CPU and ALiBi runs only) is S² per rank, not (S/C)².

    Per block, forward saves what the model family says (Family.block_activations: elements per
    token left whole by tensor parallelism, r, and cut by it, c; GPT-2: r = 4h, the LayerNorms'
    inputs and outputs, c = 13h, q/k/v, the attention output and its re-laid copy, the MLP's fc
    and GELU outputs): (r + c)·S·b·w bytes (flash attention: no S² term). Checkpointing keeps
    only each block's input (sbh·w) and recomputes one block at a time in backward. The
    embedding's output is block 0's input, counted there. Beside a block's saved set, its
    backward holds working gradients: with the MLP whole, about 8·sbh·w (GPT-2's fc and GELU
    output gradients, 8h; calibrated on GPT-2 at 1-8 k tokens); with the MLP in pieces those
    are inside one piece's transient, and what remains is attention's side: the stream's
    gradient, the attention output's and q, k, v's, (h + 2·N·D + 2·K·D)·S·b·w. The head's
    moment holds the final norm's input and output (2·sbh·w) and the logits.

    Under T-way tensor parallelism the c part is split by heads and MLP columns, the r part is
    not: (r + c/T)·S·b·w per block; the logits are split by vocabulary (1/T). With sequence
    parallelism (`sp`) the residual stream and the norms are split along the sequence too (the
    column-parallel matmuls keep their input's shard and gather it again in backward): all of it
    1/T, (r + c)·S·b/T per block, the block inputs kept by checkpointing, the final norm and
    backward's working gradients included. Under "full" with the last `keep` = K blocks kept
    (--keep-activations, engine/transforms/activation.py): the n-K recomputed blocks hold their
    inputs and the K kept ones their whole saved sets, (n-K)·sbh·w + K·per_block. The kept
    blocks' backward runs first and frees their sets before the first recompute, whose one set
    is then the largest alive beside the inputs: max(K, 1)·per_block in all. At K = 0 the term
    has always counted the recomputed block's input twice (its set holds the very tensor the
    checkpoint keeps), one sbh·w of slack under its GPU calibration; it is kept at every K, so
    the estimate never falls as K grows (the planner bisects on it) and K = n is checkpointing
    off's plus that one input. Logits past one piece
    (model/loss.py loss_pieces: more than PIECE_LOGITS per rank) are priced as one piece.
    """
    if cp > 1:
        work = replace(work, model=work.model.replace(seq_len=work.model.seq_len // cp))
    m, b = work.model, work.micro_batch
    a = work.w
    sbh = m.seq_len * b * m.n_embd
    whole, cut = family_of(m).block_activations(m)  # elements per token
    unsaved, mlp_piece = mlp_working_bytes(m, b, a, tp, sp)
    cut -= unsaved  # an MLP run in pieces saves only each piece's input (already in `whole`)
    sb = m.seq_len * b
    per_block = (whole * sb + cut * sb // tp) * a
    if sp:
        sbh //= tp  # the stream between the layers: S/T tokens per rank
        per_block = (whole + cut) * sb // tp * a
    attn = attention_bytes(work, tp)
    per_block += attn["stats"] + attn["mask"]
    if checkpointing == "off":
        blocks = m.n_layer * per_block
    elif checkpointing == "full":
        blocks = (m.n_layer - keep) * sbh * a + max(keep, 1) * per_block
        blocks += sbh * a if keep else 0  # K = 0's slack, kept (the docstring)
    else:  # cpu: inputs in pinned host RAM; on the GPU block i's and the prefetched i-1's
        blocks = 2 * sbh * a + per_block
    out = {"activations": blocks}
    # A block's backward, beside its saved set. Measured on an H100 (torch 2.11, 2026-11-27,
    # results/long_h100_2026-11-27), Llama-3.1-8B's shape at 131,072 and 247,808 tokens, eager,
    # checkpointing cpu, MLP and loss in pieces: 61.1 and 53.0 GiB peak, 14.6 sbh·w above the
    # state at both lengths, where 8·sbh·w here plus the head's terms summed in made ~26. On
    # the CPU (benchmarks/memory/long_activation_memory_cpu.py, the same structure at hidden 256) the
    # peak of a block's backward is at attention's: its two block inputs, the saved set less
    # the MLP's, the stream's and attention output's gradients and q, k, v's (1 + 1 + 1.5 sbh
    # at Llama's 8 kv heads of 32), 14.4 sbh with the GPU kernel's workspace below added.
    if mlp_piece:
        N, K, D = m.n_head // tp, m.kv_heads // tp, m.head_dim
        stream = sbh if sp else sb * m.n_embd
        out["working_gradients"] = (stream + sb * (2 * N * D + 2 * K * D)) * a
    else:
        out["working_gradients"] = 8 * sbh * a
    # one block's backward at a time: attention's workspace, then the MLP's (not both at once)
    # (a mixture of experts' MLP backward holds its k rows per token: Family.mlp_backward_bytes)
    moe = family_of(m).mlp_backward_bytes(m, sb, a)
    out["block_backward"] = max(attn["backward"], mlp_piece, moe)
    out["final_norm"] = 2 * sbh * a  # its saved input and its output, the head's input
    if attn["shared"]:
        out["attention_bias"] = attn["shared"]
    # logits in the working dtype, their fp32 copy for a stable softmax, the saved log-probs,
    # and in backward the fp32 gradient (the bf16 one replaces the logits): 2w + 8 per entry.
    # --compile on fuses the head's loss (engine/transforms/compile.py): the softmax runs over the logits
    # in one pass, no fp32 copy and no saved log-probs; measured on the H100 (GPT-2 124 M and
    # 1.5 B, nanogpt_compare2_h100_2026-11-23) the peak fell by 9.6-9.7 bytes per logit, so 8
    # fewer are priced: 2w, the working-dtype logits and in backward their gradient in place
    per_logit = 12 if a == 4 else 2 * a + 8
    if compiled and a != 4:
        per_logit = 2 * a
    tokens, vocab = b * m.seq_len, m.padded_vocab_size // tp
    out["logits"] = tokens * vocab * per_logit
    if loss_pieces(tokens, vocab):  # past one piece the loss goes a piece of rows at a time
        # (model/loss.py, the model's decision): one piece's logits and the two gradients it
        # makes in the forward, priced alike eager and compiled
        out["logits"] = piece_bytes(tokens, vocab, m.n_embd, a, work.precision == "fp16")
    return out


# ---- the whole estimate -------------------------------------------------------------------------
def activation_peak(work: Workload, ecfg: EngineConfig) -> dict[str, int]:
    """The activation terms alive at the step's activation peak (activation_bytes)."""
    terms = activation_bytes(
        work,
        ecfg.checkpointing,
        tp_of(ecfg),
        ecfg.sequence_parallel,
        compiled(ecfg),
        max(1, ecfg.context_parallel),
        ecfg.keep_activations,
    )
    # the head's moment and a block's backward never overlap (activation_bytes): the larger.
    # Priced apart at every length, so the estimate never falls where the MLP starts running in
    # pieces (a bisection over sequence lengths or micro-batches needs it monotone)
    head = ("final_norm", "logits")
    block = ("working_gradients", "block_backward")
    act_head = {k: v for k, v in terms.items() if k not in block}
    act = {k: v for k, v in terms.items() if k not in head}
    return act_head if sum(act_head.values()) > sum(act.values()) else act


def host_checkpointed_inputs(work: Workload, blocks: int | None = None) -> int:
    """Pinned host bytes of --checkpointing cpu on a GPU run: `blocks` block inputs (every
    block's by default) of one micro-batch, each buffer rounded up to a power of two by torch's
    pinned-memory cache (engine/transforms/activation.py). The full engine and the adapters'
    planner both price it."""
    sbh = work.model.seq_len * work.micro_batch * work.model.n_embd
    n = work.model.n_layer if blocks is None else blocks
    return n * (1 << (sbh * work.w - 1).bit_length())


def estimate(
    work: Workload,
    ecfg: EngineConfig,
    layout: list[ChunkSpec] | None = None,
    placement: Placement | None = None,
) -> Estimate:
    """Peak bytes per rank on each device for one training step of `work` under `ecfg`
    (`placement`: the one `ecfg` makes, when the caller has it already)."""
    layout = rank_layout(work, ecfg, layout)
    placement = placement or placement_of(work, ecfg, layout)
    act = activation_peak(work, ecfg)
    est = Estimate()
    host_dev = "cpu" if work.device == "cpu" else "cuda"
    est.host["process"] = HOST_BASE[host_dev] + (HOST_DIST if work.world > 1 else 0)
    W, w = shard_ranks(work, ecfg), work.w
    if ecfg.checkpointing == "cpu" and work.device != "cpu":
        est.host["checkpointed_inputs"] = host_checkpointed_inputs(work)
    if not placement.chunked:  # plain PyTorch (ddp): its own fp32 state, no chunks
        state = torch_state(work, layout)
        n = sum(c.numel for c in layout)
        phase_a = dict(state, **act)
        if w == 2:
            phase_a["autocast_weights"] = 2 * n  # bf16 copies of the weights, saved for backward
        if W > 1:
            # DDP rebuilds its gradient buckets at the second iteration; measured on 2×H200, the
            # old and new buckets (4 bytes per parameter each) are both held through that
            # iteration's forward, so its peak carries 4·n more.
            phase_a["ddp_bucket_rebuild"] = 4 * n
        phases = {"activations": phase_a}
    else:
        both = placement.state_bytes()
        state = both["device"]
        est.host.update({f"offloaded_{k}": v for k, v in both["host"].items()})
        est.nvme.update(both.get("nvme", {}))
        big = max((c.N for c in placement.chunks), default=0)
        # a layer's fetched weights: a sparse block's are two chunks (the block's, its
        # experts'), fetched and freed together (engine/chunked/fetch.py); a chunk whose weights
        # stay whole on the device (outside stage 3, not streamed) is in the state already
        per_layer: dict[int, int] = {}
        for c in placement.chunks:
            if c.block and c.weights != "device":
                per_layer[c.spec.layer] = per_layer.get(c.spec.layer, 0) + c.N
        big_block = max(per_layer.values(), default=0)
        phase_a = dict(state, **act)
        if placement.fetches_weights:
            # the block in use and the prefetched one (gathered, or streamed in from the host)
            phase_a["gathered_weights"] = 2 * big_block * w
        if placement.scatters_grads:
            # autograd's per-parameter gradients of one block, plus the flat copies and shards of
            # the reductions in flight
            phase_a["grad_transients"] = big * w + (MAX_INFLIGHT + 1) * (big + big // W) * w
        # one chunk's gradient in fp32 (compact chunks step in pieces: their scratch is state)
        plain = [c.opt_elems for c in placement.chunks if not c.offloaded and not c.compact]
        phase_b = dict(state, update_fp32_grad=max(plain, default=0) * 4)
        phases = {"activations": phase_a, "optimizer update": phase_b}
    name, peak = max(phases.items(), key=lambda kv: sum(kv[1].values()))
    if work.device == "cpu":
        est.host.update(peak)  # a CPU run holds everything in host memory
        est.peak_phase = name
        return est
    est.compute = dict(peak)
    est.compute["outside:cuda_context"] = CUDA_CONTEXT
    if work.world > 1:
        est.compute["outside:nccl_buffers"] = NCCL_BUFFERS
    est.peak_phase = name
    return est
