"""The speculative update (engine/chunked/update.py, engine/formats/speculate.py): host-homed chunks
step during the backward on the guess "no clip, no overflow"; right guesses are bit-identical to the
exact path, wrong ones are undone and redone within a few ulps, and counted."""

import json
import shutil
from pathlib import Path

import pytest
import torch
from conftest import run_gloo
from helpers import TINY, run_config, train

from fitgpt.dist import DistContext, init_distributed
from fitgpt.engine.config import EngineConfig, OptimConfig, PrecisionConfig
from fitgpt.engine.factory import build_engine
from fitgpt.engine.formats.speculate import undo_adamw_

CPU = DistContext(0, 1, 0, torch.device("cpu"))
MODEL = TINY.replace(n_layer=4)
NO_CLIP, ALWAYS_CLIP = 1e6, 0.05  # the tiny model's gradient norm is 0.5-3


def ulps(x: torch.Tensor) -> torch.Tensor:
    return torch.nextafter(x, torch.tensor(float("inf"))) - x


def test_the_first_step_and_a_zero_beta_come_back_exactly():
    g = torch.Generator().manual_seed(0)
    for step, betas in ((1, (0.9, 0.95)), (5, (0.0, 0.0))):
        p, grad = torch.randn(4096, generator=g), torch.randn(4096, generator=g) * 1e3
        m, v = (torch.zeros(4096) for _ in range(2))
        if step > 1:
            m, v = torch.randn(4096, generator=g), torch.rand(4096, generator=g)
        torch._fused_adamw_([p], [grad], [m], [v], [], [torch.tensor(float(step))], lr=1e-3,
                            beta1=betas[0], beta2=betas[1], weight_decay=0.0, eps=1e-8,
                            amsgrad=False, maximize=False)  # fmt: skip
        undo_adamw_(p, grad, m, v, step, 1e-3, betas, 0.0, 1e-8)
        assert torch.isfinite(p).all() and not m.any() and not v.any()


def test_the_cautious_rule_guesses_only_after_a_clean_step():
    place = PLACEMENTS["host-fp32"]
    always = run(6, ALWAYS_CLIP, cautious=True, **place)
    assert always[2:] == (0, 0)  # every step clipped: never a guess, never a rollback
    never = run(6, NO_CLIP, cautious=True, **place)
    assert never[2:] == (0, 5)  # every step but the first guessed, and rightly
    ref = run(6, NO_CLIP, speculative_update=False, **place)
    assert never[0] == ref[0] and torch.equal(never[1], ref[1])
    # the norm falls from 2.4 to 0.49, crossing 0.65 at step 11 and back above it at step 12:
    # one clean step, one wrong guess after it, then guesses again from step 14
    mixed = run(14, 0.65, cautious=True, **place)
    assert mixed[2] >= 1 and mixed[3] < 13


@pytest.mark.parametrize("step", [1, 2, 50, 3000])
def test_undo_returns_within_a_few_ulps(step):
    g = torch.Generator().manual_seed(step)
    n = 1 << 16
    p = torch.randn(n, generator=g) * 0.02
    m = torch.randn(n, generator=g) * 1e-3 * (step > 1)
    v = torch.rand(n, generator=g) * 1e-5 * (step > 1)
    grad = torch.randn(n, generator=g) * torch.logspace(-6, 0, n)  # small to dominant
    old = [t.clone() for t in (p, m, v)]
    kw = dict(lr=3e-4, beta1=0.9, beta2=0.95, weight_decay=0.1, eps=1e-8)
    torch._fused_adamw_([p], [grad], [m], [v], [], [torch.tensor(float(step))], **kw,
                        amsgrad=False, maximize=False)  # fmt: skip
    new = [t.clone() for t in (p, m, v)]
    undo_adamw_(p, grad, m, v, step, 3e-4, (0.9, 0.95), 0.1, 1e-8)
    # against the ulp of the largest value each recurrence handled
    scale = [
        torch.maximum(old[0].abs(), new[0].abs()),
        torch.maximum(torch.maximum(old[1].abs(), new[1].abs()), 0.1 * grad.abs()),
        torch.maximum(torch.maximum(old[2], new[2]), 0.05 * grad.square()),
    ]
    for got, want, s, bound in zip((p, m, v), old, scale, (8, 2, 2)):
        assert ((got - want).abs() <= bound * ulps(s)).all()
    assert not torch.equal(new[0], old[0])  # the step did move the weights


def run(steps: int, clip: float, precision: str = "fp32", ctx=CPU, cautious=False, **engine):
    """Losses, the final weights and the rollback counters of a tiny 4-layer run. cautious=False
    (the tests' default): guess at every step, so that every rule is exercised at every step."""
    pcfg = PrecisionConfig(precision, initial_scale=2.0**22, hysteresis=1)
    e = build_engine(MODEL, EngineConfig(engine="zero", **engine), pcfg,
                     OptimConfig(grad_clip=clip), ctx)  # fmt: skip
    e.updater.cautious = cautious
    g = torch.Generator().manual_seed(7)
    b = 4 // ctx.world
    losses = []
    for _ in range(steps):
        x = torch.randint(0, MODEL.vocab_size // 4, (8, MODEL.seq_len + 1), generator=g)
        rows = [x[i * 4 : (i + 1) * 4][ctx.rank * b : (ctx.rank + 1) * b] for i in range(2)]
        losses.append(e.train_step([(r[:, :-1], r[:, 1:]) for r in rows], 3e-3).loss)
    state = e.inference_model().state_dict()
    w = torch.cat([t.float().flatten() for t in state.values()])
    out = e.breakdown()
    e.close()
    return losses, w, out.get("rollbacks_total"), out.get("speculated_steps_total")


PLACEMENTS = {
    "host-fp32": dict(offload_optimizer="cpu", offload_blocks=2),
    "host-stage3-streamed": dict(
        offload_optimizer="cpu", offload_blocks=2, offload_params="cpu", zero_stage=3
    ),
    "split-bf16": dict(offload_optimizer="cpu", offload_blocks=3, master="split", moments="bf16"),
    "split-int8-stage2": dict(
        offload_optimizer="cpu", offload_blocks=2, master="split", moments="int8", zero_stage=2
    ),
}


@pytest.mark.parametrize("name", list(PLACEMENTS))
def test_right_guesses_are_bit_identical(name):
    precision = "bf16" if "split" in name else "fp32"
    steps = 30 if name == "host-fp32" else 10
    ref = run(steps, NO_CLIP, precision, speculative_update=False, **PLACEMENTS[name])
    got = run(steps, NO_CLIP, precision, **PLACEMENTS[name])
    assert got[0] == ref[0] and torch.equal(got[1], ref[1])
    assert got[2:] == (0, steps) and ref[2:] == (0, 0)


def test_the_disk_tier_speculates_too(tmp_path):
    place = dict(offload_optimizer="cpu", offload_blocks=4, nvme_blocks=2, nvme_path=str(tmp_path))
    ref = run(8, NO_CLIP, speculative_update=False, **place)
    got = run(8, NO_CLIP, **place)
    assert got[0] == ref[0] and torch.equal(got[1], ref[1]) and got[2:] == (0, 8)
    clipped = run(4, ALWAYS_CLIP, **place)
    exact = run(4, ALWAYS_CLIP, speculative_update=False, **place)
    assert clipped[2:] == (4, 4)
    assert (clipped[1] - exact[1]).abs().max() < 1e-5


@pytest.mark.parametrize("name", ["host-fp32", "split-bf16"])
def test_clipped_steps_are_undone_and_redone(name):
    precision = "bf16" if "split" in name else "fp32"
    ref = run(12, ALWAYS_CLIP, precision, speculative_update=False, **PLACEMENTS[name])
    got = run(12, ALWAYS_CLIP, precision, **PLACEMENTS[name])
    assert got[2:] == (12, 12)  # every step clipped: every guess rolled back
    # fp32: a redone step is within a few ulps of the exact one; bf16 working weights can
    # then round one bf16 ulp (2^-8 relative) apart
    tol = 1e-5 if precision == "fp32" else 2e-2
    assert max(abs(a - b) for a, b in zip(got[0], ref[0])) < tol
    assert (got[1] - ref[1]).abs().max() < tol


def test_fp16_overflow_steps_are_skipped_exactly():
    # a loss scale of 2^22 overflows the first steps, then halves until it fits
    place = PLACEMENTS["host-fp32"]
    ref = run(10, NO_CLIP, "fp16", speculative_update=False, **place)
    got = run(10, NO_CLIP, "fp16", **place)
    assert 0 < got[2] < 10 and got[3] == 10  # the overflowed steps were rolled back
    # a chunk whose own gradient was finite stepped and was undone (within ulps); fp16 working
    # weights may then round one fp16 ulp (2^-11 relative) apart
    assert max(abs(a - b) for a, b in zip(got[0], ref[0])) < 1e-3
    assert (got[1] - ref[1]).abs().max() < 5e-3


def _two_rank(rank: int, world: int, out: str) -> None:
    ctx = init_distributed("cpu")
    res = {}
    for stage in (0, 1, 2, 3):
        place = dict(offload_optimizer="cpu", offload_blocks=2, zero_stage=stage)
        for clip in (NO_CLIP, ALWAYS_CLIP):
            for spec in (False, True):
                losses, w, rb, _ = run(4, clip, ctx=ctx, speculative_update=spec, **place)
                res[f"{stage}-{clip}-{spec}"] = {"losses": losses, "w": w.tolist(), "rb": rb}
    if rank == 0:
        Path(out).write_text(json.dumps(res))


@pytest.mark.slow
def test_two_ranks_every_stage(tmp_path):
    out = tmp_path / "res.json"
    run_gloo(2, _two_rank, str(out))
    res = json.loads(out.read_text())
    for stage in (0, 1, 2, 3):
        ref, got = res[f"{stage}-{NO_CLIP}-False"], res[f"{stage}-{NO_CLIP}-True"]
        assert got["losses"] == ref["losses"] and got["w"] == ref["w"] and got["rb"] == 0
        ref, got = res[f"{stage}-{ALWAYS_CLIP}-False"], res[f"{stage}-{ALWAYS_CLIP}-True"]
        assert got["rb"] == 4
        assert max(abs(a - b) for a, b in zip(got["w"], ref["w"])) < 1e-5


def test_resume_in_a_run_with_rollbacks(tmp_path):
    kw = dict(n_layer=4, engine="zero", offload_optimizer="cpu", offload_blocks=2, grad_clip=1.1)
    full = train(run_config(tmp_path, steps=14, save_every=7, log_every=1, **kw), CPU)
    shutil.rmtree(tmp_path / "step_00000014")
    resumed = train(run_config(tmp_path, steps=14, log_every=1, **kw), CPU, resume="")
    # norms here: guesses right at steps 4 and 14, wrong at 5, 7 and 11 (after the checkpoint).
    # The same guesses (the rule's state is in the checkpoint), rollbacks and arithmetic
    assert resumed["losses"] == full["losses"][7:]
    first, later = full["history"][6], full["history"][-1]
    assert later["rollbacks"] > first["rollbacks"]  # a wrong guess after the checkpoint
    # (the counters are this process's: the resumed run's start at 0)
    assert [r["rollbacks"] for r in resumed["history"]] == [
        r["rollbacks"] - first["rollbacks"] for r in full["history"][7:]
    ]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU: there a guessing "
                    "job's finiteness check reads the gradient norm computed on the device")  # fmt: skip
def test_on_a_gpu_guesses_stand_and_overflowed_chunks_take_no_step():
    gpu = DistContext(0, 1, 0, torch.device("cuda"))
    place = PLACEMENTS["host-fp32"]
    # GPU kernels (attention's backward) need not be deterministic: close, not bit-identical
    ref = run(8, NO_CLIP, ctx=gpu, speculative_update=False, **place)
    got = run(8, NO_CLIP, ctx=gpu, **place)
    assert got[2:] == (0, 8)
    assert max(abs(a - b) for a, b in zip(got[0], ref[0])) < 1e-4
    ref = run(10, NO_CLIP, "fp16", ctx=gpu, speculative_update=False, **place)
    got = run(10, NO_CLIP, "fp16", ctx=gpu, **place)
    assert 0 < got[2] < 10 and got[3] == 10  # the overflowed steps were rolled back
    assert max(abs(a - b) for a, b in zip(got[0], ref[0])) < 1e-3
    assert torch.isfinite(got[1]).all() and (got[1] - ref[1]).abs().max() < 5e-3
