"""The benchmark peers on the CPU: FSDP2 against the DDP baseline on a real 2-process gloo group,
and the DeepSpeed systems refused with the install hint when DeepSpeed is absent (CI)."""

import importlib.util
import json
import os
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist

from fitgpt.bench.config import BenchConfig
from fitgpt.bench.systems import SYSTEMS
from fitgpt.data.source import BatchLoader
from fitgpt.data.synthetic import UniformSource
from fitgpt.dist import DistContext
from fitgpt.engine.config import OptimConfig
from fitgpt.model import GPT

BENCH = BenchConfig(
    hidden=32, heads=4, seq_len=32, vocab_size=256, micro_batch=2, grad_accum=2, seed=3
)
STEPS = 4
HAS_DEEPSPEED = importlib.util.find_spec("deepspeed") is not None


def train(system: str, ctx: DistContext) -> tuple[object, list[float]]:
    """STEPS optimizer steps of `system` on this rank's share of the sweep's random tokens."""
    runner = SYSTEMS[system].build(BENCH.model(2), BENCH, ctx)
    src = UniformSource(BENCH.seq_len, BENCH.vocab_size, BENCH.seed)
    loader = BatchLoader(src, BENCH.micro_batch, ctx.rank, ctx.world)
    losses = [runner.step([loader.next() for _ in range(BENCH.grad_accum)]) for _ in range(STEPS)]
    return runner, losses


def full_params(model) -> dict[str, torch.Tensor]:
    """Every parameter whole (FSDP2's DTensor shards all-gathered)."""
    return {
        n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()
        for n, p in model.named_parameters()
    }


def fsdp2_vs_ddp(rank: int, world: int) -> None:
    ctx = DistContext(rank, world, rank, torch.device("cpu"), dist.group.WORLD)
    ddp, ddp_losses = train("ddp", ctx)
    fsdp, fsdp_losses = train("fsdp2-offload", ctx)
    # Both compute in fp32 on CPUs (fitgpt's `auto` precision) from the same initial weights on
    # the same tokens, with the same AdamW and clipping; they differ only in the order of the
    # gradient sums (DDP all-reduces, FSDP2 reduce-scatters). That moves fp32 results by ~1e-7
    # relative, while 4 steps at lr 1e-4 move the loss by ~1e-3: 1e-5 tells a bug from rounding.
    assert fsdp_losses == pytest.approx(ddp_losses, rel=1e-5, abs=0), (fsdp_losses, ddp_losses)
    # The weights after 4 steps: each moved by up to ~4e-4; the summation order by ~5e-8.
    ref = full_params(ddp.engine.model)
    for name, p in full_params(fsdp.model).items():
        torch.testing.assert_close(p, ref[name], rtol=0, atol=1e-6, msg=name)


def fsdp2_gradients(rank: int, world: int) -> None:
    """The gradient one FSDP2 step hands AdamW: sharded, offloaded, accumulated over 2
    micro-batches, averaged over 2 ranks and clipped, against one unsharded GPT that sees the
    whole global batch. (Adam hardly notices a gradient's scale, so the losses above would not
    catch a wrong 1/n or a missing clip; this does.)"""
    ctx = DistContext(rank, world, rank, torch.device("cpu"), dist.group.WORLD)
    runner = SYSTEMS["fsdp2-offload"].build(BENCH.model(2), BENCH, ctx)
    runner.ocfg = OptimConfig(grad_clip=1e-2)  # small enough to bite
    seen: dict[str, dict] = {}

    def record(key):
        seen[key] = {n: p.grad.full_tensor() for n, p in runner.model.named_parameters()}

    clip = runner.clip_grads
    runner.clip_grads = lambda: (record("reduced"), clip())
    runner.opt.step = lambda: record("clipped")
    src = UniformSource(BENCH.seq_len, BENCH.vocab_size, BENCH.seed)
    loaders = [BatchLoader(src, BENCH.micro_batch, r, world) for r in range(world)]
    micro = [[ld.next() for _ in range(BENCH.grad_accum)] for ld in loaders]
    runner.step(micro[rank])

    ref = GPT(BENCH.model(2))
    ref.reset_parameters(BENCH.seed)  # fitgpt's initial weights, as every system starts from
    n = world * BENCH.grad_accum
    for x, y, _ in (b for per_rank in micro for b in per_rank):
        (ref(x, y) / n).backward()
    # fp32 sums in other orders: ~1e-7 relative to the largest gradient
    reduced = {name: p.grad.clone() for name, p in ref.named_parameters()}
    norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), 1e-2)
    assert norm > 0.1, norm  # the clip bites: it scales every gradient by 1e-2 / norm
    for name, p in ref.named_parameters():
        torch.testing.assert_close(seen["reduced"][name], reduced[name], rtol=1e-4, atol=1e-8)
        torch.testing.assert_close(seen["clipped"][name], p.grad, rtol=1e-4, atol=1e-10)


@pytest.mark.slow
def test_fsdp2_matches_ddp_at_world_2(gloo):
    gloo(2, fsdp2_vs_ddp)


@pytest.mark.slow
def test_fsdp2_gradient_matches_unsharded_at_world_2(gloo):
    gloo(2, fsdp2_gradients)


def deepspeed_vs_ddp(rank: int, world: int) -> None:
    os.environ["DS_ACCELERATOR"] = "cpu"  # DeepSpeed's CPU accelerator, before its import
    ctx = DistContext(rank, world, rank, torch.device("cpu"), dist.group.WORLD)
    _, ddp_losses = train("ddp", ctx)
    for system in ("deepspeed-z2-offload", "deepspeed-z3-offload"):
        _, losses = train(system, ctx)
        assert losses == pytest.approx(ddp_losses, rel=1e-5, abs=0), (system, losses)


@pytest.mark.slow
@pytest.mark.skipif(not HAS_DEEPSPEED, reason="DeepSpeed is an optional extra (fitgpt[bench])")
def test_deepspeed_matches_ddp_at_world_2(gloo):
    """Only where DeepSpeed is installed: its CPU accelerator, fp32, CPUAdam compiled at first
    use (minutes the first time)."""
    gloo(2, deepspeed_vs_ddp)


@pytest.mark.skipif(HAS_DEEPSPEED, reason="DeepSpeed is installed here")
def test_deepspeed_refused_without_deepspeed(tmp_path):
    out = tmp_path / "peers.jsonl"
    cmd = [
        sys.executable, "-m", "fitgpt", "bench", "sweep",
        "--systems", "deepspeed-z3-offload,deepspeed-z2-offload", "--sizes", "1",
        "--hidden", "32", "--heads", "4", "--seq-len", "32", "--vocab-size", "256",
        "--device", "cpu", "--out", str(out),
    ]  # fmt: skip
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    recs = {rec["system"]: rec for rec in map(json.loads, out.read_text().splitlines())}
    assert set(recs) == {"deepspeed-z3-offload", "deepspeed-z2-offload"}
    for rec in recs.values():
        assert rec["status"] == "refused", rec
        assert "deepspeed is not installed: pip install 'fitgpt[bench]'" in rec["reason"]


def test_zero_infinity_needs_a_disk_folder_and_swaps_both_tiers_there(tmp_path):
    """deepspeed-z3-nvme: refused in one line without --nvme-path (before DeepSpeed is
    imported), and its config puts parameters and optimizer state on that folder's disk with
    swap buffers the size of the largest parameter."""
    out = tmp_path / "peers.jsonl"
    cmd = [
        sys.executable, "-m", "fitgpt", "bench", "sweep", "--systems", "deepspeed-z3-nvme",
        "--sizes", "1", "--hidden", "32", "--heads", "4", "--seq-len", "32", "--vocab-size",
        "256", "--device", "cpu", "--out", str(out),
    ]  # fmt: skip
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    (rec,) = map(json.loads, out.read_text().splitlines())
    assert rec["status"] == "refused" and "--nvme-path" in rec["reason"], rec

    from fitgpt.bench.config import BenchConfig
    from fitgpt.bench.peers.deepspeed_peer import ds_config, largest_parameter
    from fitgpt.engine.config import OptimConfig

    bench = BenchConfig(hidden=32, heads=4, seq_len=32, vocab_size=256, nvme_path=str(tmp_path))
    cfg = bench.model(2)
    largest = largest_parameter(cfg)
    assert largest == cfg.padded_vocab_size * cfg.n_embd  # the (untied) head or the embedding
    zero = ds_config(bench, 3, True, OptimConfig(), largest)["zero_optimization"]
    for tier in ("offload_param", "offload_optimizer"):
        assert zero[tier]["device"] == "nvme" and zero[tier]["nvme_path"] == str(tmp_path)
    assert zero["offload_param"]["buffer_size"] == largest
    assert ds_config(bench, 3, True, OptimConfig())["zero_optimization"]["offload_param"] == {
        "device": "cpu",
        "pin_memory": True,
    }
