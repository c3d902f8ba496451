"""The step-time model of an adapter run (LoRA, fitgpt/adapters): predicted seconds per optimizer
step of a frozen base placed as plan/adapter_memory.py's BasePlan says, term by term. The dense
model's pieces (plan/throughput.py) are reused where they apply; what is the adapter run's own:

compute       a LoRA step's FLOPs (4 per frozen multiplying parameter, 6 per adapter element,
              attention as a full fine-tune's: Family.flops_per_token) over this rank's tokens
              (micro-batch x grad-accum x seq), at throughput.py compute_seconds' rates; under
              --checkpointing full/cpu, its recompute of the forward (a whole forward at the
              step's rate: throughput.py RECOMPUTE_ADAPTERS), in all blocks but the last
              --keep-activations K ((n-K)/n of it; their backward windows below are shorter).
              Compiled blocks (--compile, as plan/adapter.py resolves it): times the full
              step's factor (throughput.py compiled_factor: the family's measured ratio under
              checkpointing, by width without), not measured on a LoRA step.
base_stream   each streamed block's bytes in its format (this rank's 1/shards), host -> GPU at
              the probed h2d rate once per forward and once per backward of every micro-batch
              (the last block is kept between the two; under checkpointing the recompute runs
              on the backward's copy); disk blocks at the disk's read rate (shared by the
              host's ranks), the slower of the two links; a sharded block's all-gather after its copy. The next
              block's bytes come in on a side stream while a block computes (engine/chunked/
              fetch.py): a block's transfer is exposed only where it outlasts a block's compute
              in that pass.
base_gather   a sharded block resident on the GPU: its all-gather per use, exposed likewise.
unpack        a packed block (int8, nf4) dequantised to the compute dtype per use, on the
              compute stream: its packed bytes read and its weights written, at the HBM rate.
adapter_passes  the adapters' memory-bound work beyond their FLOPs: their rank-r matmuls are
              too thin to be compute-bound, so each adapted linear's passes over its input and
              output rows cost bytes at the HBM rate, per token (elements of the compute dtype;
              adapters/lora.py: a linear's k adapters as one rank-k·r update, its A's product
              reading x once, the base's y and the update summed in one addmm; d_out every
              row of the linear, d_in its input, once a linear; dropout at p = 0 its input):
                forward   A reads x (d_in); the addmm reads y and writes the sum (2 d_out):
                                                                            d_in + 2 d_out
                backward  B's two products read the gradient (2 d_out); A's gradient reads x
                          (d_in); x's gradient through A is written (d_in) and added to the
                          base's (3 d_in):                                 5 d_in + 2 d_out
              and the forward's again under recompute. On the 8B shape that is 0.71 MB a token
              a layer (1.24 before the addmm), 0.087 s of a 16,384-token step at the H200's
              4,300 GB/s (plan/rates.py).
optimizer     AdamW over the adapters' fp32 state (throughput.py FP32_DEVICE_BYTES an element).
comm          several ranks: the adapters' fp32 gradients all-reduced once per step, behind the
              last backward as the dense ddp engine's are.

Not priced: --checkpointing cpu's block inputs to host RAM and back (the same PCIe as the
streamed base; throughput.py prices them for a full fine-tune); the dense ddp engine's autocast
overhead (throughput.py OVERHEAD, its per-op casts of fp32 weights): the base is held in the
compute dtype and the adapters are small; a dropout above 0 (its mask and copy); a LoRA scale
other than a power of two (lora.py: PEFT's rounding order, 4 passes over the rows more forward,
2 backward); bitsandbytes' NF4 kernel's own speed (priced as the unpack's bytes at the HBM
rate); the first step's start-up.
"""

from __future__ import annotations

from fitgpt.adapters import AdapterConfig
from fitgpt.adapters.targets import adapted_linears, adapter_elements
from fitgpt.engine.config import EngineConfig
from fitgpt.engine.formats.frozen_base import ALIGN, is_direct
from fitgpt.model.families import family_of
from fitgpt.plan.adapter_memory import BasePlan, _block_bytes, _working
from fitgpt.plan.links import Links
from fitgpt.plan.memory import Workload
from fitgpt.plan.rates import Rates
from fitgpt.plan.throughput import (
    FP32_DEVICE_BYTES,
    attention_flops,
    compiled_factor,
    compute_seconds,
    recompute_share,
    recomputed,
)

# elements each adapted linear moves per token, over its input (d_in) and output rows (d_out),
# forward and backward (the module's docstring, adapter_passes)
FWD_IN, FWD_OUT = 1, 2
BWD_IN, BWD_OUT = 5, 2


def adapter_passes(work: Workload, adapter: AdapterConfig, tokens: int, recompute: float, rates):
    """Seconds of the adapters' memory-bound passes over `tokens` tokens (adapter_passes in the
    module's docstring)."""
    linears = adapted_linears(work.model, adapter)
    d_in = sum(n for n, _ in linears)
    d_out = sum(rows for _, rows in linears)
    fwd = FWD_IN * d_in + FWD_OUT * d_out
    elements = fwd * (1 + recompute) + BWD_IN * d_in + BWD_OUT * d_out  # recompute: a share
    return tokens * elements * work.w / (rates.hbm_gbps * 1e9)


def forward_share(work: Workload, adapters: int, checkpointing: str, keep: int = 0) -> float:
    """The forward's share of a LoRA step's FLOPs: 2 per frozen parameter and per adapter
    element and attention's third, over the whole (4 and 6 and all of attention, plus the
    recompute's forward, which runs inside the backward, in all blocks but the last `keep`)."""
    return pass_shares(work, adapters, checkpointing, keep)[0]


def pass_shares(work: Workload, adapters: int, checkpointing: str, keep: int = 0):
    """(forward, backward, recompute): one block's passes as shares of an average block's
    compute in a LoRA step (forward_share's FLOPs), the recompute's being what a recomputed
    block adds to its backward (the last `keep` blocks add none; the shares sum to 1 over the
    blocks on average)."""
    m = work.model
    mm = family_of(m).matmul_params(m)
    attn = attention_flops(m, work.device)
    fwd = 2.0 * mm + 2.0 * adapters + attn / 3
    total = 4.0 * mm + 6.0 * adapters + attn
    bwd = total - fwd
    again = recompute_share(adapters) * fwd if checkpointing != "off" else 0.0
    ecfg = EngineConfig(engine="ddp", checkpointing=checkpointing, keep_activations=keep)
    total += again * recomputed(m, ecfg)  # the recomputed blocks' share of a recompute
    return fwd / total, bwd / total, again / total


def adapter_step_time(
    plan: BasePlan, work: Workload, adapter: AdapterConfig, grad_accum: int, rates: Rates
) -> dict[str, float]:
    """Seconds per optimizer step of one rank, term by term (the module's docstring), of the
    placement `plan` (plan/adapter_memory.py BasePlan: format, blocks per tier, shards,
    checkpointing) for `work` at `grad_accum` micro-batches a step."""
    m, w = work.model, work.w
    ecfg = EngineConfig(engine="ddp", checkpointing=plan.checkpointing, keep_activations=plan.keep)
    adapters = adapter_elements(m, adapter)
    tokens = work.tokens_per_step(grad_accum) // work.world
    compute = compute_seconds(work, ecfg, tokens, rates, adapters)
    if plan.compile != "off":  # the blocks compiled: throughput.py's factor, as a full step's
        compute *= compiled_factor(m.n_embd, plan.checkpointing,
                                   family_of(m).compiled_checkpointed)  # fmt: skip
    out = {"compute": compute}
    out["adapter_passes"] = adapter_passes(work, adapter, tokens, recomputed(m, ecfg), rates)
    # one block's compute in one pass of one micro-batch (the forward; the backward with the
    # recompute's forward before it, but for the last plan.keep blocks, which keep their
    # activations): the window its neighbour's bytes come in behind (the blocks are alike)
    per_block = compute / grad_accum / max(1, m.n_layer)
    fwd_share, bwd_share, again = pass_shares(work, adapters, plan.checkpointing, plan.keep)
    windows = (per_block * fwd_share, per_block * (bwd_share + again))
    kept_windows = (windows[0], per_block * bwd_share)
    first_kept = m.n_layer - plan.keep
    whole, numels, _ = _block_bytes(m, plan.fmt, w)
    k = plan.shards
    parts = [-(-n // (k * ALIGN)) * ALIGN for n in whole]  # this rank's bytes of each block
    first_host = len(parts) - plan.host_blocks
    first_disk = len(parts) - plan.disk_blocks
    ring = Links.of(k, min(k, work.ranks_per_node), rates) if k > 1 else None
    h2d = rates.h2d_gbps * 1e9
    disk = rates.nvme_read_gbps * 1e9 / max(1, work.ranks_per_node)  # the host's one disk
    unpacked = not is_direct(plan.fmt, _working(w))
    stream = gather = unpack = 0.0
    for i, part in enumerate(parts):
        # the passes a block is fetched for, per micro-batch (windows' order): the forward,
        # then the backward, once for both the recompute and the backward (its backward
        # pre-hook fetches it before the recompute runs; engine/chunked/frozen.py frees it when
        # the backward reaches the block below), but not the last block's (kept from its
        # forward). l70_bf16 of results/lora70_h200_2026-11-28 ran 26% under a plan that
        # fetched a third time for the recompute.
        passes = [0] + ([1] if i < len(parts) - 1 else [])
        gathered = ring.all_gather(whole[i]) if ring is not None else 0.0
        if i >= first_host:
            link = part / h2d
            if i >= first_disk:  # read into pinned staging, then copied: the slower link
                link = max(link, part / disk)
            win = kept_windows if i >= first_kept else windows
            stream += sum(max(0.0, link + gathered - win[p]) for p in passes)
        elif gathered:
            win = kept_windows if i >= first_kept else windows
            gather += sum(max(0.0, gathered - win[p]) for p in passes)
        if unpacked:  # its packed bytes read, its weights written, on the compute stream
            unpack += len(passes) * (whole[i] + numels[i] * w) / (rates.hbm_gbps * 1e9)
    if stream:
        out["base_stream"] = grad_accum * stream
    if gather:
        out["base_gather"] = grad_accum * gather
    if unpack:
        out["unpack"] = grad_accum * unpack
    out["optimizer"] = adapters * FP32_DEVICE_BYTES / (rates.hbm_gbps * 1e9)
    if work.world > 1:
        dp = Links.of(work.world, work.ranks_per_node, rates)
        backward_last = compute / grad_accum * (1 - fwd_share)
        out["comm"] = max(0.0, dp.all_reduce(adapters * 4) - 0.9 * backward_last)
    out["total"] = sum(out.values())
    return out
