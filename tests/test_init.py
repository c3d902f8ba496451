"""Initialisation by width: the std a model's weights are drawn with, measured on built models,
and the same weights through every engine."""

import math

import pytest
import torch

from fitgpt.dist import DistContext
from fitgpt.engine.config import EngineConfig, OptimConfig, PrecisionConfig
from fitgpt.engine.factory import build_engine
from fitgpt.errors import UserError
from fitgpt.model import GPT, ModelConfig, get_preset
from fitgpt.model.config import small_init_std

CPU = DistContext(0, 1, 0, torch.device("cpu"))


def test_gpt2_widths_keep_gpt2s_std_and_wide_models_get_small_init():
    # GPT-2's own widths (and every narrower model) start from exactly 0.02
    for width in (32, 128, 768, 1000):
        assert small_init_std(width) == 0.02
    # beyond 1000 wide, sqrt(2/(5d)) (GPT-NeoX's small init): OPT-175B's 0.006 at 12288
    expect = {1024: 0.0198, 1600: 0.0158, 4096: 0.0099, 6144: 0.0081, 12288: 0.0057}
    for width, std in expect.items():
        assert small_init_std(width) == pytest.approx(std, abs=1e-4)
        assert small_init_std(width) == pytest.approx(math.sqrt(2 / (5 * width)))
    assert get_preset("gpt2-125m").weight_std() == 0.02
    assert get_preset("20b").weight_std() == pytest.approx(0.0081, abs=1e-4)
    assert get_preset("20b").residual_std() == pytest.approx(0.0081 / math.sqrt(88), abs=1e-5)


def measured(cfg: ModelConfig) -> tuple[float, float]:
    """(std of the qkv weights, std of the residual projections) of a model built from cfg."""
    model = GPT(cfg)
    model.reset_parameters(0)
    qkv = torch.cat([b.attn.qkv.weight.flatten() for b in model.blocks])
    proj = torch.cat([b.mlp.proj.weight.flatten() for b in model.blocks])
    return qkv.std().item(), proj.std().item()


@pytest.mark.parametrize("width, std", [(64, 0.02), (1280, 0.0177)])
def test_a_built_models_weights_have_the_std_of_its_width(width, std):
    cfg = ModelConfig(n_layer=2, n_embd=width, n_head=4, seq_len=8, vocab_size=64)
    qkv, proj = measured(cfg)
    assert qkv == pytest.approx(std, rel=0.03)
    assert proj == pytest.approx(std / 2, rel=0.03)  # 1/sqrt(2L), L = 2


def test_init_std_given_wins_and_is_checked():
    cfg = ModelConfig(n_layer=2, n_embd=64, n_head=4, seq_len=8, vocab_size=64, init_std=0.05)
    qkv, proj = measured(cfg)
    assert qkv == pytest.approx(0.05, rel=0.03) and proj == pytest.approx(0.025, rel=0.03)
    for bad in (0.0, -0.1, 1.5):
        with pytest.raises(UserError, match="--init-std"):
            ModelConfig(init_std=bad)


@pytest.mark.parametrize(
    "ecfg",
    [
        EngineConfig(engine="ddp"),
        EngineConfig(engine="zero", zero_stage=0),
        EngineConfig(engine="zero", zero_stage=3),
    ],
)
def test_every_engine_starts_from_the_models_init(ecfg):
    # the engines build on the meta device and initialise chunk by chunk: the weights must be
    # the model's own (GPT.init_parameter_), std and values
    cfg = ModelConfig(n_layer=2, n_embd=32, n_head=4, seq_len=8, vocab_size=64, init_std=0.05)
    ref = GPT(cfg)
    ref.reset_parameters(7)
    engine = build_engine(cfg, ecfg, PrecisionConfig(precision="fp32"), OptimConfig(), CPU, seed=7)
    try:
        got = dict(engine.inference_model().named_parameters())
        for name, p in ref.named_parameters():
            torch.testing.assert_close(got[name].float(), p, rtol=0, atol=0, msg=name)
    finally:
        engine.close()
