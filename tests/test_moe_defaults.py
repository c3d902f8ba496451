"""What a mixture of experts gets when the flags say nothing: its micro-batch (train/config.py
default_micro_batch, settled by RunConfig) and the expert parallelism the planner prices
(plan/fixed.py Fixed.expert_parallel)."""

from __future__ import annotations

import re

import pytest
from cli_refusal import run_main

from fitgpt.model import get_preset
from fitgpt.plan.enumeration import ep_degrees
from fitgpt.plan.fixed import Fixed
from fitgpt.plan.memory import Workload
from fitgpt.train.config import (
    DENSE_MICRO_BATCH,
    MOE_MICRO_TOKENS,
    RunConfig,
    TrainConfig,
    default_micro_batch,
)

MOE = ("qwen3-moe-30b-a3b", "mixtral-8x7b", "gpt-oss-20b")


def run_of(model, train: TrainConfig) -> RunConfig:
    from fitgpt.data.config import DataConfig
    from fitgpt.engine.config import EngineConfig, OptimConfig, PrecisionConfig

    return RunConfig(model, DataConfig(), train, EngineConfig(), PrecisionConfig(), OptimConfig())


@pytest.mark.parametrize("preset", MOE)
@pytest.mark.parametrize("seq", [1024, 4096, 8192, 65536])
def test_a_mixture_of_experts_holds_its_tokens_per_micro_batch(preset, seq):
    model = get_preset(preset).replace(seq_len=seq)
    run = run_of(model, TrainConfig())
    b = run.train.micro_batch
    assert b == default_micro_batch(model) and b >= 1
    # as many sequences as fit the token budget, and one even past it
    assert b * seq <= MOE_MICRO_TOKENS or b == 1
    assert (b + 1) * seq > MOE_MICRO_TOKENS
    # the checkpoint's config holds the number, and reads back as it
    assert RunConfig.from_dict(run.to_dict()).train.micro_batch == b


@pytest.mark.parametrize("preset", ["gpt2-125m", "llama3.1-8b"])
def test_a_dense_model_keeps_its_micro_batch(preset):
    model = get_preset(preset).replace(seq_len=4096)
    assert run_of(model, TrainConfig()).train.micro_batch == DENSE_MICRO_BATCH


def test_a_given_micro_batch_is_kept_and_checked():
    model = get_preset("gpt-oss-20b")
    given = DENSE_MICRO_BATCH + 1
    assert run_of(model, TrainConfig(micro_batch=given)).train.micro_batch == given
    from fitgpt.errors import UserError

    with pytest.raises(UserError, match="--micro-batch 0 must be at least 1"):
        TrainConfig(micro_batch=0)


def test_plan_prints_the_micro_batch_it_prices(capsys):
    """`fitgpt plan` prices the run train makes: a tiny MoE at seq 4096 without --micro-batch."""
    argv = ("plan", "--preset", "qwen3-moe-30b-a3b", "--layers", "2", "--hidden", "64",
            "--heads", "4", "--seq-len", "4096", "--device", "cpu", "--cpu-mem", "64GB")  # fmt: skip
    code, out, err = run_main(capsys, *argv)
    assert code == 0, err
    b = int(re.search(r"micro-batch (\d+) ×", out).group(1))
    assert b == MOE_MICRO_TOKENS // 4096
    code, out, err = run_main(capsys, *argv, "--micro-batch", "3")
    assert code == 0 and "micro-batch 3 ×" in out, err


def test_the_planner_prices_expert_parallelism_when_not_given():
    model = get_preset("mixtral-8x7b").replace(n_layer=2)
    work = Workload(model, 1, 4, "bf16", "cuda", 10)
    assert Fixed.of({}).expert_parallel == 0  # auto
    priced = ep_degrees(work, Fixed.of({}), 1)
    assert priced[0] == 1 and {2, 4} <= set(priced)  # every P dividing 4 ranks and 8 experts
    assert ep_degrees(work, Fixed.of({"expert_parallel": 1}), 1) == [1]  # as given
    # a dense model has no experts to spread: P = 1 alone
    dense = Workload(get_preset("llama3.1-8b").replace(n_layer=2), 1, 4, "bf16", "cuda", 10)
    assert ep_degrees(dense, Fixed.of({}), 1) == [1]


def test_gpt_oss_120b_fits_four_h200s_with_int8_moments_and_their_disk(capsys):
    """The 4-GPU bar's shape (issue 50 (b)): from the defaults, with int8 moments and the box's
    disk, some plan fits, and it spreads the experts; at the dense micro-batch none does."""
    argv = ("plan", "--preset", "gpt-oss-120b", "--gpus", "4", "--gpu-mem", "139GiB",
            "--cpu-mem", "470GB", "--nvme", "230GiB", "--data", "synthetic", "--device", "cuda",
            "--moments", "int8")  # fmt: skip
    code, out, err = run_main(capsys, *argv)
    assert code == 0, err
    chosen = next(line for line in out.splitlines() if line.startswith("chosen:"))
    assert "expert-parallel" in chosen
    code, out, err = run_main(capsys, *argv, "--micro-batch", str(DENSE_MICRO_BATCH))
    assert code != 0 and "do not fit" in err
