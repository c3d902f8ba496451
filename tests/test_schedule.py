"""The learning-rate schedule and the defaults `fitgpt train` works out from the model, the
batch and the run's length (train/schedule.py resolve_schedule)."""

import itertools
import json
import math
import subprocess

import pytest
from cli_refusal import run_main

from fitgpt.cli import build_parser
from fitgpt.cli.train import asked_by
from fitgpt.errors import UserError
from fitgpt.model import ModelConfig
from fitgpt.train.guard import DivergenceGuard
from fitgpt.train.schedule import (
    DEFAULT_LR_BY_WIDTH,
    default_lr,
    default_warmup,
    first_step_warmup,
    lr_at,
    resolve_schedule,
)


def resolved(*flags: str, world: int = 1):
    """(the TrainConfig, the lines printed) of the run `fitgpt train FLAGS` resolves to on
    `world` data-parallel ranks, as the Trainer resolves it (nothing is built or run)."""
    args = build_parser().parse_args(["train", "--data", "synthetic", *flags])
    run = asked_by(args).config  # a DeepSpeed config's keys among the flags, as train reads them
    t = run.train
    tokens = t.micro_batch * t.grad_accum * world * run.model.seq_len
    train, line, warning = resolve_schedule(
        t, run.model, tokens, run.optim.beta2, run.adapter.active
    )
    return train, [x for x in (line, warning) if x]


def rates(*flags: str) -> tuple[float, float]:
    """(lr, min_lr) of the run `fitgpt train FLAGS` resolves to."""
    train, _ = resolved(*flags)
    return train.lr, train.min_lr


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
    # the tiny preset (128 wide) is the command's base; the source's 768 decide; fine-tuning
    # takes a tenth of the pre-training peak (HF Trainer's 5e-5, nanoGPT's fine-tuning 3e-5)
    assert rates("--init-from", str(tmp_path / "hf"), "--tokenizer", "bytes") == (6e-5, 6e-6)


def test_adapters_take_qloras_rates_by_size_and_fine_tunings_warmup():
    """--lora-rank: the adapters start from zero on a frozen base, so the default peak is the
    QLoRA paper's, 2e-4 below 20 B parameters and 1e-4 from there (its "33 B" has 32.5 B, so
    Qwen3-32B takes 1e-4), not a full fine-tune's tenth of the width's (1.2e-5 at Llama-3-8B),
    warmed up over fine-tuning's 3% of the run; the line says LoRA's defaults; a named rate
    still wins."""
    train, lines = resolved("--preset", "llama3.1-8b", "--lora-rank", "16", "--steps", "1000")
    assert (train.lr, train.min_lr, train.warmup) == (2e-4, 2e-5, 30)
    assert lines[0].startswith("defaults: LoRA, lr 0.0002 peak (LoRA's at 8.03 B parameters)")
    assert "warm-up 30 steps" in lines[0] and "3% of the run" in lines[0]
    big, _ = resolved("--preset", "llama3.1-70b", "--lora-rank", "16", "--steps", "100")
    assert (big.lr, big.warmup) == (1e-4, 3)
    assert rates("--preset", "qwen3-32b", "--lora-rank", "16")[0] == 1e-4
    assert rates("--preset", "llama3.1-8b") != rates("--preset", "llama3.1-8b", "--lora-rank", "8")
    assert rates("--preset", "llama3.1-8b", "--lora-rank", "8", "--lr", "5e-5") == (5e-5, 5e-6)


def test_a_deepspeed_config_naming_only_the_lr_ends_at_a_tenth_of_it(tmp_path):
    (tmp_path / "ds.json").write_text('{"optimizer": {"type": "AdamW", "params": {"lr": 1e-4}}}')
    assert rates("--preset", "2.7b", "--deepspeed-config", str(tmp_path / "ds.json")) == (
        1e-4,
        1e-5,
    )


TOKENS_131K = 8 * 16 * 1024  # the runs: micro-batch 8 x 16 (4 accumulation x 4 GPUs)


@pytest.mark.parametrize(
    "steps, tokens_per_step, expect",
    [
        (300, TOKENS_131K, 40),  # a short run: Adam's 2/(1-beta2) steps (was 50 at any length)
        (20_000, TOKENS_131K, 1000),  # 5% of the run: 131 M tokens, under GPT-3's 375 M
        (1_000_000, 512 * 1024, 716),  # long enough: GPT-3's 375 M tokens, whatever the batch
        (1_000_000, 2048 * 1024, 179),  # 4x the batch, a quarter of the steps: same tokens
        (8, TOKENS_131K, 40),  # shorter than Adam's 40: it ends before its peak
        (1, 64, 40),
    ],
)
def test_the_default_warmup_counts_tokens_and_the_runs_length(steps, tokens_per_step, expect):
    warmup, why = default_warmup(steps, tokens_per_step, beta2=0.95, finetune=False)
    assert warmup == expect, why
    assert ("ends before its peak" in why) == (warmup > steps)


def test_the_warmup_counts_every_data_parallel_ranks_tokens():
    # a long run (5% of it is above 375 M tokens): the warm-up is GPT-3's tokens, so twice the
    # ranks (or the micro-batch, or the accumulation) halve its steps
    long = ("--preset", "gpt2-125m", "--steps", "2000000", "--micro-batch", "8")
    one = resolved(*long, world=1)[0].warmup
    assert one == math.ceil(375e6 / (8 * 1024))
    assert resolved(*long, world=8)[0].warmup == math.ceil(one / 8)
    assert resolved(*long, "--grad-accum", "4", world=2)[0].warmup == math.ceil(one / 8)
    assert resolved(*long, "--micro-batch", "16", world=4)[0].warmup == math.ceil(one / 8)
    # Adam's beta2 sets the floor: 2/(1-0.99) = 200 steps of a 300-step run
    assert resolved("--steps", "300", "--beta2", "0.99")[0].warmup == 200
    assert resolved("--steps", "300", "--warmup", "7")[0].warmup == 7  # a given one wins


def test_a_deep_wide_model_warms_up_long_enough_for_its_first_step():
    # the first rate keeps lr·5·L·d^1.5 within FIRST_STEP_BUDGET (20): 44 x 6144 at 9e-5 takes
    # 477 steps where Adam's floor was 40 (its loss rose from 10.7 to 19.2 at step 3 with 40)
    train, lines = resolved("--preset", "20b", "--steps", "300")
    assert train.warmup == 477 == first_step_warmup(9e-5, ModelConfig(44, 6144, 48))
    assert (
        "warm-up 477 steps (" in lines[0]
        and "a small first step at this depth and width" in lines[0]
    )
    assert "the run ends before its peak" in lines[0]
    # it grows with the depth and the rate, and the longer of it and the other rules wins
    deep = resolved("--preset", "20b", "--layers", "88", "--steps", "300")[0].warmup
    assert deep == first_step_warmup(9e-5, ModelConfig(88, 6144, 48)) == 954  # twice the depth
    assert resolved("--preset", "20b", "--lr", "4.5e-5", "--steps", "300")[0].warmup == 239
    assert resolved("--preset", "20b", "--steps", "100000")[0].warmup == 5000  # 5% is longer
    # a small model keeps Adam's 40; a named warm-up and fine-tuning take none of it
    assert resolved("--preset", "gpt2-125m", "--steps", "300")[0].warmup == 40
    assert resolved("--preset", "20b", "--warmup", "10")[0].warmup == 10
    warm, why = default_warmup(300, 8192, 0.95, finetune=True, first=477)
    assert (warm, why) == (9, "3% of the run")


def test_one_line_says_which_defaults_a_run_took():
    train, lines = resolved("--preset", "20b", "--steps", "30000")
    assert (train.lr, train.min_lr, train.warmup) == (9e-5, 9e-6, 1500)
    assert len(lines) == 1 and lines[0].startswith("defaults: pre-training, lr 9e-05 peak")
    for part in ("by width 6144", "warm-up 1500 steps", "init std 0.00807 (by width 6144)"):
        assert part in lines[0], lines[0]
    assert lines[0].endswith("set --lr/--min-lr/--warmup/--init-std to change")
    given = ("--lr", "1e-4", "--min-lr", "0", "--warmup", "10", "--init-std", "0.02")
    assert resolved(*given)[1] == []  # nothing defaulted: no line
    assert resolved("--lr", "1e-4", "--init-std", "0.02")[1] == [
        "defaults: pre-training, ending at 1e-05, warm-up 40 steps (122,880 tokens: Adam's "
        "2/(1-beta2)); set --min-lr/--warmup to change"
    ]


def test_a_warmup_longer_than_the_run_is_said_in_one_line():
    train, lines = resolved("--steps", "30", "--warmup", "100", "--lr", "1e-3")
    assert train.warmup == 100  # a warning, not a refusal: a first leg of a longer run is fine
    assert lines[-1] == (
        "--warmup 100 is above --steps 30: the warm-up never finishes and the rate never "
        "reaches its peak 0.001 (the last step's is 0.0003); lower --warmup or raise --steps"
    )
    assert len(resolved("--steps", "30", "--warmup", "30")[1]) == 1  # reached at the last step


@pytest.fixture
def fitgpt(capsys):
    """`fitgpt ARGV` in this process (its lines and files are the tests here, not its process:
    a new one costs ~2 s of torch's import), as a CompletedProcess."""

    def run(*argv: str) -> subprocess.CompletedProcess:
        code, out, err = run_main(capsys, *argv)
        return subprocess.CompletedProcess(argv, code, out, err)

    return run


TINY_RUN = (
    "--layers", "2", "--hidden", "32", "--heads", "4", "--seq-len", "16", "--micro-batch", "2",
    "--device", "cpu", "--plan", "off", "--engine", "ddp", "--eval-every", "0",
    "--log-every", "1", "--cpu-threads", "1",
)  # fmt: skip


def test_init_from_fine_tunes_at_a_lower_rate_with_a_short_warmup(tmp_path, fitgpt):
    src, out = tmp_path / "src", tmp_path / "ft"
    made = fitgpt("train", *TINY_RUN, "--data", "synthetic", "--steps", "2", "--out", str(src))
    assert made.returncode == 0, made.stderr
    r = fitgpt(
        "train", *TINY_RUN, "--data", "synthetic", "--steps", "40", "--no-save",
        "--init-from", str(src), "--out", str(out),
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    lines = [x for x in r.stdout.splitlines() if x.startswith("defaults:")]
    assert lines == [
        "defaults: fine-tuning, lr 0.0002 peak (a tenth of width 32), ending at 2e-05, warm-up "
        "2 steps (64 tokens: 3% of the run), init: the source's weights; set "
        "--lr/--min-lr/--warmup to change"
    ]
    recs = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    lrs = [x["lr"] for x in recs if x.get("kind") == "train"]
    assert lrs[:2] == pytest.approx([1e-4, 2e-4]) and max(lrs) == pytest.approx(2e-4)
    # a fresh run of the same shape: the pre-training defaults, in one line
    fresh = fitgpt("train", *TINY_RUN, "--data", "synthetic", "--steps", "2", "--no-save",
                   "--out", str(tmp_path / "fresh"))  # fmt: skip
    said = [x for x in fresh.stdout.splitlines() if x.startswith("defaults:")]
    assert len(said) == 1 and said[0].startswith("defaults: pre-training, lr 0.002 peak"), said
    # a resumed run continues with its saved (resolved) schedule: it takes no default
    resumed = fitgpt("train", *TINY_RUN, "--out", str(src), "--resume", "--steps", "3")
    assert resumed.returncode == 0 and "defaults:" not in resumed.stdout, resumed.stdout


# ---- what a diverging run is told to change (train/guard.py) ---------------------------------
def test_a_loss_that_stays_above_the_start_is_named_once_with_what_to_change():
    g = DivergenceGuard(max_bad=20, dynamic_scale=False)
    losses = [10.9, 46.5, 47.0, 30.5, 25.0, 14.0, 12.5, 30.0, 12.0]
    lines = []
    for step, loss in enumerate(losses, 1):
        g.record(step, loss, False)
        lines.append(g.spike_line(9e-5, 9e-5, 40))
    named = [x for x in lines if x is not None]
    assert lines.index(named[0]) == 5 and len(named) == 1  # step 6: the fifth above 12.0
    assert named[0] == (
        "step 6: the loss has stayed above step 1's 10.9 for 5 steps (now 14): the updates undo "
        "what the run learns; lower --lr (peak 9e-05, now 9e-05) or raise --warmup (now 40 steps)"
    )
    calm = DivergenceGuard(max_bad=20, dynamic_scale=False)  # noise within 10%: nothing said
    for step, loss in enumerate([3.0, 3.2, 3.25, 3.1, 3.3, 3.2, 3.2], 1):
        calm.record(step, loss, False)
        assert calm.spike_line(1e-4, 1e-4, 10) is None


@pytest.mark.parametrize(
    "fp16, scale, nonfinite, advice",
    [
        (True, 2.0**24, False, "the fp16 loss scale is still 1.67772e+07 after 20 overflows: "
         "lower --initial-scale (65536 is the default)"),
        (True, 64.0, False, "the gradients overflow fp16 even at a loss scale of 64: train in "
         "--precision bf16 (or fp32), not by lowering --lr"),
        (True, 64.0, True, "lower --lr (peak 0.002, now 0.001) or raise --warmup (now 50 steps)"),
        (False, 1.0, False, "lower --lr (peak 0.002, now 0.001) or raise --warmup (now 50 steps)"),
    ],
)  # fmt: skip
def test_the_advice_on_divergence_follows_its_cause(fp16, scale, nonfinite, advice):
    g = DivergenceGuard(max_bad=20, dynamic_scale=fp16)
    g.record(1, 10.0, False)
    for step in range(2, 22):  # 20 bad steps: skipped updates, or a NaN loss
        g.record(step, math.nan if nonfinite else 10.0, True, scale)
    assert g.tripped and g.advice(1e-3, 2e-3, 50) == advice


def test_a_run_whose_loss_stays_above_its_start_says_so_in_its_log(tmp_path, fitgpt):
    r = fitgpt(
        "train", *TINY_RUN, "--data", "synthetic", "--steps", "7", "--no-save", "--lr", "3",
        "--warmup", "0", "--max-bad-steps", "0", "--out", str(tmp_path),
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    named = [x for x in r.stdout.splitlines() if "the loss has stayed above step 1's" in x]
    assert (
        len(named) == 1
        and named[0].startswith("step 6: ")
        and "lower --lr (peak 3, now 0.808)" in named[0]
    )
