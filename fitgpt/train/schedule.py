"""Learning rate: linear warm-up from 0, then cosine decay to min_lr at the last step; and the
defaults a run takes when it names no rate or warm-up, decided here and only here
(resolve_schedule): the peak by the model's width, the warm-up by tokens and the run's length,
lower rates and a short warm-up when fine-tuning (--init-from). The warm-up counts the tokens a
step trains on as every other count of them does (plan/memory.py tokens_per_step)."""

from __future__ import annotations

import dataclasses
import math

import numpy as np

from fitgpt.model import ModelConfig
from fitgpt.train.config import TrainConfig

# The peak learning rate a run gets when it names none, by hidden size: GPT-3's (Brown et al.
# 2020, table 2.1: 125 M to 175 B, d_model 768 to 12288), and 2e-3 for the 128-wide CPU demo
# (`tiny`), interpolated log-log between these points and held beyond the ends. One rate for
# every size was the default before: 2e-3, ten to thirty times GPT-3's above a billion
# parameters, where the 20b preset's loss jumped from 11.7 to 46 after its first step
# (benchmarks/results/user_path_x2_h200_2026-11-24; docs/training.md). Wider models take
# smaller steps because Adam moves every weight by about the rate at once, and a matrix product
# sums those moves over its whole width.
DEFAULT_LR_BY_WIDTH = (
    (128, 2.0e-3),
    (768, 6.0e-4),
    (1024, 3.0e-4),
    (1536, 2.5e-4),
    (2048, 2.0e-4),
    (2560, 1.6e-4),
    (4096, 1.2e-4),
    (5140, 1.0e-4),
    (12288, 0.6e-4),
)
MIN_LR_RATIO = 0.1  # the cosine ends at a tenth of the peak, as GPT-3's does

# Fine-tuning (--init-from) starts where pre-training ended: at the end rate of the width's
# pre-training schedule (a tenth of the peak: 6e-5 at 768, 2.4e-5 at 1600). Public fine-tuning
# defaults sit there: Hugging Face Trainer's 5e-5, nanoGPT's GPT-2 fine-tuning 3e-5. A
# pre-training peak on pretrained weights undoes in a few steps what they learned.
FINETUNE_LR_RATIO = 0.1
FINETUNE_WARMUP_FRACTION = 0.03  # Alpaca's and Vicuna's warmup_ratio; HF Trainer's default is 0

# Adapters (--lora-rank) train from zero (B = 0) on a frozen base: they take a rate ten or more
# times a full fine-tune's, as the QLoRA paper's runs did (Dettmers et al. 2023, appendix B:
# 2e-4 for 7 B and 13 B, 1e-4 for 33 B (32.5 B parameters) and 65 B), with fine-tuning's
# warm-up; the cut between their sizes at 20 B. A full fine-tune's tenth of the width's rate
# (1.2e-5 at Llama-3-8B's 4096) is a tenth of theirs.
LORA_LR = ((20e9, 1e-4), (0.0, 2e-4))  # (parameters at or above, rate), largest first

# Pre-training warm-up, in tokens and bounded by the run's length. GPT-3 warmed every size up over
# 375 M tokens (Brown et al. 2020, appendix B; OPT's smaller models did the same): counted in
# tokens, the rate at a given number of tokens seen does not depend on the batch. A run too
# short for that (under 7.5 B tokens) spends WARMUP_FRACTION of its steps warming up, so that it
# trains near its peak for most of its length; but never fewer than Adam's own warm-up,
# 2/(1-beta2) steps (Ma & Yarats 2019: 40 at beta2 0.95; before that the second-moment estimate
# is still noisy and each update moves every weight by about the full rate). That floor holds
# even in a run shorter than it, which then ends before its peak: the first step's rate is the
# peak over the warm-up, and a short run that warmed up over its own 8 steps took its first
# step at 1.5e-5 and doubled its loss, where 40 steps kept it falling
# (benchmarks/results/defaults_cpu_2026-11-26, run C). The fixed 50 steps this replaces was
# 6.5 M tokens at 131 k tokens per step whatever the run's length.
WARMUP_TOKENS = 375_000_000
WARMUP_FRACTION = 0.05

# A deep, wide model's first steps. Adam's first update moves every weight by about the rate in
# the sign of its gradient, and its momentum carries the second step on in the same direction, so
# to first order the first steps change the loss by lr·‖g‖₁ ≈ lr·√N·‖g‖₂ each: that grows with
# the model, and once it is far above the loss there is to lose, the steps overshoot. Measured on
# fresh GPT-2-shaped models (first-step gradient norms 388 at 48 × 1600, 439 at 16 × 6144, 721 at
# 44 × 6144, 1,386 at 152 × 6144; 12 at 4 × 128 and 59 at 96 × 128 on CPU): √N·‖g₁‖ ≈ 5·L·d^1.5
# (L layers, d wide; within 2x of all six). With Adam's 40-step floor alone, that product times
# the first rate was 86-820 at 1.5-69 B, and the losses rose from 10.1-10.8 at step 1 to
# 13.6-23.5 at steps 2-4; a 152 × 2048 model at 350 rose to 18.7 at step 3 and 13.5 at step 10.
# At 20 (warm-up 185 at 1.5 B, 705 at 152 × 2048) neither rose above step 1's loss at any step,
# and 1.5 B ended 300 steps at 2.30 where the 40-step warm-up ended at 2.62 (benchmarks/results/
# defaults_gpu_2026-11-26). Published recipes at these sizes sit at 7-60: GPT-NeoX-20B 7 (1,500
# steps), llm.c's GPT-2 1.5B 13, Llama-2-70B 22, OPT-175B 39 (2,000 steps). The cost: a deep model
# reaches its peak later (a 69 B model of 152 layers warms up over ~1,650 steps).
FIRST_STEP_BUDGET = 20.0


def default_lr(n_embd: int) -> float:
    """The peak learning rate for a model n_embd wide (DEFAULT_LR_BY_WIDTH), to 2 significant
    digits so that logs and configs read plainly."""
    widths, rates = zip(*DEFAULT_LR_BY_WIDTH, strict=True)
    log_lr = np.interp(math.log(n_embd), np.log(widths), np.log(rates))  # held at the ends
    return float(f"{math.exp(log_lr):.2g}")


def lr_at(step: int, lr: float, min_lr: float, warmup: int, total: int) -> float:
    if step < warmup:
        return lr * (step + 1) / warmup
    if total <= warmup:
        return lr
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return min_lr + 0.5 * (lr - min_lr) * (1.0 + math.cos(math.pi * progress))


def end_lr(lr: float) -> float:
    """The default learning rate at the end of the cosine for a peak of lr: MIN_LR_RATIO of it,
    to 3 significant digits (6e-5 for 6e-4, not 5.9999999999999995e-05)."""
    return float(f"{lr * MIN_LR_RATIO:.3g}")


def peak_lr(model: ModelConfig, finetune: bool, adapters: bool = False) -> float:
    """The default peak learning rate: LoRA's by the model's size (LORA_LR) for adapters, else
    by the width (default_lr), a tenth of it to fine-tune."""
    if adapters:
        n = model.num_params()
        return next(lr for at, lr in LORA_LR if n >= at)
    lr = default_lr(model.n_embd)
    return float(f"{lr * FINETUNE_LR_RATIO:.2g}") if finetune else lr


def first_step_warmup(lr: float, model: ModelConfig) -> int:
    """The fewest warm-up steps whose first rate (lr / steps) keeps a fresh model's first update
    within FIRST_STEP_BUDGET (the comment above it): lr·5·L·d^1.5 / budget."""
    return math.ceil(lr * 5 * model.n_layer * model.n_embd**1.5 / FIRST_STEP_BUDGET)


def default_warmup(
    steps: int, tokens_per_step: int, beta2: float, finetune: bool, first: int = 0
) -> tuple[int, str]:
    """(the default warm-up steps, which rule set it) for a run of `steps` optimizer steps of
    `tokens_per_step` tokens each (every data-parallel rank's); `first`: first_step_warmup's
    floor for the model and rate (0: none)."""
    if finetune:
        return max(1, math.ceil(FINETUNE_WARMUP_FRACTION * steps)), "3% of the run"
    by_tokens = math.ceil(WARMUP_TOKENS / tokens_per_step)
    by_length = math.ceil(WARMUP_FRACTION * steps)
    adam = math.ceil(2 / (1 - beta2))
    floor, why = (
        (first, "a small first step at this depth and width")
        if first > adam
        else (adam, "Adam's 2/(1-beta2)")
    )
    if floor >= min(by_tokens, by_length):
        return floor, why + ("; the run ends before its peak" if floor > steps else "")
    if by_tokens <= by_length:
        return by_tokens, f"{WARMUP_TOKENS / 1e6:.0f} M tokens, GPT-3's"
    return by_length, "5% of the run"


def resolve_schedule(
    train: TrainConfig,
    model: ModelConfig,
    tokens_per_step: int,
    beta2: float,
    adapters: bool = False,
) -> tuple[TrainConfig, str | None, str | None]:
    """(`train` with the rates and warm-up it leaves unset (None) worked out, the one line
    saying which defaults the run took or None, a warning about a warm-up that never finishes
    or None). `adapters`: the run trains LoRA adapters (RunConfig.adapter.active): LoRA's rate
    and fine-tuning's warm-up."""
    chosen, flags = [], []
    line = warning = None
    lr, min_lr, warmup = train.lr, train.min_lr, train.warmup
    tune = train.finetune or adapters  # fine-tuning's warm-up
    kind = "LoRA" if adapters else "fine-tuning" if train.finetune else "pre-training"
    if lr is None:
        lr = peak_lr(model, train.finetune, adapters)
        if adapters:
            whose = f"LoRA's at {_count(model.num_params())} parameters"
        else:
            whose = ("a tenth of width " if train.finetune else "by width ") + str(model.n_embd)
        chosen.append(f"lr {lr:.2g} peak ({whose})")
        flags.append("--lr")
    if min_lr is None:
        min_lr = end_lr(lr)
        chosen.append(f"ending at {min_lr:.2g}")
        flags.append("--min-lr")
    if warmup is None:
        first = 0 if tune else first_step_warmup(lr, model)
        warmup, why = default_warmup(train.steps, tokens_per_step, beta2, tune, first)
        tokens = warmup * tokens_per_step
        chosen.append(f"warm-up {warmup} steps ({_count(tokens)} tokens: {why})")
        flags.append("--warmup")
    if train.finetune:
        chosen.append("init: the source's weights")
    elif model.init_std is None:
        chosen.append(f"init std {model.weight_std():.3g} (by width {model.n_embd})")
        flags.append("--init-std")
    if flags:
        line = f"defaults: {kind}, {', '.join(chosen)}; set {'/'.join(flags)} to change"
    if warmup > train.steps and train.warmup is not None:  # a default's line says it already
        last = lr_at(train.steps - 1, lr, min_lr, warmup, train.steps)
        warning = (
            f"--warmup {warmup} is above --steps {train.steps}: the warm-up never finishes and "
            f"the rate never reaches its peak {lr:.2g} (the last step's is {last:.2g}); lower "
            "--warmup or raise --steps"
        )
    return dataclasses.replace(train, lr=lr, min_lr=min_lr, warmup=warmup), line, warning


def _count(n: int) -> str:
    """A token count as a log reads it: 4,096, 1.3 M, 375 M, 2.1 B."""
    if n < 1e6:
        return f"{n:,}"
    if n < 1e9:
        return f"{n / 1e6:.3g} M"
    return f"{n / 1e9:.3g} B"
