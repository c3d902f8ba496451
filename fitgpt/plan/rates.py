"""The throughput model's constants: measured by `fitgpt probe` (under a minute) and cached.

Defaults for known GPUs come from ../shared/ANCHORS.md's measurements of our machines; a probe
replaces them with this machine's own figures, cached in ~/.cache/fitgpt/probe-<gpu>.json.
"""

from __future__ import annotations

import json
import os
import socket
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch

from fitgpt import units
from fitgpt.dist.nodes import node_shape
from fitgpt.plan.links import INTER_NODE_GBIT


@dataclass(frozen=True)
class Rates:
    gemm_tflops: float  # dense bf16 matmul of a GPT-sized shape
    model_efficiency: float  # ceiling of achieved/GEMM rate at large hidden sizes (throughput.py)
    hbm_gbps: float  # device memory bandwidth (read + write counted)
    h2d_gbps: float  # pinned host → device
    d2h_gbps: float
    # the host optimizer's whole pipeline per parameter (bf16 gradient upcast, fused AdamW, cast
    # back), all cores, over buffers far larger than the caches: the rate it runs at in training
    cpu_adam_params_per_s: float
    nvme_read_gbps: float
    nvme_write_gbps: float
    bus_gbps: float  # collective bus bandwidth between GPUs (all-gather / reduce-scatter)
    # causal attention, forward + backward (SDPA's flash kernel, head dim 128), in the reporting
    # convention's FLOPs: 4·N·D per query-key pair forward, 3x that with the backward, over the
    # pairs the causal kernel computes (half the square): plan/throughput.py attention_flops
    attn_tflops: float = 300.0
    # between nodes, Gb/s per GPU (bits, as network links are sold): plan/links.py prices the
    # collectives that leave a node at it; `--inter-node-gbps` sets it, `fitgpt probe` started
    # on several nodes measures it, else it is the assumption, links.INTER_NODE_GBIT
    inter_node_gbit: float = INTER_NODE_GBIT
    # where that figure comes from: assumed, a probe across nodes, or the user's flag
    inter_node_source: str = "assumed"
    source: str = "defaults"

    def to_dict(self) -> dict:
        return asdict(self)


DEFAULTS = {
    # ANCHORS.md (nvidia-h100-x1 / h200-x2, 2026-11-22) and KINDS.md readings; the host optimizer's
    # 1.53 G params/s is its measured busy rate at 8 B (offload_preview_h100_2026-11-22, 4.83 B
    # parameters in 3.15 s), DRAM-bound, not the 4.8 G/s of cache-sized AdamW in ANCHORS
    # attention: `fitgpt probe` on an H100 with torch 2.11 (SDPA took cuDNN's flash kernel)
    # measured 466 TFLOP/s forward + backward at head dim 128 (results/llama_speed_h100_2026-11-27
    # probe.txt; before it, 300 was assumed from FlashAttention-2's published 287-370); with it
    # the 8 B shape's step at 131,072 tokens is priced within 10% of the measured 55.5 s
    # (results/long_h100_2026-11-27), against 70.2 s at 300. The H200 is the same chip
    # (compute-bound: its faster memory does not help). The CPU's is assumed, half its GEMM rate.
    "H100": Rates(790.0, 0.88, 3000.0, 55.0, 55.0, 1.53e9, 1.8, 1.7, 265.0, attn_tflops=466.0),
    "H200": Rates(790.0, 0.88, 4300.0, 55.0, 55.0, 1.53e9, 1.8, 1.7, 265.0, attn_tflops=466.0),
    "cpu": Rates(0.2, 0.5, 20.0, 20.0, 20.0, 2.0e8, 1.0, 1.0, 5.0, attn_tflops=0.1),
}


def cache_path(gpu_name: str) -> Path:
    root = Path(os.environ.get("FITGPT_CACHE", Path.home() / ".cache" / "fitgpt"))
    slug = "".join(ch if ch.isalnum() else "-" for ch in f"{socket.gethostname()}-{gpu_name}")
    return root / f"probe-{slug}.json"


def defaults_for(gpu_name: str) -> Rates:
    """The defaults for this GPU's family (an unknown GPU: the H100's)."""
    for key, r in DEFAULTS.items():
        if key != "cpu" and key in gpu_name:
            return r
    return DEFAULTS["cpu"] if gpu_name == "cpu" else DEFAULTS["H100"]


def load(gpu_name: str) -> Rates:
    """The cached probe for this machine's GPU, else the defaults for its family. A cache
    written before a rate existed (attn_tflops) keeps its measurements and takes the family's
    default for the rest."""
    p = cache_path(gpu_name)
    base = defaults_for(gpu_name)
    if p.is_file():
        try:
            return Rates(**{**asdict(base), **json.loads(p.read_text())})
        except (TypeError, json.JSONDecodeError):
            pass
    return base


def with_network(r: Rates, gbit: float | None) -> Rates:
    """`r` with the link between nodes as the user stated it (Gb/s per GPU: plan/links.py,
    judged there: `stated_link`); None or 0: as probed, else assumed."""
    return replace(r, inter_node_gbit=gbit, inter_node_source="--inter-node-gbps") if gbit else r


def for_run(gpu_name: str, ecfg) -> Rates:
    """The rates a run is planned at: this machine's (`load`), the link between nodes as its
    EngineConfig states it (`fitgpt train --inter-node-gbps`)."""
    return with_network(load(gpu_name), ecfg.inter_node_gbps)


def _time(fn, repeat: int = 5) -> float:
    fn()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(repeat):
        fn()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return (time.perf_counter() - t0) / repeat


def host_probe_elems() -> int:
    """Parameters for the host-optimizer probe: 256 M (4.5 GiB of buffers, far past any L3, so the
    rate is DRAM-bound as in training), fewer where RAM is short."""
    from fitgpt.plan.hardware import host_available

    room = host_available() // 4 // 18  # 18 bytes per parameter, a quarter of what is free
    return int(max(16 * 2**20, min(256 * 2**20, room)))


def host_optimizer_pass(n: int) -> tuple[Callable[[], None], torch.Tensor, torch.Tensor]:
    """(step, fp32 master, bf16 buffer): one step of the host optimizer's work on n parameters, as the engine does it (engine/
    offload.py): the bf16 gradient upcast and scaled into fp32, fused AdamW, the master cast back to
    bf16."""
    master = torch.zeros(n)
    g16 = torch.randn(n).to(torch.bfloat16)
    g32 = torch.empty(n)
    opt = torch.optim.AdamW([master], lr=1e-4, fused=True)

    def step() -> None:
        torch.mul(g16, 0.5, out=g32)
        master.grad = g32
        opt.step()
        g16.copy_(master)

    return step, master, g16


def probe(nvme_path: str = "", log=print) -> Rates:
    """Measure this machine (each part a few seconds) and cache the result."""
    name = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"
    r = load(name)
    if torch.cuda.is_available():
        dev = torch.device("cuda")
        a = torch.randn(8192, 4096, device=dev, dtype=torch.bfloat16)
        b = torch.randn(4096, 16384, device=dev, dtype=torch.bfloat16)
        t = _time(lambda: a @ b, 20)
        r = replace(r, gemm_tflops=2 * 8192 * 4096 * 16384 / t / 1e12)
        log(f"GEMM bf16 8192×4096×16384: {units.tflops(r.gemm_tflops)}")
        r = replace(r, attn_tflops=_probe_attention(dev))
        log(
            f"causal attention bf16 forward + backward, head dim 128: {units.tflops(r.attn_tflops)}"
        )
        x = torch.empty(2**28, device=dev, dtype=torch.float32)  # 1 GiB
        y = torch.empty_like(x)
        r = replace(r, hbm_gbps=2 * x.numel() * 4 / _time(lambda: y.copy_(x), 10) / 1e9)
        log(f"device copy: {r.hbm_gbps:.0f} GB/s")
        h = torch.empty(x.numel(), dtype=torch.float32).pin_memory()
        r = replace(
            r,
            h2d_gbps=h.numel() * 4 / _time(lambda: x.copy_(h, non_blocking=True)) / 1e9,
            d2h_gbps=h.numel() * 4 / _time(lambda: h.copy_(x, non_blocking=True)) / 1e9,
        )
        log(f"host→device {r.h2d_gbps:.1f} GB/s, device→host {r.d2h_gbps:.1f} GB/s (pinned)")
        del a, b, x, y, h
    n = host_probe_elems()
    r = replace(r, cpu_adam_params_per_s=n / _time(host_optimizer_pass(n)[0], 3))
    log(
        f"host optimizer (upcast, fused AdamW, cast back) over {n / 2**20:.0f} M parameters: "
        f"{r.cpu_adam_params_per_s / 1e9:.2f} G params/s ({torch.get_num_threads()} threads)"
    )
    import torch.distributed as dist

    if dist.is_initialized() and dist.get_world_size() > 1:
        per, nnodes = node_shape(dist.get_world_size())
        inside, across = _node_groups(per, nnodes)
        if per > 1:  # one GPU per node: nothing inside a node to measure
            r = replace(r, bus_gbps=_probe_collectives(inside, per))
            where = f"{per} ranks" + (" of one node" if nnodes > 1 else "")
            log(f"all-gather / reduce-scatter over {where}: {r.bus_gbps:.1f} GB/s bus bandwidth")
        if nnodes > 1:
            r = replace(
                r,
                inter_node_gbit=_probe_between_nodes(across, nnodes),
                inter_node_source=f"probe across {nnodes} nodes {time.strftime('%Y-%m-%d %H:%M')}",
            )
            log(
                f"between nodes: all-reduce across {nnodes} nodes, each of a node's {per} GPUs at "
                f"once: {r.inter_node_gbit:.1f} Gb/s per GPU ({r.inter_node_gbit / 8:.2f} GB/s)"
            )
    if nvme_path:
        r = replace(r, **_probe_disk(nvme_path))
        log(
            f"disk at {nvme_path}: write {r.nvme_write_gbps:.2f} GB/s, read {r.nvme_read_gbps:.2f} GB/s"
        )
    r = replace(r, source=f"probe {time.strftime('%Y-%m-%d %H:%M')}")
    if dist.is_initialized() and int(os.environ.get("LOCAL_RANK", dist.get_rank())) != 0:
        return r  # each machine's first rank writes its cache, on its own disk
    path = cache_path(name)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")  # nodes that share a host and disk
    tmp.write_text(json.dumps(r.to_dict(), indent=1))
    os.replace(tmp, path)
    log(f"cached in {path}")
    return r


def _probe_attention(dev: torch.device, B: int = 1, N: int = 32, S: int = 8192, D: int = 128):
    """SDPA's causal forward + backward at head dim 128 (the flash kernel, CUDA only), in the
    reporting convention's FLOPs: 12·N·D per query-key pair over the S²/2 pairs a causal
    kernel computes (plan/throughput.py attention_flops). 1×32×8192×128 is Llama 3 8B's layer
    at 8k tokens: ~0.3 GiB of q, k, v and their gradients, ~10 ms a pass on an H100."""
    q, k, v = (
        torch.randn(B, N, S, D, device=dev, dtype=torch.bfloat16, requires_grad=True)
        for _ in range(3)
    )
    g = torch.randn(B, N, S, D, device=dev, dtype=torch.bfloat16)

    def step() -> None:
        y = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        torch.autograd.grad(y, (q, k, v), g)

    return 12 * N * D * B * S * S / 2 / _time(step, 10) / 1e12


def _node_groups(per: int, nnodes: int):
    """(the group of this rank's node, the group of the ranks that share its place on the other
    nodes): torchrun's order, node r holding ranks r·per..r·per+per-1 (dist/nodes.py). Every
    rank creates every group, in one order, as torch.distributed requires."""
    import torch.distributed as dist

    if nnodes == 1:
        return dist.group.WORLD, None
    me = dist.get_rank()
    inside = across = None
    for n in range(nnodes):
        g = dist.new_group(list(range(n * per, (n + 1) * per)))
        inside = g if me // per == n else inside
    for k in range(per):
        g = dist.new_group([k + n * per for n in range(nnodes)])
        across = g if me % per == k else across
    return inside, across


def _probe_device() -> torch.device:
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _probe_between_nodes(group, nnodes: int, nbytes: int = 256 << 20) -> float:
    """The link between nodes, Gb/s per GPU, as plan/links.py prices it: an all-reduce of
    `nbytes` across the nodes, every GPU of a node in its own group at once (HSDP's gradient
    reduction; every GPU's traffic crosses the link together, so a NIC shared by several GPUs
    shows as its share), 2·(N-1)/N·bytes per second."""
    import torch.distributed as dist

    x = torch.ones(nbytes // 2, dtype=torch.bfloat16, device=_probe_device())
    t = _time(lambda: dist.all_reduce(x, group=group), 3)
    # the slowest rank's time, as a step waits for it: every rank then caches the same figure
    t_all = torch.tensor([t], dtype=torch.float64, device=x.device)
    dist.all_reduce(t_all, op=dist.ReduceOp.MAX)
    return 8 * 2 * (nnodes - 1) / nnodes * nbytes / float(t_all) / 1e9


def _probe_collectives(group, W: int, nbytes: int = 256 << 20) -> float:
    """Bus bandwidth of all-gather and reduce-scatter (the ZeRO collectives) over `group`'s `W`
    ranks, the slower of the two: bytes·(W-1)/W per second, as nccl-tests reports it."""
    from fitgpt.engine import comm

    dev = _probe_device()
    full = torch.empty(nbytes // 2, dtype=torch.bfloat16, device=dev)
    shard = torch.empty(full.numel() // W, dtype=torch.bfloat16, device=dev)
    ag = _time(lambda: comm.all_gather(full, shard, group, W), 5)
    rs = _time(lambda: comm.reduce_scatter(shard, full, group, W), 5)
    return nbytes * (W - 1) / W / max(ag, rs) / 1e9


def _probe_disk(folder: str, size: int = 1 << 30, block: int = 16 << 20) -> dict:
    """Sequential write then read of `size` bytes in `block` pieces, O_DIRECT where allowed."""
    import mmap

    buf = mmap.mmap(-1, block)  # page-aligned, as O_DIRECT requires
    buf.write(os.urandom(block))
    flags = getattr(os, "O_DIRECT", 0)
    fd, path = tempfile.mkstemp(dir=folder, prefix=".fitgpt-probe-")
    os.close(fd)
    try:
        try:
            fd = os.open(path, os.O_WRONLY | flags)
        except OSError:
            fd, flags = os.open(path, os.O_WRONLY), 0
        t0 = time.perf_counter()
        for _ in range(size // block):
            os.write(fd, buf)
        os.fsync(fd)
        w = size / (time.perf_counter() - t0) / 1e9
        os.close(fd)
        fd = os.open(path, os.O_RDONLY | flags)
        t0 = time.perf_counter()
        for _ in range(size // block):
            os.readv(fd, [buf])
        rd = size / (time.perf_counter() - t0) / 1e9
        os.close(fd)
    finally:
        os.unlink(path)
    return {"nvme_write_gbps": w, "nvme_read_gbps": rd}
