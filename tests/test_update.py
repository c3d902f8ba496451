"""The sync-free update (engine/chunked/update.py step_on_device): plans whose optimizer state is
all on the device take the clip coefficient and the overflow test on the device and queue the update
behind the backward. It must step as the host-synced update does: the same clipping, the same
skipped steps under fp16 overflow, the same step counts."""

from __future__ import annotations

import pytest
import torch
from helpers import TINY

from fitgpt.dist import DistContext
from fitgpt.engine.chunked.update import TieredUpdate
from fitgpt.engine.config import EngineConfig, OptimConfig, PrecisionConfig
from fitgpt.engine.factory import build_engine

CPU = DistContext(0, 1, 0, torch.device("cpu"))
MODEL = TINY.replace(n_layer=3)
NO_CLIP, ALWAYS_CLIP = 1e6, 0.05  # the tiny model's gradient norm is 0.5-3


def run(steps: int, clip: float, precision: str, sync_free: bool, monkeypatch, **engine):
    """Losses, skipped steps, the optimizer's step count and the final weights."""
    with monkeypatch.context() as m:
        if not sync_free:
            m.setattr(TieredUpdate, "sync_free", property(lambda self: False))
        pcfg = PrecisionConfig(precision, initial_scale=2.0**22, hysteresis=1)
        e = build_engine(MODEL, EngineConfig(engine="zero", **engine), pcfg,
                         OptimConfig(grad_clip=clip), CPU)  # fmt: skip
        assert e.updater.sync_free == sync_free
        g = torch.Generator().manual_seed(3)
        losses, skipped = [], 0
        for _ in range(steps):
            x = torch.randint(0, MODEL.vocab_size // 4, (8, MODEL.seq_len + 1), generator=g)
            micro = [(x[i : i + 4, :-1], x[i : i + 4, 1:]) for i in (0, 4)]
            stats = e.train_step(micro, 3e-3)
            losses.append(stats.loss)
            skipped += stats.skipped
        count = e.extra_state()["optimizer_step"]
        state = e.inference_model().state_dict()
        e.close()
    return losses, skipped, count, torch.cat([t.float().flatten() for t in state.values()])


@pytest.mark.parametrize("clip", [NO_CLIP, ALWAYS_CLIP])
@pytest.mark.parametrize("stage", [0, 1])
def test_the_device_update_steps_as_the_synced_one(clip, stage, monkeypatch):
    ref = run(6, clip, "fp32", False, monkeypatch, zero_stage=stage)
    got = run(6, clip, "fp32", True, monkeypatch, zero_stage=stage)
    # the same float64 arithmetic for grad_mul, the same fp32 multiply: bit-identical
    assert got[0] == ref[0] and torch.equal(got[3], ref[3])
    assert got[1:3] == ref[1:3] == (0, 6)
    assert not torch.equal(got[3], run(6, NO_CLIP if clip != NO_CLIP else ALWAYS_CLIP, "fp32",
                                       True, monkeypatch, zero_stage=stage)[3])  # fmt: skip


def test_fp16_overflows_take_no_step_on_the_device(monkeypatch):
    # a loss scale of 2^22 overflows the first steps, then halves until it fits
    ref = run(10, NO_CLIP, "fp16", False, monkeypatch)
    got = run(10, NO_CLIP, "fp16", True, monkeypatch)
    assert 0 < got[1] == ref[1] < 10  # the same steps skipped
    assert got[2] == ref[2] == 10 - ref[1]  # and not counted by the optimizer
    assert got[0] == ref[0] and torch.equal(got[3], ref[3])
