"""The learning-rate schedule and the default rates `fitgpt train` works out from the model."""

import itertools

import pytest

from fitgpt.cli import build_parser
from fitgpt.cli.train import apply_deepspeed_flags, resolve_command
from fitgpt.errors import UserError
from fitgpt.train.schedule import DEFAULT_LR_BY_WIDTH, default_lr, lr_at


def rates(*flags: str) -> tuple[float, float]:
    """(lr, min_lr) of the run `fitgpt train FLAGS` resolves to (nothing is built or run)."""
    args = build_parser().parse_args(["train", "--data", "synthetic", *flags])
    if args.deepspeed_config:
        apply_deepspeed_flags(args)  # as `fitgpt train` does first: its keys become flags
    run, _, _ = resolve_command(args)
    return run.train.lr, run.train.min_lr


def test_warmup_rises_linearly_then_the_cosine_ends_at_min_lr():
    lrs = [lr_at(s, 1e-3, 1e-4, 10, 100) for s in range(100)]
    assert lrs[:10] == pytest.approx([1e-3 * (s + 1) / 10 for s in range(10)])
    assert lrs[10] == pytest.approx(1e-3)
    assert all(a >= b for a, b in itertools.pairwise(lrs[10:]))
    assert lr_at(100, 1e-3, 1e-4, 10, 100) == pytest.approx(1e-4)


def test_the_default_peak_is_gpt3s_at_its_widths_and_falls_with_width():
    for width, lr in DEFAULT_LR_BY_WIDTH:
        assert default_lr(width) == lr
    assert default_lr(32) == 2e-3 and default_lr(20000) == 6e-5  # held beyond the ends
    widths = range(64, 16384, 64)
    assert all(default_lr(a) >= default_lr(b) for a, b in itertools.pairwise(widths))


@pytest.mark.parametrize(
    "flags, expect",
    [
        (["--preset", "tiny"], (2e-3, 2e-4)),  # the demo's rates, as before
        (["--preset", "gpt2-125m"], (6e-4, 6e-5)),
        (["--preset", "2.7b"], (1.6e-4, 1.6e-5)),
        (["--preset", "20b"], (9e-5, 9e-6)),  # was 2e-3: its loss jumped to 46 at step 1
        (["--preset", "tiny", "--hidden", "2560", "--heads", "32"], (1.6e-4, 1.6e-5)),
    ],
)
def test_a_run_that_names_no_rate_gets_its_models(flags, expect):
    assert rates(*flags) == expect


def test_named_rates_win_and_min_lr_follows_a_named_peak():
    assert rates("--preset", "20b", "--lr", "3e-4") == (3e-4, 3e-5)
    # a peak below the old fixed 2e-4 end is no longer refused for its default end
    assert rates("--preset", "tiny", "--lr", "1e-4") == (1e-4, 1e-5)
    assert rates("--preset", "20b", "--lr", "1e-4", "--min-lr", "0") == (1e-4, 0.0)
    assert rates("--preset", "gpt2-125m", "--min-lr", "1e-5") == (6e-4, 1e-5)
    with pytest.raises(UserError, match=r"--min-lr 0\.001 is above .* 9e-05 by default"):
        rates("--preset", "20b", "--min-lr", "1e-3")  # above the 20b's default peak
    with pytest.raises(UserError, match=r"--min-lr 0\.01 in \[0, lr\]"):
        rates("--lr", "1e-3", "--min-lr", "1e-2")


def test_init_from_takes_the_rates_of_the_sources_width(tmp_path):
    transformers = pytest.importorskip("transformers")
    cfg = transformers.GPT2Config(n_layer=1, n_embd=768, n_head=12, n_positions=32, vocab_size=256)
    transformers.GPT2LMHeadModel(cfg).save_pretrained(tmp_path / "hf")
    # the tiny preset (128 wide) is the command's base; the source's 768 decide
    assert rates("--init-from", str(tmp_path / "hf"), "--tokenizer", "bytes") == (6e-4, 6e-5)


def test_a_deepspeed_config_naming_only_the_lr_ends_at_a_tenth_of_it(tmp_path):
    (tmp_path / "ds.json").write_text('{"optimizer": {"type": "AdamW", "params": {"lr": 1e-4}}}')
    assert rates("--preset", "2.7b", "--deepspeed-config", str(tmp_path / "ds.json")) == (
        1e-4,
        1e-5,
    )
