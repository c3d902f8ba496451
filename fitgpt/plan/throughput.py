"""The throughput model: predicted seconds per optimizer step of a plan, term by term.

compute   the matmuls (6 FLOPs per multiplying parameter per token, + 0.6 of a forward's under
          checkpointing) at the GPU's achievable GEMM rate (probe GEMM rate × model efficiency),
          and attention's causal work (quadratic in the sequence: attention_flops) at the probe's
          attention rate × the same efficiency share; fp32 runs on the non-tensor-core rate.
          Model FLOPs (family.flops_per_token, the TFLOP/s and MFU we report) count attention
          over the full S×S square, 12·L·N·D·S per token, as the peers' published figures do: a
          reporting convention, not the work a causal kernel does (half of it). A LoRA run's
          compute is this term at its own FLOPs (compute_seconds with `adapters`: 4 per frozen
          parameter, 6 per adapter element, Family.flops_per_token); the rest of its step (the
          streamed base, unpacking, the adapters' optimizer) is plan/adapter_time.py's.
comm      ZeRO/DDP collectives at the probe's bus bandwidth; what overlaps with backward (or with
          forward, for stage-3 prefetches) is hidden, the rest exposed.
optimizer fused AdamW streams ~36 bytes per parameter of its range through device memory;
          compact formats (engine/formats/compact.py) step in pieces through fp32 scratch and stream more.
ep_comm   --expert-parallel P: per sparse layer 2 all-to-alls of b·S·k·H working elements in
          forward (dispatch, combine) and 2 in backward, (P-1)/P of them leaving the rank, on the
          critical path at the bus bandwidth; the experts' gradients are reduced over W/P ranks.
tp_comm   --tensor-parallel T: per block 2 all-reduces of b·S·h working elements in forward and
          2 in backward (2 more when checkpointing recomputes the forward), plus the embedding's
          and the head's, on the critical path (nothing overlaps them), at the bus bandwidth
          of the GPUs of one box; compute is 1/T per rank at the efficiency of h/T-wide GEMMs.
host      the offloaded blocks' update on the CPU (DRAM-bound: it scales with the bytes its
          formats move), their PCIe copies, and the disk tier's reads and writes, minus the
          next forward it overlaps with (the speculative update is not credited: docs/offload.md).
"""

from __future__ import annotations

import itertools
import math

from fitgpt.engine.chunked.placement import ChunkPlan, Placement
from fitgpt.engine.config import EngineConfig
from fitgpt.engine.formats.moments import bytes_per_param
from fitgpt.engine.transforms.compile import CHECKPOINTED, compiled
from fitgpt.model.families import family_of
from fitgpt.plan.links import Links
from fitgpt.plan.memory import (
    Workload,
    attention_path,
    ep_of,
    layout_of,
    placement_of,
    tp_of,
)
from fitgpt.plan.rates import Rates
from fitgpt.plan.validate import CPU_FP16_SLOWDOWN

FP32_FRACTION = (
    0.085  # fp32 (no tensor cores) runs at ~8.5% of the bf16 rate (H100 sweep, 2.0-3.6 B)
)
# A CPU's compute rate by precision, as a share of its probe rate: CPUs have no tensor cores, so
# fp32 is not slower there. `fitgpt train --preset tiny --device cpu --steps 20 --cpu-threads 1`
# on the 2-core AMD EPYC (avx512_bf16), 2026-11-26: fp32 225-604 ms/step, bf16 245-371, fp16
# 5,120-6,088 (no fast fp16 matmul: ~20x slower). Before this a CPU's fp32 took FP32_FRACTION
# of its rate: fp32 was predicted 4.90 s/step, 12x slower than bf16, and fp16 as fast as bf16.
# (train refuses fp16 on a CPU: plan/validate.py; the share keeps any caller's pricing honest)
CPU_PRECISION_SHARE = {"fp32": 1.0, "bf16": 1.0, "fp16": 1 / CPU_FP16_SLOWDOWN}


# Calibrated on 2026-11-22's H100/H200 runs (benchmarks/results): the achieved share of the GEMM
# rate grows with the hidden size (bigger matmuls; norms, GELU and attention matter less):
# 0.59 at h=1600, 0.66 at h=2560, 0.80 at h=4096. Below h=1600 that curve falls to nothing;
# measured there, GPT-2 124 M (h=768) eager on the H100 reaches 0.37 of the GEMM rate (147.5
# ms/step, benchmarks/results/nanogpt_compare2_h100_2026-11-23), so the share is interpolated
# linearly from that point to the curve at h=1600 (scaled by the GPU's ceiling, the H100's 0.88).
SMALL_HIDDEN, SMALL_EFFICIENCY, H100_CEILING = 768, 0.37, 0.88


def efficiency(hidden: int, ceiling: float) -> float:
    if hidden >= 1600:
        return max(0.2, ceiling - 0.6 * (1000.0 / hidden) ** 1.5)
    at_1600 = ceiling - 0.6 * 0.625**1.5
    small = SMALL_EFFICIENCY * ceiling / H100_CEILING
    share = small + (at_1600 - small) * (hidden - SMALL_HIDDEN) / (1600 - SMALL_HIDDEN)
    return max(0.2, share)


# --compile on (engine/transforms/compile.py): a compiled step's compute time over the eager one's, by hidden
# size, measured on the H100 in one run each: 0.716 at h=768 (GPT-2 124 M on one GPU, compiled
# whole as CUDA graphs: 104.2 against 146.0 ms, nanogpt_compare3_h100_2026-11-24; its regions
# gave 0.75, 110-111 against 147-148 ms), 0.966 at h=1600 (1.5 B's regions: 724-732 against
# 749-757 ms, nanogpt_compare*_h100_2026-11-23). Compiling fuses the elementwise work, a smaller
# share of wider blocks: taken to 1.0 by h=4096 (assumed, not measured: the sweeps there run
# eager). Interpolated linearly in log(hidden) between the points, constant beyond them.
COMPILED = ((768, 0.716), (1600, 0.966), (4096, 1.0))


# Under activation checkpointing the checkpoint wraps the compiled forward and runs it again in
# the backward: the ratio is the model family's own (Family.compiled_checkpointed: GPT-2's
# blocks 1.08, Llama's 0.933, each measured on an H100), priced at every width.


def compiled_factor(
    hidden: int, checkpointing: str = "off", checkpointed: float = CHECKPOINTED
) -> float:
    """A compiled step's compute time over the eager one's: by width without checkpointing,
    the family's `checkpointed` ratio with it."""
    if checkpointing != "off":
        return checkpointed
    pts = COMPILED
    if hidden <= pts[0][0]:
        return pts[0][1]
    for (h0, f0), (h1, f1) in itertools.pairwise(pts):
        if hidden <= h1:
            t = (math.log(hidden) - math.log(h0)) / (math.log(h1) - math.log(h0))
            return f0 + t * (f1 - f0)
    return pts[-1][1]


# What recomputing a block's forward costs, as a share of the forward's FLOPs at the model's
# achieved rate: the forward runs faster than the backward (flash attention's backward, the
# norms' second pass), so recompute adds ~20% to a step, not the third its FLOPs suggest.
# Measured: 2.7b on the H100 at 53.0% -> 44.1% MFU (zero) and 47.0% -> 38.7% (ddp), and 4.44 B at
# hidden 4096 (sweep_h100_2026-11-22: 594 TFLOP/s at 3.64 B without, 501 at 4.44 B with).
RECOMPUTE = 0.6
# A LoRA step's backward computes the frozen base's input gradients only, no weight gradients:
# the same GEMMs as the forward, at the forward's rate, so its recompute costs a whole forward at
# the step's rate. 70 B QLoRA on an H200 at 4,096 tokens ran 12% over a plan priced at 0.6, and
# 405 B int8 over 4 H200s 30% (results/lora70_h200_2026-11-28, lora405_x4_h200_2026-11-28);
# the 8 B runs without recompute matched (lora8_h200_2026-11-28).
RECOMPUTE_ADAPTERS = 1.0


def recomputed(model, ecfg: EngineConfig) -> float:
    """The share of the blocks whose forward runs again in the backward: none without
    checkpointing, all but the last --keep-activations K with it ((n-K)/n)."""
    if ecfg.checkpointing == "off":
        return 0.0
    return (model.n_layer - ecfg.keep_activations) / max(1, model.n_layer)


def recompute_share(adapters: int | None) -> float:
    """A recompute's cost in forwards at the step's rate: RECOMPUTE, or RECOMPUTE_ADAPTERS for
    a LoRA step (`adapters`: its adapter elements; None: a full fine-tune)."""
    return RECOMPUTE if adapters is None else RECOMPUTE_ADAPTERS


# FlexAttention's tile: create_block_mask's default BLOCK_SIZE, which model/packing.py
# window_block_mask and gpt-oss's SinkMasks keep. The kernel scores every 128×128 block of a
# query block's window whole, its masked entries included.
FLEX_BLOCK = 128


def flex_keys(S: int, W: int | None) -> float:
    """Keys per query a FlexAttention kernel scores over S tokens, causal, within a window of
    W (None: every key before): query block i of n = ⌈S/B⌉ scores min(i + 1, s) key blocks of
    B, s = ⌈(W - 1)/B⌉ + 1 the blocks a window spans with the diagonal's (B: FLEX_BLOCK).
    Causal: S/2 + B/2; gpt-oss's window of 128 at 4,096 tokens: 252, where the window's own
    W - W²/2S is 126 (the blocks straddling its edge are scored whole)."""
    B = FLEX_BLOCK
    n = -(-S // B)
    s = n if W is None else min(n, -(-(W - 1) // B) + 1)
    return B * (s * (s + 1) // 2 + (n - s) * s) / n


def keys_per_query(model, device: str = "cuda") -> float:
    """The keys one query is scored against, on average over the layers, by the kernel that
    runs: S/2 for a causal flash kernel (it skips the blocks above the diagonal); through
    FlexAttention, the blocks it scores (flex_keys: a window's edges and the diagonal's block
    whole); S where attention runs on a dense T×T mask or bias (memory.attention_path: the
    masked kernels skip no block). The windows are the family's per layer (gpt-oss alternates
    sliding and full layers)."""
    S = model.seq_len
    path = attention_path(model, device)
    if path == "mask":
        return float(S)

    def one(W: int | None) -> float:
        if path == "flex":
            return flex_keys(S, W if W is not None and W < S else None)
        return S / 2.0

    windows = family_of(model).layer_windows(model)
    return sum(one(W) for W in windows) / len(windows)


def attention_flops(model, device: str = "cuda") -> float:
    """Attention's FLOPs per token, forward + backward, as its kernel does them: QK^T and AV
    are 4·N·D per query-key pair forward, 3x that with the backward: 12·L·N·D·keys_per_query.
    Causal at S ≤ the window: 6·L·N·D·S, half the reporting convention's square."""
    return 12.0 * model.n_layer * model.n_head * model.head_dim * keys_per_query(model, device)


def matmul_flops(model, adapters: int | None = None) -> float:
    """The model FLOPs per token less attention's full square (Family.attention_flops), at the
    GEMM rate: 6 per parameter that multiplies (Family.matmul_params); with `adapters` LoRA
    elements on the frozen model, 4 per such parameter and 6 per adapter element
    (Family.flops_per_token decides both)."""
    f = family_of(model)
    return f.flops_per_token(model, adapters) - f.attention_flops(model)


def compute_seconds(
    work: Workload, ecfg: EngineConfig, tokens: int, rates: Rates, adapters: int | None = None
) -> float:
    """One rank's compute for `tokens` tokens: the matmuls at the achieved GEMM rate, attention
    at the achieved attention rate, each 1/T under tensor parallelism; with `adapters` LoRA
    elements, a LoRA step's matmuls on the frozen model (matmul_flops).

    The efficiency curve was calibrated on whole steps at 1-4k tokens with attention priced at
    the GEMM rate; the attention kernel is taken to reach the same share of its own probe rate
    (efficiency / ceiling: the launches, layout copies and rotary around it scale alike), so
    the calibrated predictions move by about 2% at those lengths (compute: GPT-2 124 M +2.1%,
    1.5 B +1.5%, Llama 3 8B at 4k +2.0%, at 8k +3.5%; at 128k +13%, where attention is 80% of
    the work). Under checkpointing the recompute adds recompute_share(adapters) of a
    forward to both: 2 FLOPs per parameter (as before) and attention's causal forward,
    4·L·N·D·keys_per_query (it was 4·L·h·S: the full square and n_embd, not N·D, wrong where
    they differ, Qwen3-32B's 64 heads of 128 at hidden 5120)."""
    m, tp = work.model, tp_of(ecfg)
    hidden = tp_efficiency_hidden(m.n_embd, tp) if tp > 1 else m.n_embd
    share = efficiency(hidden, rates.model_efficiency)
    if work.device == "cpu":
        share *= CPU_PRECISION_SHARE[work.precision]
    elif work.precision == "fp32":
        share *= FP32_FRACTION
    mm, attn = matmul_flops(m, adapters), attention_flops(m, work.device)
    whole = matmul_flops(m)  # the whole model's matmuls: what matmul_time was measured beside
    if ecfg.checkpointing != "off":
        active = family_of(m).active_params(m)  # a MoE recomputes k experts
        # the recomputed blocks' share: the head and embedding are a few % of the matmuls and
        # are never recomputed anyway, priced here as blocks (as before: K = 0 is unchanged)
        again = recompute_share(adapters) * recomputed(m, ecfg)
        mm += again * 2.0 * (active + (adapters or 0))  # a LoRA step its adapters too
        whole += again * 2.0 * active
        attn += again * attn / 3  # the forward is a third of forward + backward
    gemm = rates.gemm_tflops * 1e12 * share
    attn_rate = rates.attn_tflops * 1e12 * share / rates.model_efficiency
    # the family's elementwise work grows with the matmuls (tokens × widths), not with
    # attention's S², so its factor scales the matmul term only (Family.matmul_time); measured
    # on GPUs: a CPU's share is calibrated by itself (CPU_PRECISION_SHARE). It is the norms',
    # rotary's and the activation's passes forward and backward, which a LoRA step does all
    # of (the inputs' gradients need them) over fewer matmul FLOPs: their time is the whole
    # model's excess, not a share of the LoRA matmuls (the same as mm's without adapters)
    factor = family_of(m).matmul_time if work.device == "cuda" else 1.0
    mm_s = (mm + (factor - 1.0) * whole) / gemm
    # the family's attention kernel over the probed one (flash, head dim 128), where measured
    # (Family.attention_time: gpt-oss's sinks through FlexAttention at head dim 64)
    attn_s = attn / attn_rate * (family_of(m).attention_time if work.device == "cuda" else 1.0)
    return tokens * (mm_s + attn_s) / tp  # each rank computes 1/T of every layer


# Measured extra time over the compute term, as a fraction of it: autocast's per-op casts and
# fp32 bookkeeping in the plain PyTorch engine (ddp ran 10-13% behind zero), the per-micro-batch
# gradient flattening and accumulation where gradients are reduce-scattered (stage 2), and, where
# weights are gathered per use (stage 3), those gathers and their allocations (the scatters'
# share included). Chunks that do neither (stages 0-1) add nothing.
OVERHEAD = {"autocast": 0.11, "scatter": 0.03, "gather": 0.06}


def overhead_share(placement: Placement) -> float:
    """The engine's measured extra time, as a share of the compute term (OVERHEAD)."""
    if not placement.chunked:
        return OVERHEAD["autocast"]
    if placement.gathers_weights:
        return OVERHEAD["gather"]
    return OVERHEAD["scatter"] if placement.scatters_grads else 0.0


# Bytes one element's update moves through memory, by storage format. The host optimizer is
# DRAM-bound: Rates.cpu_adam_params_per_s is measured on its fp32 pipeline, which streams about
# FP32_HOST_BYTES per element (benchmarks/results/offload_preview_h100_2026-11-22: the bf16
# gradient in, its fp32 upcast out and in again, master and both moments in and out, the master
# read again for the bf16 cast back); a compact chunk is charged its own bytes at the same
# bandwidth. Its pieces stay in the CPU's caches (compact.py: 16 MiB of scratch), so DRAM sees
# the gradient (w), the master (split: bf16 half and remainder in and out, 8; fp32: in and out
# plus the new working weights, 8 + w) and the stored moments in and out.
# The byte count is the fallback for a format not in HOST_VS_FP32 (benchmarks/
# host_adamw_formats.py's vs_fp32 column, {(master, moments): time per element over the fp32
# pipeline's}), which replaces it.
FP32_HOST_BYTES = 40.0
# Measured: benchmarks/results/compact_native_h100_2026-11-23/host_adamw_native.json (H100
# machine's host, 16 threads, one 201 M-element block): seconds per element over fp32 state's.
# bf16 and int8 moments run through the native kernel (engine/formats/hostkernel.py), split + fp32
# through torch's kernel. fp32 + int8 was measured once vectorized in a later call
# (sweep_h100_2026-11-23/host_adamw.json): 0.88x split + int8's time in that call, so 0.88 x 0.50
# here (that call's fp32 baseline ran slower, 0.111 s against 0.082 s: its raw ratios read low).
HOST_VS_FP32: dict[tuple[str, str], float] = {
    ("split", "fp32"): 1.43,
    ("fp32", "bf16"): 0.43,
    ("split", "bf16"): 0.43,
    ("fp32", "int8"): 0.44,
    ("split", "int8"): 0.50,
}
FP32_DEVICE_BYTES = 36.0  # the GPU's fused AdamW over fp32 state (the optimizer term)
# a compiled run's device update in one pass (engine/chunked/update.py _adamw_math): the working-dtype
# gradient read, the fp32 master and moments read and written, the weights written: 28 bytes
# at bf16 (measured at the 2.7b preset: 47.4 -> 27.7 ms, results/ab_speed2_h100_2026-11-24)
ONE_PASS_BYTES = 28.0
# On the GPU the compact pieces (16 Mi elements, 256 MiB of scratch) do not fit its caches, so
# each pass over them goes to HBM: the gradient copied into scratch and scaled (w + 12), the fused
# AdamW over the fp32 pieces (28), the master joined and split again (split: ~70 over compact.py's
# integer passes; fp32: the new weights written, 4 + w), and per moment its decode and encode
# passes (bf16 12, int8 ~52 with the absmax, rounding and square root). PLACEHOLDER: counted from
# engine/formats/compact.py and engine/formats/moments.py, not measured; a GPU check should time it.
DEVICE_SPLIT_BYTES = 70.0
DEVICE_MOMENT_PASSES = {"fp32": 0.0, "bf16": 12.0, "int8": 52.0}  # per moment, decode + encode


# One all-reduce's fixed cost under tensor parallelism (NCCL's launch and synchronisation,
# intra-node). PLACEHOLDER: not measured; benchmarks/multi_gpu/tp_x2.py's results should set it, with
# TP_EFFICIENCY_WIDTH below.
TP_LATENCY_S = 20e-6
# Under TP each rank's GEMMs are 1/T as wide in one dimension; their achieved rate is priced as
# that of a model of hidden h/TP_EFFICIENCY_WIDTH(T). PLACEHOLDER: h/T (pessimistic), until the
# 2×H200 measurement.


def tp_efficiency_hidden(hidden: int, tp: int) -> int:
    return hidden // tp


def tp_comm_time(work: Workload, ecfg: EngineConfig, grad_accum: int, bus_gbps: float) -> float:
    """Seconds per step of the TP all-reduces: 4 per block per micro-batch (6 if it recomputes)
    and 2 for the vocabulary-parallel embedding and head, each of b·S·h·w bytes, a ring
    all-reduce moving 2·(T-1)/T of them per rank. Sequence parallelism splits each into a
    reduce-scatter and an all-gather (the same bytes, two launches) and gathers the inputs of
    the 2 column-parallel matmuls per block and the head's again in backward (half an
    all-reduce's bytes each)."""
    m, tp = work.model, tp_of(ecfg)
    count = grad_accum * (m.n_layer * (4 + 2 * recomputed(m, ecfg)) + 2)
    size = work.micro_batch * m.seq_len * m.n_embd * work.w
    bytes_moved = count * 2 * (tp - 1) / tp * size
    launches = count
    if ecfg.sequence_parallel:
        regathers = grad_accum * (2 * m.n_layer + 1)
        bytes_moved += regathers * (tp - 1) / tp * size
        launches = 2 * count + regathers
    return bytes_moved / (bus_gbps * 1e9) + launches * TP_LATENCY_S


def cp_comm_time(work: Workload, ecfg: EngineConfig, grad_accum: int, bus_gbps: float) -> float:
    """Seconds per step of context parallelism's all-to-alls (parallel/context.py), on the
    critical path (attention waits for them): per block and micro-batch, q, k, v in and the
    attention output back, (2N + 2K)·D·b·S·w·(C-1)/C² bytes per rank (N, K: this rank's heads
    under TP); the backward moves the same again and checkpointing's recompute one forward more.
    """
    m, tp, cp = work.model, tp_of(ecfg), max(1, ecfg.context_parallel)
    heads = (2 * m.n_head + 2 * m.kv_heads) // tp
    per_pass = heads * m.head_dim * work.micro_batch * m.seq_len * work.w * (cp - 1) / cp**2
    passes = 2 + recomputed(m, ecfg)
    return grad_accum * m.n_layer * passes * per_pass / (bus_gbps * 1e9)


# One all-to-all's fixed cost under expert parallelism, with the host sync on the row counts
# before it (fitgpt/parallel/experts.py). PLACEHOLDER: not measured; priced as a TP all-reduce's
# launch plus one host round trip.
EP_LATENCY_S = 50e-6


def ep_comm_time(work: Workload, ecfg: EngineConfig, grad_accum: int, bus_gbps: float) -> float:
    """Seconds per step of expert parallelism's all-to-alls (parallel/experts.py), on the
    critical path (the experts wait for their rows): per sparse layer and micro-batch, the rows
    out (dispatch) and back (combine), b·S·k·H·w·(P-1)/P bytes each per rank on average; the
    backward moves the same again and checkpointing's recompute one forward more."""
    m, ep = work.model, ep_of(ecfg)
    per_a2a = work.micro_batch * m.seq_len * m.experts_per_token * m.n_embd * work.w
    per_a2a *= (ep - 1) / ep
    kept = range(m.n_layer - ecfg.keep_activations, m.n_layer)  # not recomputed
    again = sum(ecfg.checkpointing != "off" and i not in kept for i in m.moe_layers)
    count = grad_accum * (4 * len(m.moe_layers) + 2 * again)
    return count * (per_a2a / (bus_gbps * 1e9) + EP_LATENCY_S)


def cached_compact_bytes(c: ChunkPlan, w: int) -> float:
    """DRAM bytes per element of a compact chunk's update whose pieces stay in the caches."""
    master = 8.0 if c.master == "split" else 8.0 + w
    return w + master + 2 * bytes_per_param(c.moments)


def host_update_cost(c: ChunkPlan, w: int) -> float:
    """Seconds per element of a host-homed chunk's update, in units of the fp32 pipeline's
    (1.0 for fp32 state; measured where HOST_VS_FP32 has the formats, else their bytes)."""
    if not c.compact:
        return 1.0
    measured = HOST_VS_FP32.get((c.master, c.moments))
    return measured if measured is not None else cached_compact_bytes(c, w) / FP32_HOST_BYTES


def device_update_bytes(c: ChunkPlan, w: int, cuda: bool) -> float:
    """Memory bytes per element of a device-homed chunk's update (on a CPU device the pieces
    stay in the caches, as on the host tier)."""
    if not c.compact:
        return FP32_DEVICE_BYTES
    if not cuda:
        return cached_compact_bytes(c, w)
    master = DEVICE_SPLIT_BYTES if c.master == "split" else 4.0 + w
    return w + 12.0 + 28.0 + master + 2 * DEVICE_MOMENT_PASSES[c.moments]


def step_time(
    work: Workload,
    ecfg: EngineConfig,
    grad_accum: int,
    rates: Rates,
    placement: Placement | None = None,
) -> dict[str, float]:
    """Seconds per optimizer step, term by term; `placement` (the engine's, from the planner;
    else the one `ecfg` makes) says what each chunk's state does: which collectives reduce and
    gather it, what the host tier and weight streaming move."""
    m, tp = work.model, tp_of(ecfg)
    placement = placement or placement_of(work, ecfg)
    W = work.dp_ranks(tp)
    # per rank: a data-parallel rank's share, which each of its group's T ranks sees
    cp = max(1, ecfg.context_parallel)
    # a context-parallel rank computes 1/C of each sequence's tokens (attention per token still
    # spans the whole sequence: flops_per_token's S is the model's)
    tokens = work.tokens_per_step(grad_accum, tp) // W // cp
    ep = ep_of(ecfg)
    # this rank's parameters (1/T of the split ones; under expert parallelism E/P experts of
    # each sparse layer, reduced over the W/P ranks that hold the same ones)
    local = layout_of(m, tp, ep)
    n = sum(c.numel for c in local)
    n_exp = sum(c.numel for c in local if c.experts) if ep > 1 else 0
    hidden = tp_efficiency_hidden(m.n_embd, tp) if tp > 1 else m.n_embd
    compute = compute_seconds(work, ecfg, tokens, rates)
    if compiled(ecfg):  # either scope: the factors were measured with the regions
        compute *= compiled_factor(hidden, ecfg.checkpointing, family_of(m).compiled_checkpointed)
    if ecfg.checkpointing == "cpu":
        # block inputs down in forward and back in backward, on a side stream: exposed only
        # where the link is slower than the compute it hides behind (forward ~1/4 of a step)
        moved = tokens * m.n_layer * m.n_embd * work.w
        exposed = max(0.0, moved / (rates.d2h_gbps * 1e9) - compute / 4)
        exposed += max(0.0, moved / (rates.h2d_gbps * 1e9) - 3 * compute / 4)
    backward_last = compute / grad_accum * 0.6  # the window the final reductions can hide in
    out = {"compute": compute}
    if ecfg.checkpointing == "cpu":
        out["activation_offload"] = exposed
    # the links each group's collectives cross (plan/links.py): TP groups are T consecutive
    # ranks, a DP group one rank of each TP group, G/T of them on each node
    per_node = work.ranks_per_node
    if tp > 1:
        tp_bw = Links.of(tp, per_node, rates).ring_bytes_per_s / 1e9
        out["tp_comm"] = tp_comm_time(work, ecfg, grad_accum, tp_bw)
    if cp > 1:  # C consecutive ranks of a DP group (dist/mesh.py cp_ranks)
        cp_bw = Links.of(cp, max(1, per_node // tp), rates).ring_bytes_per_s / 1e9
        out["cp_comm"] = cp_comm_time(work, ecfg, grad_accum, cp_bw)
    if ep > 1:  # P consecutive ranks (dist/mesh.py build_expert_groups)
        ep_bw = Links.of(ep, per_node, rates).ring_bytes_per_s / 1e9
        out["ep_comm"] = ep_comm_time(work, ecfg, grad_accum, ep_bw)
    if W > 1:
        dp = Links.of(W, max(1, per_node // tp), rates)
        # the experts' chunks are reduced over their W/P replicas (ranks r, r+P, ...): each
        # collective is the dense part's over dp plus the experts' over `rep`
        rep = Links.of(W // ep, max(1, per_node // (tp * ep)), rates)
        if placement.replicated:
            # every rank holds the whole optimizer state: the gradients are all-reduced once per
            # step, in the working dtype (chunks) or in fp32 (the plain engine's parameters)
            g = work.w if placement.chunked else 4
            reduce = dp.all_reduce((n - n_exp) * g) + rep.all_reduce(n_exp * g)
            out["comm"] = max(0.0, reduce - 0.9 * backward_last)
        else:
            # HSDP (--shard-within node): scattered and gathered inside the node, each 1/G
            # shard then all-reduced across the nodes once per step (links.hsdp_reduce)
            hsdp = ecfg.shard_within == "node" and dp.nodes > 1
            ring = dp.inside_node() if hsdp else dp
            rs = ring.reduce_scatter((n - n_exp) * work.w) + rep.reduce_scatter(n_exp * work.w)
            # updated weights, after the optimizer
            ag = ring.all_gather((n - n_exp) * work.w) + rep.all_gather(n_exp * work.w)
            across = dp.across_nodes().all_reduce(n * work.w / ring.ranks) if hsdp else 0.0
            # reduce-scattered every micro-batch, behind its backward, or once after the last
            scatters = placement.scatters_grads
            hidden = 0.9 * (compute * 0.6 if scatters else backward_last)
            per_step_rs = rs * grad_accum if scatters else rs
            # weights gathered before each forward and backward use, or, held whole, their
            # updated shards all-gathered once after the optimizer
            gathered = placement.gathers_weights
            gathers = 2 * ag * grad_accum if gathered else 0.0
            exposed = max(0.0, per_step_rs + across + gathers - hidden)
            out["comm"] = exposed + (0.0 if gathered else ag) * 0.5
    opt_elems = n if placement.replicated else (n - n_exp) / placement.world + n_exp / (W // ep)
    # a compiled chunk engine in a 16-bit precision steps its plain state in one pass
    one_pass = placement.chunked and compiled(ecfg) and work.precision != "fp32"
    plain = ONE_PASS_BYTES if one_pass else FP32_DEVICE_BYTES
    out["optimizer"] = opt_elems * plain / (rates.hbm_gbps * 1e9)
    # (the plain engine's chunks are never compact: it refuses compact formats)
    extra = sum(
        c.opt_elems * (device_update_bytes(c, work.w, work.device == "cuda") - plain)
        for c in placement.chunks
        if c.compact and not c.offloaded
    )
    if extra:  # negative on a CPU device: fewer bytes than the fp32 update
        out["compact_update"] = extra / (rates.hbm_gbps * 1e9)
    if not placement.chunked and work.precision != "fp32":
        # autocast re-casts the fp32 weights every micro-batch (and again when recomputing)
        casts = grad_accum * (1 + recomputed(m, ecfg))
        out["autocast_casts"] = casts * n * 6 / (rates.hbm_gbps * 1e9)
    if ecfg.offloads:  # (the plain engine offloads nothing: EngineConfig refuses it)
        out["host_optimizer"] = host_optimizer_exposed(work, grad_accum, compute, rates, placement)
        if placement.streams:
            # streamed blocks' weights come in from host RAM before each forward and each
            # backward of every micro-batch, on a side stream behind the block before
            moved = 2 * grad_accum * placement.streamed_elems() * work.w
            out["weight_stream"] = max(0.0, moved / (rates.h2d_gbps * 1e9) - 0.9 * compute)
    out["engine_overhead"] = compute * overhead_share(placement)
    out["total"] = sum(out.values())
    return out


# W ranks of one host run their host optimizers at once and share its DRAM: each runs at
# 1/(1 + HOST_SHARED·(W-1)) of the rate one process measures alone. Measured on 4× H200 (64
# cores, 16 threads a rank), split master + bf16 moments, the per-rank busy rate against the
# priced one: 0.78 (20.56 B and the 70.55 B Llama, results/x4_h200_2026-11-27), 0.68-0.74
# (20.56 B and 97 B, results/x4_peers_h200_2026-11-26): 0.75 at W = 4, so 1/9. W = 2 and 8 are
# the form's, not measured. One process with every core runs faster than the 16-thread rate
# priced (2.1x on that box): not credited.
# fp32 state goes through torch's fused CPU AdamW and shares far worse: 4 ranks of that box, 16
# threads each, ZeRO-2, 3 of 32 blocks' fp32 state on the host (15.12 B,
# results/x4_capacity_h200_2026-11-27) ran at 0.34 G elements/s a rank, 0.30 of the probed rate
# (1.53 G/s at 16 threads, ~60 GB/s of DRAM traffic): the four together moved no more bytes
# than one process alone, where the native kernel's compact formats moved ~200 GB/s. So
# 1/(1 + 7/9·(W-1)), 0.30 at W = 4; W = 2 and 8 are the form's, not measured.
HOST_SHARED = 1 / 9
HOST_SHARED_FP32 = 7 / 9


def host_share(ranks: int, compact: bool = True) -> float:
    """The share of the probed host optimizer rate each of `ranks` ranks on one host gets:
    for state in compact formats (the native kernel) or in fp32 (torch's kernel)."""
    shared = HOST_SHARED if compact else HOST_SHARED_FP32
    return 1.0 / (1.0 + shared * (max(1, ranks) - 1))


def host_optimizer_exposed(
    work: Workload,
    grad_accum: int,
    compute: float,
    rates: Rates,
    placement: Placement,
) -> float:
    """Seconds per step the host optimizer adds: its work for the offloaded blocks (AdamW, the
    conversions, PCIe both ways, pipelined chunk by chunk) minus what overlaps with the GPU: the next
    forward of the device-homed blocks before the first offloaded one."""
    m, w = work.model, work.w
    k = placement.offloaded_blocks
    n_off = placement.offloaded_elems()  # this rank's optimizer elements on the host tiers
    # the whole pipeline (upcast, AdamW, cast back), at the bytes each chunk's formats move
    # every rank's at once, on one host
    host = sum(
        c.opt_elems * host_update_cost(c, w) / host_share(work.ranks_per_node, bool(c.compact))
        for c in placement.hosted
    )
    host /= rates.cpu_adam_params_per_s
    # gradients down and new weights up; a split master whose working weights stay on the GPU
    # needs them down too (its high half: compact.py), w bytes more per element
    down = n_off + sum(
        c.opt_elems for c in placement.hosted if c.master == "split" and not c.streamed
    )
    pcie = down * w / (rates.d2h_gbps * 1e9) + n_off * w / (rates.h2d_gbps * 1e9)
    # the disk tier: the disk-homed chunks' state, in their formats, read in and written back,
    # by every rank of the host at once through the one disk under --nvme-path: each rank gets
    # 1/W of the bandwidth that one process probed (plan/rates.py). The form's, not measured on
    # several ranks: gpt-oss-120b on 4 H200s moves 38.6 GB each way per rank and step, 44 s a
    # step priced per rank where the disk carries four ranks' (docs/planner.md)
    read, written = placement.disk_traffic()
    disk = read / (rates.nvme_read_gbps * 1e9) + written / (rates.nvme_write_gbps * 1e9)
    disk *= max(1, work.ranks_per_node)
    work_s = max(host, pcie, disk)
    forward_first_micro = compute / grad_accum / 3  # forward is about a third of a micro-batch
    window = forward_first_micro * (m.n_layer - k) / max(1, m.n_layer)
    if work.world > 1 and any(c.gathers_updated for c in placement.hosted):
        # stages 1-2 on several ranks: the step waits for the host's new shards to all-gather
        # them (engine/chunked/update.py), so nothing of it overlaps the next forward. Measured on 4×
        # H200 (2026-11-27, 15.12 B, ZeRO-2, 3 of 32 blocks on the host): the update 1.30 s,
        # priced 0 with the window, the plan 16% fast (x4_capacity_h200_2026-11-27)
        window = 0.0
    # the speculative update (engine/formats/speculate.py) is not credited: measured runs clip nearly
    # every early step (docs/offload.md), and a clipped step gets no overlap from it
    return max(0.0, work_s - window)
